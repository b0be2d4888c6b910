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


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the model's forward computes logits for its last n positions only (HF causal LMs)."""
    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


def length_order(prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[int]:
    """Row indices by prompt + completion length: micro-batches cut from this order pad less."""
    return sorted(range(len(prompt_ids)), key=lambda i: len(prompt_ids[i]) + len(completion_ids[i]))


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


def completion_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                        *, temperature: float, top_k: int | None = None, top_p: float | None = None,
                        pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(y_t) [N, C] of each completion token (0 where padded) and the mask [N, C].

    ``model`` is a Hugging Face causal LM; gradients flow when grad mode is on.
    """
    if temperature <= 0:
        raise ValueError("policy log-probs need temperature > 0 (greedy rollouts have no gradient)")
    input_ids, attention, index, cmask = pack(prompt_ids, completion_ids, pad_id)
    device = next(model.parameters()).device
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
