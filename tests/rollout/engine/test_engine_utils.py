"""Tiny models for the engine tests, and the laws and checks several engine test modules share
(no test functions here).

The target is a random 4-layer Llama whose layers after the first are damped. The draft
head starts as a "copy" head (the layer-1 feature through the target's own final norm and
lm_head, its decoder layer nearly silent) and ``trained_head`` then trains it for a few
seconds with the training-time-test loss on sequences the target sampled, using the same
pairing of tokens, features and positions as the engine. Its drafts are accepted often
enough to exercise every path of the engine (and a wrong pairing in the engine would show
up as a collapse of the acceptance length).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rollout.eagle3 import Eagle3Head
from rollout.models import TargetModel
from rollout.params import SamplingParams, SpecConfig
from verifiers import TokenKind, induced_candidates, induced_chain, target_logprobs
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
    return train_head(target, copy_head(target, draft_vocab, seed), steps, seed, ttt_steps)


def train_head(target: TargetModel, head: Eagle3Head, steps: int = 60, seed: int = 1, ttt_steps: int = 3) -> Eagle3Head:
    """``head`` trained for a few seconds on sequences the target samples itself (eval mode)."""
    from rollout.engine.engine import Engine
    from rollout.params import SamplingParams

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


def exact_three_token_law(target, prompt: list[int]) -> torch.Tensor:
    """P(y1, y2, y3 | prompt) [V, V, V] from full forwards (no cache) on the target's device,
    returned on the CPU."""
    v, dev = target.vocab_size, target.device
    with torch.no_grad():
        p1 = torch.softmax(target(torch.tensor([prompt], device=dev), use_cache=False).logits[0, -1], -1)
        pairs = torch.tensor(list(itertools.product(range(v), repeat=2)), device=dev)  # [V*V, 2]
        seqs = torch.cat([torch.tensor(prompt, device=dev).expand(len(pairs), -1), pairs], 1)
        logits = target(seqs, use_cache=False).logits  # [V*V, P+2, V]
        p2 = torch.softmax(logits[:, -2], -1).view(v, v, v)[:, 0]  # p(y2 | y1): rows y1
        p3 = torch.softmax(logits[:, -1], -1).view(v, v, v)  # p(y3 | y1, y2)
    return (p1[:, None, None] * p2[:, :, None] * p3).cpu()


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Chi-square goodness of fit, pooling cells with expected count < 5 into one; the p-value
    from torch's ``gammaincc`` (scipy's ``chisquare``, without scipy: the GPU check has none)."""
    n = counts.sum()
    expected = probs.flatten().double() * n
    counts = counts.flatten().double()
    small_cells = expected < 5
    obs, exp = counts[~small_cells], expected[~small_cells]
    if small_cells.any():
        obs = torch.cat([obs, counts[small_cells].sum()[None]])
        exp = torch.cat([exp, expected[small_cells].sum()[None]])
    exp = exp * obs.sum() / exp.sum()
    chi2 = ((obs - exp) ** 2 / exp).sum()
    return float(torch.special.gammaincc(torch.tensor((len(exp) - 1) / 2, dtype=torch.float64), chi2 / 2))


def assert_first_tokens_follow_the_target(target, prompt: list[int], completions, min_accepted: int) -> None:
    """The pairs (y1, y2) and (y2, y3) of ``completions`` of ``prompt`` follow the target's law
    (chi-square), enough drafts were accepted to mean something, and every behaviour log-prob is
    the target's (lossless: P = p)."""
    v = target.vocab_size
    ys = torch.tensor([c.completion_ids for c in completions])
    law = exact_three_token_law(target, prompt)
    assert chi2_pvalue(torch.bincount(ys[:, 0] * v + ys[:, 1], minlength=v * v), law.sum(2)) > 1e-3
    assert chi2_pvalue(torch.bincount(ys[:, 1] * v + ys[:, 2], minlength=v * v), law.sum(0)) > 1e-3
    assert sum(k == TokenKind.ACCEPTED for c in completions for k in c.kinds) > min_accepted
    for c in completions:
        assert c.behaviour_logprobs == pytest.approx(c.target_logprobs, abs=1e-5)


def induced_logprob(rule, rec, sampling) -> float:
    """log P(token) of ``rule``'s closed form at a debug record's logits (read on the CPU)."""
    kw = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
    tl = rec.target_logits.cpu()[None]
    if rec.draft_logits is not None:
        dist = induced_chain(rule, tl, rec.draft_logits.cpu()[None], **kw)
    elif rec.candidates is not None:
        dist = induced_candidates(rule, tl, rec.candidates.cpu()[None], **kw)
    else:
        dist = target_logprobs(tl, **kw).exp()
    return float(dist[0, rec.token].log())


def assert_speculative_greedy_equals_plain(engine, spec):
    """Greedy speculation under ``spec`` emits plain greedy decoding's tokens on ``PROMPTS`` (40 new
    tokens), every behaviour log-prob 0, with drafts accepted and fewer target forwards; returns the
    speculative result."""
    sampling = SamplingParams(temperature=0, max_new_tokens=40)
    ref = engine.generate(PROMPTS, sampling, SpecConfig(mode="off"))
    res = engine.generate(PROMPTS, sampling, spec)
    for a, b in zip(ref.completions, res.completions):
        assert b.completion_ids == a.completion_ids
        assert b.behaviour_logprobs == [0.0] * len(b.completion_ids)
    assert sum(k == TokenKind.ACCEPTED for c in res.completions for k in c.kinds) > 20, "drafts should be accepted"
    assert res.timings.target_forwards < ref.timings.target_forwards
    return res
