"""Plain-Python bookkeeping of one generate call: which sequences are live, what they emitted.

Vocabulary:
- **sequence**: one prompt and its growing completion, identified by its index in the call.
- **live batch**: the sequences still generating, in the order of the runner's tensor rows
  (row r of every runner tensor belongs to ``table.live[r]``). When sequences finish, the
  table and the runner drop the same rows, so the orders stay aligned.
- **round output**: what the verifier emitted for each live row in one round, as host
  arrays ``[B, W]`` (W = most tokens one round can emit) with a count per row.

A call's prompts are validated here (:func:`prompt_budgets`). Stop and length truncation
happen here: a row's emitted tokens are cut after the first stop token or at its token
budget, and the row is marked finished. No tensors, no models.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rollout.outputs import Completion


@dataclass
class RoundOutput:
    """Host arrays for one round: tokens/logprobs/kinds/relaxed ``[B, W]``, counts ``[B]``."""

    tokens: np.ndarray
    counts: np.ndarray
    behaviour_logprobs: np.ndarray
    target_logprobs: np.ndarray
    kinds: np.ndarray
    relaxed: np.ndarray


@dataclass
class Sequence:
    index: int
    prompt_ids: list[int]
    max_new_tokens: int
    completion_ids: list[int] = field(default_factory=list)
    behaviour_logprobs: list[float] = field(default_factory=list)
    target_logprobs: list[float] = field(default_factory=list)
    kinds: list[int] = field(default_factory=list)
    relaxed: list[bool] = field(default_factory=list)
    step_emitted: list[int] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def to_completion(self) -> Completion:
        return Completion(
            prompt_ids=list(self.prompt_ids),
            completion_ids=self.completion_ids,
            behaviour_logprobs=self.behaviour_logprobs,
            target_logprobs=self.target_logprobs,
            kinds=self.kinds,
            relaxed=self.relaxed,
            step_emitted=self.step_emitted,
            finish_reason=self.finish_reason or "length",
        )


class SequenceTable:
    """The sequences of one call and the live-row order shared with the runner."""

    def __init__(self, prompts: list[list[int]], max_new_tokens: list[int], stop_token_ids: tuple[int, ...]):
        assert len(max_new_tokens) == len(prompts), "one token budget per prompt"
        self.sequences = [Sequence(i, list(p), m) for i, (p, m) in enumerate(zip(prompts, max_new_tokens))]
        self.live: list[int] = list(range(len(prompts)))
        self.stop_ids = frozenset(stop_token_ids)

    def __len__(self) -> int:
        return len(self.live)

    def append(self, out: RoundOutput, first: bool = False) -> list[bool]:
        """Append one round's tokens to the live rows; return, per row, whether it finished.

        first: the round is the prefill's single sampled token (not counted as a step).
        """
        tokens, counts = out.tokens.tolist(), out.counts.tolist()
        blp, tlp = out.behaviour_logprobs.tolist(), out.target_logprobs.tolist()
        kinds, relaxed = out.kinds.tolist(), out.relaxed.tolist()
        done = []
        for row, seq_idx in enumerate(self.live):
            seq = self.sequences[seq_idx]
            n = counts[row]
            if not first:
                seq.step_emitted.append(n)
            keep = min(n, seq.max_new_tokens - len(seq.completion_ids))
            toks = tokens[row][:keep]
            for i, t in enumerate(toks):
                if t in self.stop_ids:
                    keep = i + 1
                    seq.finish_reason = "stop"
                    break
            seq.completion_ids.extend(toks[:keep])
            seq.behaviour_logprobs.extend(blp[row][:keep])
            seq.target_logprobs.extend(tlp[row][:keep])
            seq.kinds.extend(kinds[row][:keep])
            seq.relaxed.extend(relaxed[row][:keep])
            if seq.finish_reason is None and len(seq.completion_ids) >= seq.max_new_tokens:
                seq.finish_reason = "length"
            done.append(seq.finished)
        return done

    def keep(self, rows: list[int]) -> None:
        """Keep only the given live rows (in this order)."""
        self.live = [self.live[r] for r in rows]

    def completion_lengths(self) -> list[int]:
        """Tokens emitted so far by each live row."""
        return [len(self.sequences[i].completion_ids) for i in self.live]

    def max_remaining(self) -> int:
        """The largest token budget a live row has left (0 when none is live)."""
        return max((self.sequences[i].max_new_tokens - len(self.sequences[i].completion_ids) for i in self.live),
                   default=0)

    def completions(self) -> list[Completion]:
        return [s.to_completion() for s in self.sequences]


def prompt_budgets(prompts: list[list[int]], max_new: int, context: int, vocab: int) -> list[int]:
    """Validate a call's prompts (lists of integer token ids in ``[0, vocab)``, each shorter than
    the target's ``context``; a bad one is named); each row's token budget, ``max_new`` capped
    by the context left after its prompt."""
    if not isinstance(prompts, (list, tuple)):
        raise TypeError(f"prompts must be a list of token-id lists, got {type(prompts).__name__}")
    budgets = []
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)):
            raise TypeError(f"prompts must be a list of token-id lists; prompt {i} is a {type(p).__name__} "
                            f"({p!r:.40}), not a list of token ids")
        bad = next((j for j, t in enumerate(p) if isinstance(t, bool) or not isinstance(t, (int, np.integer))), None)
        if bad is not None:
            raise TypeError(f"prompt {i} position {bad} is {type(p[bad]).__name__} {p[bad]!r:.40}: token ids "
                            "must be integers")
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty (every prompt needs at least one token)")
        if len(p) >= context:
            raise ValueError(f"prompt {i} has {len(p)} tokens but the target's context is {context} tokens "
                             "(max_position_embeddings): shorten or truncate it")
        if min(p) < 0 or max(p) >= vocab:
            raise ValueError(f"prompt {i} has token ids outside [0, {vocab})")
        budgets.append(min(max_new, context - len(p)))
    return budgets
