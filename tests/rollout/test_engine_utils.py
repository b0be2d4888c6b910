"""Tiny models for the engine tests (no test functions here).

The target is a random 4-layer Llama whose layers after the first are damped. The draft
head starts as a "copy" head (the layer-1 feature through the target's own final norm and
lm_head, its decoder layer nearly silent) and ``trained_head`` then trains it for a few
seconds with the training-time-test loss on sequences the target sampled, using the same
pairing of tokens, features and positions as the engine. Its drafts are accepted often
enough to exercise every path of the engine (and a wrong pairing in the engine would show
up as a collapse of the acceptance length).
"""

from __future__ import annotations

import pytest
import torch

from rollout.eagle3 import Eagle3Head
from rollout.models import TargetModel
from tests.models import copy_head, tiny_target  # noqa: F401 (re-exported to the engine tests)


PROMPTS = [[1, 2, 3, 4, 5], [7, 8], list(range(10, 30)), [3]]


def _ttt_loss(head: Eagle3Head, tokens: torch.Tensor, feats: torch.Tensor, probs: torch.Tensor,
              steps: int) -> torch.Tensor:
    """EAGLE-3 training-time-test loss on sequences ``tokens [N, L]`` with target features
    ``feats [N, L, 3H]`` and target next-token probabilities ``probs [N, L, V]``.

    Step 0 pairs token i+1 with feature i (position i) and predicts token i+2; step s
    pairs token i+1+s with step s-1's output hidden at i (position i+s), seeing step-0 keys
    up to i and its own earlier steps at i: what the engine does when drafting.
    """
    n, length = tokens.shape
    m = length - 1 - steps
    idx = torch.arange(m)
    causal = idx[None, :] <= idx[:, None]  # [m, m]
    hidden, past, loss = feats[:, :m], None, 0.0
    keep = probs[..., head.target_ids]
    keep = keep / keep.sum(-1, keepdim=True)
    for s in range(steps):
        eye = torch.eye(m, dtype=torch.bool)
        mask = (causal if s == 0 else torch.cat([causal] + [eye] * s, dim=1)).expand(n, m, -1)
        d = head(tokens[:, 1 + s:1 + s + m], hidden, (idx + s).expand(n, m), mask, past)
        target = keep[:, 1 + s:1 + s + m]  # the target's distribution of token i+2+s
        loss = loss + 0.8 ** s * -(target * torch.log_softmax(d.logits, -1)).sum(-1).mean()
        hidden, past = d.hidden, d.kv
    return loss


def trained_head(target: TargetModel, draft_vocab: int | None = None, steps: int = 60, seed: int = 1,
                 ttt_steps: int = 3) -> Eagle3Head:
    """A head trained for a few seconds on sequences the target samples itself."""
    from rollout.engine import Engine
    from rollout.params import SamplingParams

    head = copy_head(target, draft_vocab, seed)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, target.vocab_size, (3,), generator=gen).tolist() for _ in range(24)]
    engine = Engine(target, num_threads=torch.get_num_threads())
    res = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=25), seed=seed)
    tokens = torch.tensor([c.prompt_ids + c.completion_ids for c in res.completions])  # [24, 28]
    with torch.no_grad():
        out = target(tokens, use_cache=False)
    feats, probs = out.features, torch.softmax(out.logits, -1)
    head.train()
    opt = torch.optim.Adam([p for p in head.parameters() if p.requires_grad], lr=5e-3)
    for _ in range(steps):
        opt.zero_grad()
        _ttt_loss(head, tokens, feats, probs, ttt_steps).backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module", autouse=False)
def single_thread():
    """Run a module's engines on one thread (tiny models; the CPU may be shared), then restore."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield 1
    torch.set_num_threads(before)
