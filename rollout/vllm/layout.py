"""vLLM's flattened speculative layout <-> our padded ``[B, K]`` tensors.

vLLM's rejection sampler sees one step of a batch of R requests flattened:

- ``logits [T + R, V]``: every scored position of every request, request after request;
  ``target_logits_indices [T]`` picks the rows that score the T drafted tokens (request r's
  K_r drafts in order), ``bonus_logits_indices [R]`` the row after each request's last
  draft (the bonus position).
- ``draft_token_ids [T]`` and ``cu_num_draft_tokens [R]`` (cumulative K_r), and
  ``draft_probs [T, V]`` (q at the request's temperature, over the target vocabulary) when
  drafts were sampled from q (``draft_sample_method="probabilistic"``); None for greedy drafts.
- per-request sampling settings in ``SamplingMetadata`` (temperature [R], top_k [R] or
  None, top_p [R] or None).

Our verifiers take one temperature / top-k / top-p per call and ``[b, K+1, V]`` blocks, so
requests are grouped by (K, temperature, top-k, top-p): :func:`groups` returns one
:class:`Group` per distinct setting, each with the request rows and its padded tensors.
:func:`scatter_tokens` writes a group's ``[b, K+1]`` results back into vLLM's
``[R, max_K + 1]`` output (``-1`` = placeholder).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

GREEDY_EPS = 1e-5  # vLLM treats temperatures below this as greedy


@dataclass(frozen=True)
class Setting:
    """The sampling settings one verifier call shares (None = not truncated)."""

    k: int
    temperature: float
    top_k: int | None
    top_p: float | None


@dataclass
class Group:
    """Requests of one step that share a :class:`Setting`, as padded tensors."""

    setting: Setting
    rows: Tensor  # [b] long, request indices in the step's batch
    target_logits: Tensor  # [b, K+1, V] raw (unprocessed) target logits; last = bonus position
    draft_tokens: Tensor  # [b, K] long
    draft_probs: Tensor | None  # [b, K, V] q, or None (greedy drafts)


def request_settings(num_draft_tokens: list[int], temperature: Tensor | None, top_k: Tensor | None,
                     top_p: Tensor | None, vocab: int) -> list[Setting]:
    """Per request: its K and sampling settings (vLLM encodes 'no top-k' as k >= V or k <= 0,
    'no top-p' as p >= 1)."""
    r = len(num_draft_tokens)
    temps = [0.0] * r if temperature is None else temperature.tolist()
    ks = [None] * r if top_k is None else top_k.tolist()
    ps = [None] * r if top_p is None else top_p.tolist()
    out = []
    for n, t, k, p in zip(num_draft_tokens, temps, ks, ps):
        greedy = t < GREEDY_EPS
        k = None if greedy or k is None or k <= 0 or k >= vocab else int(k)
        p = None if greedy or p is None or p >= 1.0 else float(p)
        out.append(Setting(int(n), 0.0 if greedy else float(t), k, p))
    return out


def groups(settings: list[Setting], logits: Tensor, target_logits_indices: Tensor,
           bonus_logits_indices: Tensor, draft_token_ids: Tensor,
           draft_probs: Tensor | None) -> list[Group]:
    """Split one flattened step into :class:`Group` s (requests in each group keep their order)."""
    assert logits.dim() == 2 and draft_token_ids.dim() == 1
    dev = logits.device
    starts, pos = [], 0
    for s in settings:
        starts.append(pos)
        pos += s.k
    assert pos == draft_token_ids.shape[0], "draft tokens do not match cu_num_draft_tokens"
    by_setting: dict[Setting, list[int]] = {}
    for i, s in enumerate(settings):
        by_setting.setdefault(s, []).append(i)
    out = []
    for s, reqs in by_setting.items():
        k = s.k
        flat = torch.tensor([starts[i] + j for i in reqs for j in range(k)], dtype=torch.long, device=dev)
        rows = torch.tensor(reqs, dtype=torch.long, device=dev)
        b = len(reqs)
        # logits rows: the K drafted positions, then the bonus position
        idx = torch.cat([target_logits_indices.long()[flat].view(b, k),
                         bonus_logits_indices.long()[rows].view(b, 1)], dim=1)  # [b, K+1]
        target = _rows(logits, idx.flatten()).view(b, k + 1, -1).float()
        tokens = draft_token_ids.long()[flat].view(b, k)
        q = None
        if draft_probs is not None and k > 0 and s.temperature > 0:
            q = _rows(draft_probs, flat).view(b, k, -1)
        out.append(Group(s, rows, target, tokens, q))
    return out


def _rows(t: Tensor, idx: Tensor) -> Tensor:
    """t[idx] for a 1-d index: a view when the rows are consecutive (the usual case: one group,
    requests in order, vLLM's rows of a request contiguous), else a copy."""
    n = idx.numel()
    if n and int(idx[-1]) - int(idx[0]) == n - 1 and bool((idx.diff() == 1).all()):
        return t[int(idx[0]):int(idx[0]) + n]
    return t.index_select(0, idx)


def scatter_tokens(out: Tensor, rows: Tensor, values: Tensor) -> None:
    """Write ``values [b, K+1]`` into ``out [R, W]`` at ``rows`` (columns 0..K)."""
    out[rows, : values.shape[1]] = values.to(out.dtype)
