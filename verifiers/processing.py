"""Logit processing and sampling primitives shared by every verifier, the engine and the trainer.

Vocabulary (see verifiers/README.md):
- processed logits z: ``logits / T`` in float32, set to -inf outside the sampling support
  (top-k, then top-p, applied to the *target* only). At T = 0 (greedy) z is 0 at the
  argmax (the first index on ties) and -inf elsewhere, so p is one-hot.
- target distribution p = softmax(z).
- draft distribution q = softmax(draft_logits / T): the same temperature, never truncated
  (top-k / top-p act on p only). Draft logits may be -inf outside an EAGLE-3 draft vocabulary.
- a NaN or +inf logit, or a row that is all -inf, makes the whole softmax row NaN; the
  verifiers detect bad rows that way and raise, naming the row.

Everything that needs p (the verifiers, the engine's plain sampling, the trainer's
pi_theta) must call these functions so that they all see exactly the same distribution.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# Elements per chunk in full-vocabulary passes (16 MB of float32): big enough that per-op
# overhead stays small (B = 8, K = 7 over SmolLM2's 49152 tokens is one chunk: 1.3x faster
# than two), small enough that temporaries are reused instead of page-faulted in.
CHUNK_ELEMENTS = 1 << 22


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    """Raise ValueError for temperature < 0, top_k < 1 or top_p outside (0, 1]."""
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise ValueError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an integer >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or in (0, 1], got {top_p!r}")


def _top_k(z: Tensor, k: int) -> Tensor:
    """Keep logits >= the k-th largest of their row (ties at the boundary are kept)."""
    if k >= z.shape[-1]:
        return z
    kth = torch.topk(z, k, dim=-1).values[..., -1:]  # [..., 1]
    return z.masked_fill(z < kth, -math.inf)


def _top_p(z: Tensor, top_p: float) -> Tensor:
    """Keep the smallest prefix (by decreasing p) whose mass reaches top_p; ties at the boundary kept."""
    if top_p >= 1:
        return z
    sorted_z = torch.sort(z, dim=-1, descending=True).values  # [..., V]
    probs = torch.softmax(sorted_z, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs  # exclusive cumulative mass
    keep = (mass_before < top_p).sum(-1, keepdim=True).clamp(min=1)  # [..., 1], >= 1
    threshold = sorted_z.gather(-1, keep - 1)  # [..., 1]
    return z.masked_fill(z < threshold, -math.inf)


def process_logits(logits: Tensor, temperature: float, top_k: int | None = None,
                   top_p: float | None = None) -> Tensor:
    """Processed target logits z [..., V] (float32): z / T with -inf outside the top-k/top-p support.

    T = 0 is greedy: 0 at the argmax, -inf elsewhere (top-k/top-p are then irrelevant).
    The draft uses :func:`draft_logits` instead (same T, no truncation).
    """
    check_sampling(temperature, top_k, top_p)
    if temperature == 0:
        v1 = logits.argmax(-1, keepdim=True)  # [..., 1]
        out = torch.full(logits.shape, -math.inf, dtype=torch.float32, device=logits.device)
        return out.scatter_(-1, v1, 0.0)
    z = logits.float()
    z = z / temperature if temperature != 1 else z
    if top_k is not None:
        z = _top_k(z, top_k)
    if top_p is not None:
        z = _top_p(z, top_p)
    return z


def draft_logits(logits: Tensor, temperature: float) -> Tensor:
    """Processed draft logits (float32 ``logits / T``); q = softmax of this. Requires T > 0."""
    if temperature <= 0:
        raise ValueError("draft_logits needs temperature > 0 (at T = 0 the draft token is given)")
    z = logits.float()
    return z / temperature if temperature != 1 else z


def target_probs(logits: Tensor, temperature: float, top_k: int | None = None,
                 top_p: float | None = None) -> Tensor:
    """p = softmax(process_logits(...)) [..., V]."""
    return torch.softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)


def target_logprobs(logits: Tensor, temperature: float, top_k: int | None = None,
                    top_p: float | None = None) -> Tensor:
    """log p [..., V] (-inf outside the support)."""
    return torch.log_softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)


def draft_probs(logits: Tensor, temperature: float) -> Tensor:
    """q = softmax(draft_logits / T) [..., V] (T > 0)."""
    return torch.softmax(draft_logits(logits, temperature), dim=-1)


def _block_size(vocab: int) -> int | None:
    """A block size dividing vocab for the two-level top-2 search (None: use torch.topk)."""
    if vocab < 4096:
        return None
    return next((bs for bs in range(64, 257) if vocab % bs == 0), None)


def _first_max(z: Tensor) -> tuple[Tensor, Tensor]:
    """(max, index of its first occurrence) over the last dim, each [..., 1]."""
    idx = z.argmax(-1, keepdim=True)  # torch.argmax returns the first maximal index
    return z.gather(-1, idx), idx


def top2(z: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Top-2 values and tokens of the last dim: (z1, z2, v1, v2), each [...]. Ties go to the
    lowest index: v1 is the first maximal token, v2 the first token other than v1 holding the
    second largest value (counted with multiplicity). The fused C++ verifier does the same.

    Large vocabularies use a two-level search (vectorised block maxima, then exact searches in
    two blocks), several times faster than a full-row search on the CPU. Every caller
    (verifiers, references, closed forms) goes through this function, so ties resolve alike.
    """
    vocab = z.shape[-1]
    if vocab < 2:  # a one-token vocabulary has no second token
        v1 = torch.zeros(z.shape[:-1], dtype=torch.long, device=z.device)
        return z[..., 0], torch.full_like(z[..., 0], -math.inf), v1, v1
    bs = _block_size(vocab)
    if bs is None:
        z1, v1 = _first_max(z)
        z2, v2 = _first_max(z.scatter(-1, v1, -math.inf))
        return z1.squeeze(-1), z2.squeeze(-1), v1.squeeze(-1), v2.squeeze(-1)
    # no reshape of the leading dims: z may be a strided slice, which a reshape would copy
    blocks = z.unflatten(-1, (vocab // bs, bs))  # [..., nb, bs]

    def block(b: Tensor) -> Tensor:  # the block b [..., 1] of each row: [..., bs]
        return blocks.gather(-2, b.unsqueeze(-1).expand(*b.shape[:-1], 1, bs)).squeeze(-2)

    maxima = blocks.amax(-1)  # [..., nb]
    b1 = maxima.argmax(-1, keepdim=True)  # the first block holding the max
    first = block(b1)
    z1, i1 = _first_max(first)
    # the runner-up: inside v1's block (v1 excluded) or the best other block, lowest index on ties
    z_in, i_in = _first_max(first.scatter(-1, i1, -math.inf))
    z_out, b_out = _first_max(maxima.scatter(-1, b1, -math.inf))
    _, i_out = _first_max(block(b_out))
    v_in, v_out = b1 * bs + i_in, b_out * bs + i_out
    inside = (z_in > z_out) | ((z_in == z_out) & (v_in < v_out))
    z2, v2 = torch.where(inside, z_in, z_out), torch.where(inside, v_in, v_out)
    return z1.squeeze(-1), z2.squeeze(-1), (b1 * bs + i1).squeeze(-1), v2.squeeze(-1)


def sample_inverse_cdf(weights: Tensor, u: Tensor) -> Tensor:
    """One token per row from unnormalised weights [R, V] >= 0 (each row with positive mass)
    using one uniform u [R] in [0, 1): the first index whose cumulative weight exceeds u * total.

    Never picks a zero-weight token: the cumulative sum is non-decreasing and the target is
    kept strictly below the row total (u * total can round up to the total).
    """
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)  # [R, V]
    total = cdf[:, -1:]  # [R, 1]
    target = u.double().unsqueeze(-1) * total
    target = torch.minimum(target, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, target, right=True).squeeze(-1)
