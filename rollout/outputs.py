"""What ``Engine.generate`` returns.

Vocabulary (the verification terms are those of the ``verifiers`` package):
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

import dataclasses
import math
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
    setup_s: everything before the first round (checking or packing the weights for the linear
    kernel, the prefill, the first token); ``total_s - setup_s`` is the decoding.
    """

    draft_s: float = 0.0
    verify_s: float = 0.0
    other_s: float = 0.0
    total_s: float = 0.0
    setup_s: float = 0.0
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
class Capture:
    """What the target computed for one row of a plain-decoding call (``generate(capture=True)``),
    at every position it ran: the prompt tokens and every completion token but the last
    (``n = len(prompt) + len(completion) - 1`` positions).

    features ``[n, 3H]``: the EAGLE-3 features (inputs of the aux layers, ``rollout.models``);
    final ``[n, H]``: the final norm's output, so the target logits are ``lm_head(final)``.
    """

    features: torch.Tensor
    final: torch.Tensor


@dataclass
class GenerationResult:
    """Completions in prompt order, the call's timings, and (when asked) debug records and
    per-row captures."""

    completions: list[Completion]
    timings: Timings
    debug: list[DebugRecord] | None = None
    captures: list[Capture] | None = None

    @property
    def tau(self) -> float:
        return self.timings.tau

    def to_batch(self, policy_version: int = 0, pad_id: int = 0) -> RolloutBatch:
        return RolloutBatch.from_completions(self.completions, self.timings, policy_version, pad_id)


def tau_with_error(step_emitted: list[list[int]]) -> tuple[float, float]:
    """tau over rows (each row's tokens emitted per round, ``Completion.step_emitted``) and its
    standard error with the rows as the independent units: a round's acceptance depends on the
    rounds before it in its row, so rounds are not independent, rows are. The error is the ratio
    estimator's, linearised: ``sqrt(sum_i (e_i - tau r_i)^2 / (n (n - 1))) / mean_i r_i`` over the n
    rows that took a round (e_i: their tokens, r_i: their rounds). NaN with fewer than 2 such rows."""
    rows = [(sum(s), len(s)) for s in step_emitted if s]
    rounds = sum(r for _, r in rows)
    if not rounds:
        return 0.0, math.nan
    tau = sum(e for e, _ in rows) / rounds
    n = len(rows)
    if n < 2:
        return tau, math.nan
    spread = sum((e - tau * r) ** 2 for e, r in rows) / (n * (n - 1))
    return tau, math.sqrt(spread) / (rounds / n)


#: the work counters a RolloutBatch keeps in ``timings`` (summed when batches are joined)
COUNTERS = ("target_forwards", "draft_forwards", "rounds", "row_rounds", "emitted", "tokens",
            "plain_rounds", "plain_row_rounds")
#: the wall-clock parts of ``timings`` (summed when joined, except total_s: the slowest part's)
SECONDS = ("draft_s", "verify_s", "other_s", "total_s")
#: the per-token tensors of a RolloutBatch, [N, C] each
TOKEN_FIELDS = ("completion_ids", "completion_mask", "behaviour_logprobs", "target_logprobs", "kinds", "relaxed")


