"""How the trainer runs a batch of completions through the policy: which forward, which micro-batches.

A GRPO group repeats its prompt, and the prompt is most of a row (about 65 of make run's ~100
tokens), so ``completion_logprobs`` has three ways to run a micro-batch:

- ``whole``: every row whole (prompt + completion), right-padded to the longest row;
- ``cached``: each distinct prompt but its last token once, right-padded; every row takes its
  prompt's KV cache and runs its last prompt token and completion on top (padded to the
  longest completion);
- ``packed``: per distinct prompt one sequence: the prompt but its last token, then each of its
  rows' last prompt token and completion back to back, under a mask that lets a completion see
  the prompt and itself only (no padding inside a group; attention over the whole packed
  sequence, most of it masked, so it pays while the sequences stay short).

All three compute the same log-probs and gradient up to float rounding. The choice is made
from multiply-accumulates counted from the model's shape (:class:`ForwardCost`): weights per
position, plus attention per (query, key) pair, which an attention with a mask computes
whether masked or not. The functions here are pure: they read token lists, not models.
"""

from __future__ import annotations

from dataclasses import dataclass

PATHS = ("whole", "cached", "packed")


@dataclass(frozen=True)
class ForwardCost:
    """Multiply-accumulates of a forward: ``per_token`` for each position through the decoder
    layers' weights, ``per_pair`` for each (query, key) pair of attention over all layers."""

    per_token: float
    per_pair: float

    @classmethod
    def of(cls, config) -> ForwardCost:
        """From a Hugging Face decoder config (Llama-style fields; SmolLM2-135M's where absent)."""
        layers = getattr(config, "num_hidden_layers", 30)
        hidden = getattr(config, "hidden_size", 576)
        heads = getattr(config, "num_attention_heads", 9)
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        kv = getattr(config, "num_key_value_heads", None) or heads
        inter = getattr(config, "intermediate_size", 4 * hidden)
        per_layer = hidden * (heads + 2 * kv) * head_dim + heads * head_dim * hidden + 3 * hidden * inter
        return cls(per_token=float(layers * per_layer), per_pair=float(2 * layers * heads * head_dim))

    def forward(self, rows: int, width: int, keys: int | None = None) -> float:
        """``rows`` sequences of ``width`` positions attending to ``keys`` keys each (default: width)."""
        return rows * width * (self.per_token + (width if keys is None else keys) * self.per_pair)


def distinct_prompts(prompt_ids: list[list[int]]) -> tuple[list[tuple[int, ...]], list[int]]:
    """The distinct prompts in first-seen order, and each row's index among them."""
    seen: dict[tuple[int, ...], int] = {}
    of_row = [seen.setdefault(tuple(p), len(seen)) for p in prompt_ids]
    return list(seen), of_row


def packed_lengths(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[int]:
    """The length of each distinct prompt's packed sequence: its prefix and its rows' completions."""
    heads, of_row = distinct_prompts(prompt_ids)
    lengths = [len(p) - 1 for p in heads]
    for u, c in zip(of_row, completion_ids):
        lengths[u] += len(c)
    return lengths


def path_costs(prompt_ids: list[list[int]], completion_ids: list[list[int]], cost: ForwardCost,
               paths: tuple[str, ...] = PATHS) -> dict[str, float]:
    """The cost of each of ``paths`` that applies to this micro-batch (``whole`` always does; the
    shared ones need a repeated prompt and prompts of two tokens or more)."""
    n = len(prompt_ids)
    out = {}
    if "whole" in paths:
        out["whole"] = cost.forward(n, max(len(p) + len(c) for p, c in zip(prompt_ids, completion_ids)))
    heads, _ = distinct_prompts(prompt_ids)
    if len(heads) == n or min(map(len, prompt_ids)) < 2:
        return out
    prefix = max(map(len, heads)) - 1
    suffix = max(max(map(len, completion_ids)), 1)
    if "cached" in paths:
        out["cached"] = cost.forward(len(heads), prefix) + cost.forward(n, suffix, prefix + suffix)
    if "packed" in paths:
        out["packed"] = cost.forward(len(heads), max(packed_lengths(prompt_ids, completion_ids)))
    return out


def choose_path(prompt_ids: list[list[int]], completion_ids: list[list[int]], cost: ForwardCost,
                paths: tuple[str, ...] = PATHS) -> tuple[str, float]:
    """The cheapest applicable path of ``paths`` for this micro-batch, and its cost."""
    costs = path_costs(prompt_ids, completion_ids, cost, paths)
    if not costs:
        raise ValueError(f"no path of {paths} applies to this micro-batch (allowed paths: {PATHS})")
    return min(costs.items(), key=lambda kv: kv[1])


def length_order(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[int]:
    """Row indices by prompt + completion length: micro-batches cut from this order pad less."""
    return sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))


def group_order(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[int]:
    """Row indices with each prompt's rows together (prompts by length), each group by completion length."""
    _, of_row = distinct_prompts(prompt_ids)
    return sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), of_row[i], len(completion_ids[i])))


def micro_batches(prompt_ids: list[list[int]], completion_ids: list[list[int]], size: int, *,
                  cost: ForwardCost, paths: tuple[str, ...] = PATHS) -> list[list[int]]:
    """The rows cut into micro-batches of ``size``, in whichever order (length order, or prompt
    groups kept together) costs less with each micro-batch's cheapest path. The gradient is a
    sum over micro-batches, so the cut changes only float rounding."""
    best: tuple[float, list[list[int]]] | None = None
    for order in (length_order(prompt_ids, completion_ids), group_order(prompt_ids, completion_ids)):
        cut = [order[a:a + size] for a in range(0, len(order), size)]
        total = sum(choose_path([prompt_ids[i] for i in rows], [completion_ids[i] for i in rows], cost, paths)[1]
                    for rows in cut)
        if best is None or total < best[0]:
            best = (total, cut)
    return best[1] if best else []
