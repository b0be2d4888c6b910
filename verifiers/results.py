"""What a verification step returns.

Vocabulary: an emitted token is *accepted* (a drafted candidate that passed), *recovered*
(sampled after a rejection) or *bonus* (sampled from p when every candidate on the path was
accepted). Its *behaviour log-prob* is log P(y) under the induced distribution P the verifier
actually sampled from at that position; its *target log-prob* is log p(y). A token is
*relaxed* when it was accepted with a higher probability than the lossless rule would have
given that candidate (the lossy part of the rule fired for it).

Diagnostics (optional), per position, from the closed-form P at that position (P = p at the
bonus position): ``tv`` = TV(P, p), ``kl`` = KL(P || p) (inf where P puts mass outside supp p),
``entropy_P``, ``entropy_p``, and ``uncovered`` = the mass of the untruncated tempered target
softmax(logits / T) on {P == 0} (top-k / top-p truncation and lossy point masses both count).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import Tensor

DIAGNOSTIC_KEYS = ("tv", "kl", "entropy_P", "entropy_p", "uncovered")


class TokenKind(enum.IntEnum):
    """Kind of each entry of ``ChainResult.tokens`` (stored as int8)."""

    PAD = -1
    ACCEPTED = 0
    RECOVERED = 1
    BONUS = 2


@dataclass(frozen=True)
class ChainResult:
    """One chain verification step over B rows with K drafted tokens each."""

    tokens: Tensor  # [B, K+1] long, -1 after the last emitted token
    num_emitted: Tensor  # [B] long, in 1..K+1
    behaviour_logprobs: Tensor  # [B, K+1] float32, log P(y); 0 where padded
    target_logprobs: Tensor  # [B, K+1] float32, log p(y); 0 where padded
    kinds: Tensor  # [B, K+1] int8, TokenKind values
    relaxed: Tensor  # [B, K+1] bool
    diagnostics: dict[str, Tensor] | None = None  # each [B, K+1]; 0 where padded


@dataclass(frozen=True)
class CandidateResult:
    """One verification of N nodes, each with up to m deterministic candidates."""

    tokens: Tensor  # [N] long, the emitted token
    accepted_index: Tensor  # [N] long, index of the accepted candidate, -1 if none
    behaviour_logprobs: Tensor  # [N] float32, log P(y)
    target_logprobs: Tensor  # [N] float32, log p(y)
    relaxed: Tensor  # [N] bool
    diagnostics: dict[str, Tensor] | None = None  # each [N]


def empty_chain_result(k: int, device: torch.device, diagnostics: bool) -> ChainResult:
    """The correct result for B = 0."""
    long = torch.empty(0, k + 1, dtype=torch.long, device=device)
    flt = torch.empty(0, k + 1, dtype=torch.float32, device=device)
    diag = {key: flt.clone() for key in DIAGNOSTIC_KEYS} if diagnostics else None
    return ChainResult(long, torch.empty(0, dtype=torch.long, device=device), flt, flt.clone(),
                       torch.empty(0, k + 1, dtype=torch.int8, device=device),
                       torch.empty(0, k + 1, dtype=torch.bool, device=device), diag)


def empty_candidate_result(device: torch.device, diagnostics: bool) -> CandidateResult:
    """The correct result for N = 0."""
    long = torch.empty(0, dtype=torch.long, device=device)
    flt = torch.empty(0, dtype=torch.float32, device=device)
    diag = {key: flt.clone() for key in DIAGNOSTIC_KEYS} if diagnostics else None
    return CandidateResult(long, long.clone(), flt, flt.clone(),
                           torch.empty(0, dtype=torch.bool, device=device), diag)
