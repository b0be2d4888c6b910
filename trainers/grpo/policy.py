"""Log-probs of rollout completions under the policy the trainer holds.

The trainer's policy distribution is the same processed target distribution p that the
verifier used (temperature, top-k, top-p applied by ``verifiers.process_logits``), so for
a lossless rollout with the current weights log pi(y) equals the recorded behaviour
log-prob up to float error, and the importance weight is 1. Rows that repeat a prompt (a
GRPO group) can share its forward: ``trainers.grpo.forward_plan`` describes the three ways and
chooses between them.
"""

from __future__ import annotations

import inspect

import torch

from trainers.grpo.forward_plan import PATHS, ForwardCost, choose_path, distinct_prompts
from verifiers import process_logits

# attention implementations that take a custom 4D mask (bool for sdpa, additive for eager)
MASKED_ATTENTION = ("sdpa", "eager")


def _forward_params(model: torch.nn.Module) -> frozenset[str]:
    """The names the model's forward takes (empty where its signature cannot be read)."""
    try:
        return frozenset(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward computes logits for its last n positions only (HF causal LMs)."""
    return "logits_to_keep" in _forward_params(model)


def pack(prompt_ids: list[list[int]], completion_ids: list[list[int]], pad_id: int = 0,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded prompt+completion rows and where each completion's tokens are predicted.

    Returns input_ids [N, L], attention_mask [N, L], index [N, C] (the position whose
    logits predict completion token t, i.e. prompt_len - 1 + t) and completion_mask [N, C].
    """
    n = len(prompt_ids)
    lengths = [len(p) + len(c) for p, c in zip(prompt_ids, completion_ids, strict=True)]
    width = max(lengths, default=0)
    c_max = max((len(c) for c in completion_ids), default=0)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    attention = torch.zeros(n, width, dtype=torch.long)
    index = torch.zeros(n, c_max, dtype=torch.long)
    cmask = torch.zeros(n, c_max, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if not p:
            raise ValueError(f"row {i}: an empty prompt has no position that predicts the first token")
        row = list(p) + list(c)
        input_ids[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        attention[i, : len(row)] = 1
        index[i, : len(c)] = torch.arange(len(p) - 1, len(p) - 1 + len(c))
        cmask[i, : len(c)] = True
    return input_ids, attention, index, cmask


def cache_kwarg(model: torch.nn.Module) -> str | None:
    """The name under which the model's forward takes a KV cache (``cache`` in transformers 5), or None."""
    params = _forward_params(model)
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def forward_paths(model: torch.nn.Module, share_prompts: bool = True) -> tuple[str, ...]:
    """The ways ``completion_logprobs`` may run this model: ``whole`` always; with
    ``share_prompts`` and a Hugging Face causal LM (a config, a forward that takes a KV cache),
    ``cached``, and ``packed`` where its attention takes a custom 4D mask (sdpa or eager). A
    model with sliding-window layers runs ``whole`` only: a mask handed in is used as given,
    without the window, and a cache continued over right-padded prompts slides its window over
    the padding."""
    if not share_prompts or not hasattr(model, "config") or getattr(model.config, "sliding_window", None) is not None:
        return ("whole",)
    paths = ["whole"]
    if cache_kwarg(model) is not None:
        paths.append("cached")
        if getattr(model.config, "_attn_implementation", None) in MASKED_ATTENTION and "position_ids" in _forward_params(model):
            paths.append("packed")
    return tuple(paths)


def _whole_logits(model, input_ids, attention, index, cmask, device) -> torch.Tensor:
    """Logits [N, C, V] from one forward over the whole rows."""
    # only the positions from the first that predicts a completion token go through the
    # vocabulary-wide lm_head (a prompt is most of a row; lm_head is a fifth of SmolLM2's FLOPs)
    first = int(index[cmask].min()) if cmask.any() else input_ids.shape[1] - 1
    keep = input_ids.shape[1] - first
    kwargs = {"logits_to_keep": keep} if _takes_logits_to_keep(model) else {}
    out = model(input_ids=input_ids.to(device), attention_mask=attention.to(device), use_cache=False, **kwargs)
    offset = input_ids.shape[1] - out.logits.shape[1]  # `first`, or 0 for a model that keeps all
    hidden_idx = (index - offset).clamp(min=0).to(device)  # [N, C] (padded slots read any position)
    return out.logits.gather(1, hidden_idx.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1]))


def _cached_logits(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                   pad_id: int, device: torch.device) -> torch.Tensor:
    """Logits [N, C', V] (C' >= C): position t of row i predicts completion token t.

    Each distinct prompt but its last token runs once (right-padded); each row takes its
    prompt's KV cache (an index_select, so every row's gradient reaches the prompt's forward)
    and runs its last prompt token and its completion but the last on top, at their true
    positions, with the prompt's padding masked.
    """
    from transformers import DynamicCache

    heads, of_row = distinct_prompts(prompt_ids)
    n, p_w = len(prompt_ids), max(map(len, heads)) - 1
    prefix = torch.full((len(heads), p_w), pad_id, dtype=torch.long)
    p_mask = torch.zeros(len(heads), p_w, dtype=torch.long)
    for u, p in enumerate(heads):
        prefix[u, : len(p) - 1] = torch.tensor(p[:-1], dtype=torch.long)
        p_mask[u, : len(p) - 1] = 1
    keep = {"logits_to_keep": 1} if _takes_logits_to_keep(model) else {}
    out = model(input_ids=prefix.to(device), attention_mask=p_mask.to(device), use_cache=True, **keep)
    cache = getattr(out, "cache", None) or out.past_key_values
    sel = torch.tensor(of_row, device=device)
    rows_cache = DynamicCache(ddp_cache_data=[(layer.keys.index_select(0, sel), layer.values.index_select(0, sel))
                                              for layer in cache.layers], config=model.config)

    s_w = max(max(map(len, completion_ids)), 1)
    suffix = torch.full((n, s_w), pad_id, dtype=torch.long)
    s_mask = torch.zeros(n, s_w, dtype=torch.long)
    positions = torch.zeros(n, s_w, dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        row = [p[-1]] + list(c[:-1])  # position t predicts c[t]
        suffix[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        s_mask[i, : len(row)] = 1
        positions[i] = torch.arange(len(p) - 1, len(p) - 1 + s_w)
    attention = torch.cat([p_mask[of_row], s_mask], dim=1)
    out = model(input_ids=suffix.to(device), attention_mask=attention.to(device), position_ids=positions.to(device),
                use_cache=True, **{cache_kwarg(model): rows_cache})
    return out.logits


def _packed_logits(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                   pad_id: int, device: torch.device) -> torch.Tensor:
    """Logits [N, C, V]: position t of row i predicts completion token t.

    One sequence per distinct prompt: the prompt but its last token, then for each of its rows
    the last prompt token and the completion but its last token, at their true positions. The
    mask lets a prefix position see the prefix causally and a row's position the prefix and its
    own row causally; padding positions see only themselves (no query is left without a key).
    """
    heads, of_row = distinct_prompts(prompt_ids)
    seqs: list[list[int]] = [list(p[:-1]) for p in heads]
    pos: list[list[int]] = [list(range(len(p) - 1)) for p in heads]
    seg: list[list[int]] = [[-1] * (len(p) - 1) for p in heads]  # -1: the prompt; i: row i
    start = [0] * len(prompt_ids)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        if not c:
            continue  # nothing to predict
        u = of_row[i]
        start[i] = len(seqs[u])
        seqs[u] += [p[-1]] + list(c[:-1])
        pos[u] += range(len(p) - 1, len(p) - 1 + len(c))
        seg[u] += [i] * len(c)
    b, width = len(heads), max(map(len, seqs))
    input_ids = torch.full((b, width), pad_id, dtype=torch.long)
    positions = torch.arange(width).repeat(b, 1)
    segments = torch.full((b, width), -2, dtype=torch.long)  # -2: padding
    for u in range(b):
        input_ids[u, : len(seqs[u])] = torch.tensor(seqs[u], dtype=torch.long)
        positions[u, : len(pos[u])] = torch.tensor(pos[u], dtype=torch.long)
        segments[u, : len(seg[u])] = torch.tensor(seg[u], dtype=torch.long)
    query, key = segments.unsqueeze(2), segments.unsqueeze(1)
    allowed = torch.ones(width, width, dtype=torch.bool).tril() & (key != -2) & ((key == -1) | (key == query))
    # a padding query sees itself: some attention kernels give NaN to a query with no key
    allowed |= torch.eye(width, dtype=torch.bool) & (query == -2)
    mask = allowed.unsqueeze(1).to(device)  # [B, 1, W, W]
    if model.config._attn_implementation == "eager":  # additive
        dtype = next(model.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill(~mask, torch.finfo(dtype).min)
    first = min(len(p) for p in heads) - 1  # no row's first prediction comes earlier
    keep = {"logits_to_keep": width - first} if _takes_logits_to_keep(model) else {}
    out = model(input_ids=input_ids.to(device), attention_mask=mask, position_ids=positions.to(device),
                use_cache=False, **keep)
    offset = width - out.logits.shape[1]
    c_max = max(map(len, completion_ids))
    seq_of = torch.tensor(of_row).unsqueeze(1).expand(-1, c_max)
    at = torch.tensor(start).unsqueeze(1) + torch.arange(c_max)
    at = (at - offset).clamp(0, out.logits.shape[1] - 1)  # padded slots read any position
    return out.logits[seq_of.to(device), at.to(device)]


def completion_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        *, temperature: float, top_k: int | None = None, top_p: float | None = None,
                        pad_id: int = 0, share_prompts: bool = True, path: str | None = None,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t) [N, C] of each completion token (0 where padded) and the mask [N, C].

    ``model`` is a Hugging Face causal LM; gradients flow when grad mode is on. With
    ``share_prompts``, rows that repeat a prompt share its forward where that is cheaper
    (``forward_plan.choose_path``); ``path`` forces one of ``forward_plan.PATHS``. The values
    are the same up to float rounding whichever way runs.
    """
    if temperature <= 0:
        raise ValueError("policy log-probs need temperature > 0 (greedy rollouts have no gradient)")
    input_ids, attention, index, cmask = pack(prompt_ids, completion_ids, pad_id)
    device = next(model.parameters()).device
    paths = forward_paths(model, share_prompts)
    if path is not None:
        if path not in PATHS:
            raise ValueError(f"path {path!r} is not one of {PATHS}")
        if path not in paths:
            raise ValueError(f"path {path!r} does not apply to this model (it takes {paths})")
        paths = (path,)
    chosen = "whole" if paths == ("whole",) else choose_path(prompt_ids, completion_ids,
                                                               ForwardCost.of(model.config), paths)[0]
    c_w = index.shape[1]
    if chosen == "cached":
        logits = _cached_logits(model, prompt_ids, completion_ids, pad_id, device)[:, :c_w]
    elif chosen == "packed":
        logits = _packed_logits(model, prompt_ids, completion_ids, pad_id, device)
    else:
        logits = _whole_logits(model, input_ids, attention, index, cmask, device)
    logp = torch.log_softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)
    tokens = torch.zeros_like(index)
    for i, c in enumerate(completion_ids):
        tokens[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    picked = logp.gather(-1, tokens.to(device).unsqueeze(-1)).squeeze(-1)  # [N, C]
    cm = cmask.to(device)
    return torch.where(cm, picked, torch.zeros((), dtype=picked.dtype, device=device)), cm
