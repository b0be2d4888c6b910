"""What ``Engine.generate`` returns.

Vocabulary (see ../shared/design/VERIFICATION.md):
- **behaviour log-prob**: log P(y) of each emitted token under the distribution the
  verifier really sampled it from (the induced distribution); equals the target log-prob
  log p(y) for the lossless rule.
- **target log-prob**: log p(y) under the processed target distribution at rollout time.
- **kind**: ``verifiers.TokenKind`` value per token: accepted (0), recovered (1), bonus (2).
  The first completion token of every row is sampled from the prefill's p: a bonus.
- **relaxed**: the rule emitted the token from a relaxed (lossy) branch (e.g. MARS).
- **round**: one draft + verify cycle of the batch (one target forward); ``step_emitted``
  lists, per round the row took part in, how many tokens the verifier emitted for it
  (accepted + 1) before stop/length truncation.
- **tau**: mean tokens emitted per row per round (the mean acceptance length).

:class:`Completion` and :class:`GenerationResult` are plain Python (lists); the
:class:`RolloutBatch` is the one padded-tensor dataclass that crosses the Ray actor
boundary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Completion:
    """One prompt's completion; every per-token list has ``len(completion_ids)`` entries."""

    prompt_ids: list[int]
    completion_ids: list[int]
    behaviour_logprobs: list[float]
    target_logprobs: list[float]
    kinds: list[int]
    relaxed: list[bool]
    step_emitted: list[int]
    finish_reason: str  # "stop" | "length"

    @property
    def num_tokens(self) -> int:
        return len(self.completion_ids)


@dataclass
class Timings:
    """Wall-clock split of one call (seconds) and work counters.

    draft_s: draft-head forwards and candidate selection; verify_s: target forwards
    (prefill included) and the verifier; other_s: the rest (bookkeeping, cache moves).
    """

    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0
    target_forwards: int = 0
    draft_forwards: int = 0
    rounds: int = 0
    row_rounds: int = 0
    emitted: int = 0
    tokens: int = 0
    plain_rounds: int = 0  # rounds without drafting (more rows than spec.max_batch)
    plain_row_rounds: int = 0

    @property
    def tau(self) -> float:
        """Mean tokens emitted per row per round (1.0 for plain autoregressive decoding)."""
        return self.emitted / self.row_rounds if self.row_rounds else 0.0

    @property
    def draft_tau(self) -> float:
        """Mean tokens emitted per row per drafting round (plain rounds emit one token each)."""
        rr = self.row_rounds - self.plain_row_rounds
        return (self.emitted - self.plain_row_rounds) / rr if rr else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.total_s if self.total_s > 0 else 0.0


@dataclass
class DebugRecord:
    """Everything needed to recompute the induced distribution of one emitted token.

    chain-sampled positions carry ``draft_logits [V]`` (target vocabulary, -inf outside
    the draft vocabulary); deterministic candidates (tree nodes, greedy chains) carry
    ``candidates [m]`` (-1 padded, possibly all -1 = plain sampling from p). A bonus token
    of a sampled chain has neither (P = p).
    """

    row: int  # index of the prompt in the call
    index: int  # position in the completion
    step_position: int  # position within its round (chain position / tree level)
    token: int
    target_logits: torch.Tensor  # [V]
    draft_logits: torch.Tensor | None = None  # [V]
    candidates: torch.Tensor | None = None  # [m]


@dataclass
class GenerationResult:
    """Completions in prompt order, the call's timings, and (when asked) debug records."""

    completions: list[Completion]
    timings: Timings
    debug: list[DebugRecord] | None = None

    @property
    def tau(self) -> float:
        return self.timings.tau

    def to_batch(self, policy_version: int = 0) -> RolloutBatch:
        return RolloutBatch.from_completions(self.completions, self.timings, policy_version)


@dataclass
class RolloutBatch:
    """Completions of one call as right-padded tensors: what a rollout actor returns.

    prompt_ids [N, P] and completion_ids [N, C] are padded with ``pad_id``; the per-token
    tensors are [N, C], zero (kind -1) where ``completion_mask`` is False.
    """

    prompt_ids: torch.Tensor  # [N, P] int64
    prompt_mask: torch.Tensor  # [N, P] bool
    completion_ids: torch.Tensor  # [N, C] int64
    completion_mask: torch.Tensor  # [N, C] bool
    behaviour_logprobs: torch.Tensor  # [N, C] float32
    target_logprobs: torch.Tensor  # [N, C] float32
    kinds: torch.Tensor  # [N, C] int8
    relaxed: torch.Tensor  # [N, C] bool
    finish_reasons: list[str]
    tau: float
    timings: dict[str, float] = field(default_factory=dict)
    policy_version: int = 0
    pad_id: int = 0

    @staticmethod
    def from_completions(completions: list[Completion], timings: Timings,
                         policy_version: int = 0, pad_id: int = 0) -> RolloutBatch:
        n = len(completions)
        p = max((len(c.prompt_ids) for c in completions), default=0)
        c_len = max((c.num_tokens for c in completions), default=0)
        out = RolloutBatch(
            prompt_ids=torch.full((n, p), pad_id, dtype=torch.long),
            prompt_mask=torch.zeros(n, p, dtype=torch.bool),
            completion_ids=torch.full((n, c_len), pad_id, dtype=torch.long),
            completion_mask=torch.zeros(n, c_len, dtype=torch.bool),
            behaviour_logprobs=torch.zeros(n, c_len),
            target_logprobs=torch.zeros(n, c_len),
            kinds=torch.full((n, c_len), -1, dtype=torch.int8),
            relaxed=torch.zeros(n, c_len, dtype=torch.bool),
            finish_reasons=[c.finish_reason for c in completions],
            tau=timings.tau,
            timings={"draft_s": timings.draft_s, "verify_s": timings.verify_s, "other_s": timings.other_s,
                     "total_s": timings.total_s, "tokens": float(timings.tokens)},
            policy_version=policy_version,
            pad_id=pad_id,
        )
        for i, c in enumerate(completions):
            lp, lc = len(c.prompt_ids), c.num_tokens
            out.prompt_ids[i, :lp] = torch.tensor(c.prompt_ids, dtype=torch.long)
            out.prompt_mask[i, :lp] = True
            if lc:
                out.completion_ids[i, :lc] = torch.tensor(c.completion_ids, dtype=torch.long)
                out.completion_mask[i, :lc] = True
                out.behaviour_logprobs[i, :lc] = torch.tensor(c.behaviour_logprobs)
                out.target_logprobs[i, :lc] = torch.tensor(c.target_logprobs)
                out.kinds[i, :lc] = torch.tensor(c.kinds, dtype=torch.int8)
                out.relaxed[i, :lc] = torch.tensor(c.relaxed, dtype=torch.bool)
        return out
