"""Shared inputs for the verifier tests: rule cases and seeded random logits."""

from __future__ import annotations

import torch

from verifiers import get_rule

# (name, params): every registered rule, MARS with a theta that relaxes on shifted logits,
# overshoot with and without its min-p gate.
RULE_CASES = [
    ("lossless", {}),
    ("mars", {"theta": 0.8}),
    ("overshoot", {"lenience": 0.5}),
    ("overshoot", {"lenience": 0.7, "min_p": 0.3}),
    ("typical", {"epsilon": 0.2, "delta": 0.5}),
    ("min_p", {"p_base": 0.3}),
    ("cos", {"lam": 0.4}),
]
RULE_IDS = [name + "".join(f"-{k}{v}" for k, v in params.items()) for name, params in RULE_CASES]


def make_rule(case):
    name, params = case
    return get_rule(name, **params)


def chain_inputs(seed: int, b: int, k: int, v: int, temperature: float, shift: float = 0.0):
    """target [B, K+1, V], draft [B, K, V] correlated with the target, x ~ q (argmax at T = 0)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(b, k + 1, v, generator=g) * 2 + shift
    draft = target[:, :k] + torch.randn(b, k, v, generator=g)
    if temperature == 0:
        x = draft.argmax(-1)
    else:
        q = torch.softmax(draft / temperature, -1).reshape(-1, v)
        x = torch.multinomial(q, 1, generator=g).reshape(b, k) if b * k else torch.zeros(b, k).long()
    return target, draft, x


def candidate_inputs(seed: int, n: int, m: int, v: int, shift: float = 0.0):
    """target [N, V] and distinct candidates [N, m] (draft-score order), some rows -1 padded."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, v, generator=g) * 2 + shift
    draft = target + torch.randn(n, v, generator=g)
    cands = draft.topk(m, -1).indices
    for r in range(n):
        pad = int(torch.randint(0, m + 1, (1,), generator=g))  # pad the last `pad` slots
        if pad and r % 3 == 0:
            cands[r, m - pad:] = -1
    return target, cands