@dataclass
class RolloutBatch:
    """Completions of one call as right-padded tensors: what every rollout backend returns.

    It is the one shape that leaves a backend (``rollout.backend.RolloutBackend``), crosses
    the Ray actor boundary, and is consumed as it is by the GRPO trainer and the TRL
    plug-in. prompt_ids [N, P] and completion_ids [N, C] are right-padded with ``pad_id``;
    the per-token tensors are [N, C], zero (kind -1) where ``completion_mask`` is False.
    ``timings`` holds the wall-clock split (``SECONDS``) and the work counters
    (``COUNTERS``) of the call; ``tau`` is emitted / row_rounds from those counters.
    ``policy_version`` is the version of the weights that generated every row.
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

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def prompt_lengths(self) -> list[int]:
        return self.prompt_mask.sum(1).tolist()

    @property
    def completion_lengths(self) -> list[int]:
        return self.completion_mask.sum(1).tolist()

    def prompt_lists(self) -> list[list[int]]:
        """Each row's prompt token ids without padding."""
        return [row[:n].tolist() for row, n in zip(self.prompt_ids, self.prompt_lengths)]

    def completion_lists(self) -> list[list[int]]:
        """Each row's completion token ids without padding."""
        return [row[:n].tolist() for row, n in zip(self.completion_ids, self.completion_lengths)]

    def token_lists(self, name: str) -> list[list]:
        """A per-token field (e.g. ``"behaviour_logprobs"``) as one unpadded list per row."""
        if name not in TOKEN_FIELDS:
            raise ValueError(f"unknown per-token field {name!r} (allowed: {', '.join(TOKEN_FIELDS)})")
        values = getattr(self, name)
        return [row[:n].tolist() for row, n in zip(values, self.completion_lengths)]

    def select(self, rows: list[int]) -> RolloutBatch:
        """The given rows, in that order, trimmed to their own widths; timings kept as they are."""
        idx = torch.tensor(rows, dtype=torch.long)
        p = max((self.prompt_lengths[i] for i in rows), default=0)
        c = max((self.completion_lengths[i] for i in rows), default=0)
        return dataclasses.replace(
            self, prompt_ids=self.prompt_ids[idx, :p], prompt_mask=self.prompt_mask[idx, :p],
            finish_reasons=[self.finish_reasons[i] for i in rows], timings=dict(self.timings),
            **{name: getattr(self, name)[idx, :c] for name in TOKEN_FIELDS})

    @staticmethod
    def cat(batches: list[RolloutBatch]) -> RolloutBatch:
        """Rows of every batch in order, re-padded to the widest; counters summed.

        Seconds are summed too, except ``total_s``, the slowest batch's (parallel
        actors). Every batch must come from one policy version and share ``pad_id``.
        """
        if not batches:
            raise ValueError("cat needs at least one RolloutBatch")
        versions = {b.policy_version for b in batches}
        if len(versions) != 1:
            raise ValueError(f"cannot join rollouts of different policy versions {sorted(versions)}")
        pads = {b.pad_id for b in batches}
        if len(pads) != 1:
            raise ValueError(f"cannot join rollouts padded with different ids {sorted(pads)}")
        pad_id = pads.pop()

        def join(name: str, fill) -> torch.Tensor:
            parts = [getattr(b, name) for b in batches]
            width = max(t.shape[1] for t in parts)
            return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill) for t in parts])

        timings = {k: sum(b.timings.get(k, 0.0) for b in batches) for k in COUNTERS + SECONDS}
        timings["total_s"] = max(b.timings.get("total_s", 0.0) for b in batches)
        fills = {"completion_ids": pad_id, "kinds": -1}
        return RolloutBatch(
            prompt_ids=join("prompt_ids", pad_id), prompt_mask=join("prompt_mask", False),
            finish_reasons=[r for b in batches for r in b.finish_reasons],
            tau=_tau(timings), timings=timings, policy_version=versions.pop(), pad_id=pad_id,
            **{name: join(name, fills.get(name, 0)) for name in TOKEN_FIELDS})

    @staticmethod
    def from_completions(completions: list[Completion], timings: Timings,
                         policy_version: int = 0, pad_id: int = 0) -> RolloutBatch:
        n = len(completions)
        p = max((len(c.prompt_ids) for c in completions), default=0)
        c_len = max((c.num_tokens for c in completions), default=0)
        counters = {k: float(getattr(timings, k)) for k in COUNTERS + SECONDS}
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
            timings=counters,
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


def _tau(timings: dict[str, float]) -> float:
    return timings["emitted"] / timings["row_rounds"] if timings.get("row_rounds") else 0.0
