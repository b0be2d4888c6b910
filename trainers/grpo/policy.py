"""Log-probs of rollout completions under the policy the trainer holds.

The trainer's policy distribution is the same processed target distribution p that the
verifier used (temperature, top-k, top-p applied by ``verifiers.process_logits``), so for
a lossless rollout with the current weights log pi(y) equals the recorded behaviour
log-prob up to float error, and the importance weight is 1.
"""

from __future__ import annotations

import inspect

import torch

from verifiers import process_logits


def _forward_params(model: torch.nn.Module) -> frozenset[str]:
    """The names the model's forward takes (empty where its signature cannot be read)."""
    try:
        return frozenset(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return frozenset()


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward computes logits for its last n positions only (HF causal LMs)."""
    return "logits_to_keep" in _forward_params(model)


def length_order(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[int]:
    """Row indices by prompt + completion length: micro-batches cut from this order pad less."""
    return sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))


def group_order(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[int]:
    """Row indices with each prompt's rows together (prompts by length), each group by completion length."""
    _, of_row = distinct_prompts(prompt_ids)
    return sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), of_row[i], len(completion_ids[i])))


def forward_tokens(prompt_ids: list[list[int]], completion_ids: list[list[int]], shared: bool) -> int:
    """Padded token positions one micro-batch sends through the model: with ``shared`` and a
    repeated prompt, each distinct prompt's prefix once plus every row's completion block, else
    every row at the longest row's width (what ``completion_logprobs`` runs)."""
    heads, _ = distinct_prompts(prompt_ids)
    n = len(prompt_ids)
    if shared and len(heads) < n and min(map(len, prompt_ids)) >= 2:
        return len(heads) * (max(map(len, heads)) - 1) + n * max(max(map(len, completion_ids)), 1)
    return n * max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids))


def micro_batches(prompt_ids: list[list[int]], completion_ids: list[list[int]], size: int, *,
                  shared: bool) -> list[list[int]]:
    """The rows cut into micro-batches of ``size``, in whichever order (length order, or prompt
    groups kept together) sends fewer padded positions through the model. The gradient is a sum
    over micro-batches, so the cut changes only float rounding."""
    best: tuple[int, list[list[int]]] | None = None
    for order in (length_order(prompt_ids, completion_ids), group_order(prompt_ids, completion_ids)):
        cut = [order[a:a + size] for a in range(0, len(order), size)]
        cost = sum(forward_tokens([prompt_ids[i] for i in rows], [completion_ids[i] for i in rows], shared)
                   for rows in cut)
        if best is None or cost < best[0]:
            best = (cost, cut)
        if not shared:
            break  # without sharing, length order pads least
    return best[1] if best else []


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


def _cache_kwarg(model: torch.nn.Module) -> str | None:
    """The name under which the model's forward takes a KV cache (``cache`` in transformers 5), or None."""
    params = _forward_params(model)
    return next((name for name in ("cache", "past_key_values") if name in params), None)


def distinct_prompts(prompt_ids: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct prompts in first-seen order, and each row's index among them."""
    seen: dict[tuple[int, ...], int] = {}
    of_row = [seen.setdefault(tuple(p), len(seen)) for p in prompt_ids]
    return list(seen), of_row


def takes_cache(model: torch.nn.Module) -> bool:
    """Whether the model's forward takes and returns a KV cache (HF causal LMs): what the
    shared-prompt forward needs."""
    return _cache_kwarg(model) is not None and hasattr(model, "config")


def _shares_prompts(model: torch.nn.Module, prompt_ids: list[list[int]]) -> bool:
    """Whether the shared-prompt forward applies: a prompt repeats, every prompt has a token
    before its last (the prefix run once), and the model takes a cache."""
    return (len(distinct_prompts(prompt_ids)[0]) < len(prompt_ids) and min(map(len, prompt_ids)) >= 2
            and takes_cache(model))


def _completion_logits_shared(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                              pad_id: int, device: torch.device) -> torch.Tensor:
    """Logits [N, C, V]: position t of row i predicts completion token t, each distinct prompt run once.

    A GRPO group repeats its prompt G times, and the prompt is most of a row. So each distinct
    prompt but its last token runs once (right-padded); each row takes its prompt's KV cache
    (an index_select, so every row's gradient reaches the prompt's forward) and runs its last
    prompt token and its completion but the last on top, at their true positions, with the
    prompt's padding masked. The same function as one forward over the whole row.
    """
    from transformers import DynamicCache

    heads, of_row = distinct_prompts(prompt_ids)
    n, p_w = len(prompt_ids), max(map(len, heads)) - 1
    prefix = torch.full((len(heads), p_w), pad_id, dtype=torch.long)
    p_mask = torch.zeros(len(heads), p_w, dtype=torch.long)
    for u, p in enumerate(heads):
        prefix[u, : len(p) - 1] = torch.tensor(p[:-1], dtype=torch.long)
        p_mask[u, : len(p) - 1] = 1
    name = _cache_kwarg(model)
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
                use_cache=True, **{name: rows_cache})
    return out.logits


def completion_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        *, temperature: float, top_k: int | None = None, top_p: float | None = None,
                        pad_id: int = 0, share_prompts: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t) [N, C] of each completion token (0 where padded) and the mask [N, C].

    ``model`` is a Hugging Face causal LM; gradients flow when grad mode is on. Rows that
    repeat a prompt run it once (``share_prompts``, for a model that takes a KV cache);
    the values are the same up to float rounding.
    """
    if temperature <= 0:
        raise ValueError("policy log-probs need temperature > 0 (greedy rollouts have no gradient)")
    input_ids, attention, index, cmask = pack(prompt_ids, completion_ids, pad_id)
    device = next(model.parameters()).device
    if share_prompts and _shares_prompts(model, prompt_ids):
        logits = _completion_logits_shared(model, prompt_ids, completion_ids, pad_id, device)[:, : index.shape[1]]
    else:
        # only the positions from the first that predicts a completion token go through the
        # vocabulary-wide lm_head (a prompt is most of a row; lm_head is a fifth of SmolLM2's FLOPs)
        first = int(index[cmask].min()) if cmask.any() else input_ids.shape[1] - 1
        keep = input_ids.shape[1] - first
        kwargs = {"logits_to_keep": keep} if _takes_logits_to_keep(model) else {}
        out = model(input_ids=input_ids.to(device), attention_mask=attention.to(device), use_cache=False, **kwargs)
        offset = input_ids.shape[1] - out.logits.shape[1]  # `first`, or 0 for a model that keeps all
        hidden_idx = (index - offset).clamp(min=0).to(device)  # [N, C] (padded slots read any position)
        logits = out.logits.gather(1, hidden_idx.unsqueeze(-1).expand(-1, -1, out.logits.shape[-1]))  # [N, C, V]
    logp = torch.log_softmax(process_logits(logits, temperature, top_k, top_p), dim=-1)
    tokens = torch.zeros_like(index)
    for i, c in enumerate(completion_ids):
        tokens[i, : len(c)] = torch.tensor(c, dtype=torch.long)
    picked = logp.gather(-1, tokens.to(device).unsqueeze(-1)).squeeze(-1)  # [N, C]
    cm = cmask.to(device)
    return torch.where(cm, picked, torch.zeros((), dtype=picked.dtype, device=device)), cm
