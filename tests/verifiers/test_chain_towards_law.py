"""``verify_chain(..., test="law")`` (verifiers/sampled.py, ``verify_chain_towards_law``): a
chain of sampled drafts verified by rejection towards the law the rule's own test induces.

- Monte Carlo: at every position the emitted law is the rule's chain law (``induced_chain``;
  the bonus position p), exp(behaviour log-prob) is that law at the token, the target log-prob
  is log p, for every rule with parameters that relax, C++ walk and PyTorch loop;
- acceptance: each position accepts sum min(q, P_R): more than MARS's own test, as much as
  overshoot's (and the lossless rule runs its own test, which is that coupling);
- the C++ walk and the PyTorch loop emit the same tokens on the same uniforms at V = 49152;
- bad input is refused naming the field, row and position; T = 0 runs the rule's greedy test.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_verifiers_montecarlo import assert_matches
from verifier_cases import RULE_CASES, RULE_IDS

from verifiers import get_rule, induced_chain, native, target_probs, verify_chain

N = 200_000
V = 7
K = 2


def _chain_case(shift: float, seed: int = 21):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(K + 1, V, generator=g) * 1.5 + shift
    draft = torch.randn(K, V, generator=g) * 1.5 + shift
    draft[0, 0] = -math.inf  # a token outside the draft vocabulary
    return target, draft


def _drafts(draft: torch.Tensor, temperature: float, n: int, seed: int) -> torch.Tensor:
    q = torch.softmax(draft / temperature, -1)
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(K)], 1)


def _law(rule, target, draft, temperature, top_p=None) -> torch.Tensor:
    P = induced_chain(rule, target[:K], draft, temperature=temperature, top_p=top_p)
    return torch.cat([P, target_probs(target[K:], temperature, top_p=top_p)])  # bonus: p


@pytest.mark.parametrize("temperature, top_p", [(1.0, None), (0.8, 0.85)])
@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
def test_law_test_emits_the_rules_chain_law(case, temperature, top_p):
    """(Both backends: conftest's ``chain_backend``.)"""
    rule = case.rule()
    target, draft = _chain_case(case.shift(3.0))
    x = _drafts(draft, temperature, N, 1234)
    res = verify_chain(rule, target.expand(N, K + 1, V), draft.expand(N, K, V), x, temperature=temperature,
                       top_p=top_p, generator=torch.Generator().manual_seed(5), test="law")
    P = _law(rule, target, draft, temperature, top_p)
    p = torch.cat([target_probs(target[j:j + 1], temperature, top_p=top_p) for j in range(K + 1)])
    for j in range(K + 1):
        reached = res.num_emitted > j
        assert reached.sum() > 5000
        y = res.tokens[reached, j]
        assert_matches(y, P[j])
        torch.testing.assert_close(res.behaviour_logprobs[reached, j].exp(), P[j][y], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(res.target_logprobs[reached, j].exp(), p[j][y], atol=1e-5, rtol=1e-5)
    pad = torch.arange(K + 1) >= res.num_emitted[:, None]
    assert (res.tokens[pad] == -1).all() and (res.behaviour_logprobs[pad] == 0).all()
    assert (res.kinds[:, :K][~pad[:, :K]] != 2).all() and ((res.kinds[:, K] == 2) == (res.num_emitted == K + 1)).all()


@pytest.mark.parametrize("name, params", [("mars", {"theta": 0.5}), ("overshoot", {"lenience": 0.5}),
                                          ("lossless", {})])
def test_law_test_accepts_sum_min_q_law(name, params):
    """Position 0 accepts with probability sum min(q, P_R), the most any test of the law P_R has:
    more than MARS's own test (where MARS relaxes), as much as overshoot's and lossless's."""
    rule = get_rule(name, **params)
    target, draft = _chain_case(3.0, seed=5)
    x = _drafts(draft, 1.0, N, 3)
    runs = {test: verify_chain(rule, target.expand(N, K + 1, V), draft.expand(N, K, V), x, temperature=1.0,
                               generator=torch.Generator().manual_seed(4), test=test) for test in ("rule", "law")}
    P = induced_chain(rule, target[:1], draft[:1], temperature=1.0)[0].double()
    q = torch.softmax(draft[0].double(), -1)
    rate = {test: (r.num_emitted > 1).double().mean() for test, r in runs.items()}
    assert abs(rate["law"] - torch.minimum(q, P).sum()) < 4 / math.sqrt(N)
    if name == "mars":
        assert rate["law"] > rate["rule"] + 0.05
        assert runs["law"].relaxed.any()
    else:
        assert abs(rate["law"] - rate["rule"]) < 6 / math.sqrt(N)
    if name == "lossless":  # the lossless rule's own test is that coupling: the same call
        assert torch.equal(runs["law"].tokens, runs["rule"].tokens)


@pytest.mark.parametrize("rule", [get_rule("mars", theta=0.5), get_rule("overshoot", lenience=0.5, min_p=0.2),
                                  get_rule("typical"), get_rule("cos", lam=0.5)], ids=lambda r: r.name)
def test_cpp_and_torch_agree_on_the_same_uniforms(rule):
    """(Forces each backend itself, under either ``chain_backend``.)"""
    g = torch.Generator().manual_seed(11)
    b, k, v, vd = 32, 4, 49152, 8192
    target = torch.randn(b, k + 1, v, generator=g) * 3 + 10  # (+10: MARS's z2 / z1 exceeds theta)
    target[..., vd:] -= 8
    draft = torch.full((b, k, v), -math.inf)
    draft[..., :vd] = target[:, :k, :vd] + torch.randn(b, k, vd, generator=g) * 1.5
    for temperature, top_k in ((1.0, None), (0.7, 500)):
        q = torch.softmax(draft / temperature, -1)
        x = torch.multinomial(q.view(-1, v), 1, generator=g).view(b, k)
        out = {}
        for use in (True, False):
            with native.forced(use):
                out[use] = verify_chain(rule, target, draft, x, temperature=temperature, top_k=top_k,
                                        generator=torch.Generator().manual_seed(2), test="law")
        a, c = out[True], out[False]
        assert torch.equal(a.tokens, c.tokens) and torch.equal(a.num_emitted, c.num_emitted)
        assert torch.equal(a.kinds, c.kinds) and torch.equal(a.relaxed, c.relaxed)
        # the backends sum the V = 49152 exponentials of log Z in different orders (the C++ in its
        # SIMD width's partial sums: 16 lanes with AVX-512, 8 with AVX2), so the log-probs agree to
        # float32 rounding of that sum: up to 1.8e-5 measured on an AVX2 build, within 1e-5 on AVX-512
        torch.testing.assert_close(a.behaviour_logprobs, c.behaviour_logprobs, atol=5e-5, rtol=5e-5)
        torch.testing.assert_close(a.target_logprobs, c.target_logprobs, atol=5e-5, rtol=5e-5)
        assert 1 < a.num_emitted.double().mean() < k + 1, "accepts, rejections and bonus tokens all occur"


def test_bad_input_and_t0():
    rule = get_rule("mars", theta=0.5)
    target, draft = _chain_case(3.0)
    b = 4
    x = _drafts(draft, 1.0, b, 1)
    kw = {"temperature": 1.0, "test": "law"}
    with pytest.raises(ValueError, match="test must be one of"):
        verify_chain(rule, target.expand(b, -1, -1), draft.expand(b, -1, -1), x, generator=torch.Generator(),
                     temperature=1.0, test="best")
    for use in (True, False):
        with native.forced(use):
            bad = target.expand(b, -1, -1).clone()
            bad[2, 1, 3] = float("nan")
            with pytest.raises(ValueError, match=r"target_logits: the logit vector at row 2, position 1 contains NaN"):
                verify_chain(rule, bad, draft.expand(b, -1, -1), x, generator=torch.Generator(), **kw)
            zero = x.clone()
            zero[3, 0] = 0  # outside the draft vocabulary: q = 0
            with pytest.raises(ValueError, match=r"draft_tokens\[3, 0\] = 0 has zero probability"):
                verify_chain(rule, target.expand(b, -1, -1), draft.expand(b, -1, -1), zero,
                             generator=torch.Generator(), **kw)
    greedy = {test: verify_chain(rule, target.expand(b, -1, -1), draft.expand(b, -1, -1), draft.argmax(-1).expand(b, -1),
                                 temperature=0.0, generator=None, test=test) for test in ("rule", "law")}
    assert torch.equal(greedy["rule"].tokens, greedy["law"].tokens)


def test_the_walk_refuses_missing_draft_rows_and_bad_draft_ids():
    """The C++ walk reads a draft row only at nodes with children (a chain passes K rows, its
    node K is a leaf); fewer rows than that is refused, not read past the end, and so are draft
    ids outside the target vocabulary."""
    rule = get_rule("mars", theta=0.5)
    target, draft = _chain_case(3.0)
    b, v = 2, target.shape[-1]
    x = _drafts(draft, 1.0, b, 1)
    tokens = torch.cat([x.new_zeros(b, 1), x], 1)
    children = torch.tensor([[1], [2], [-1]])
    u_accept, u_final = torch.rand(b, K + 1, 1), torch.rand(b, K + 1)
    args = (target.expand(b, -1, -1), draft.expand(b, -1, -1), torch.arange(v), tokens, children, u_accept, u_final,
            1.0)
    with native.forced(True):
        assert native.walk_sampled_native(rule, *args)[-1].ge(1).all()
        short = (args[0], draft[:1].expand(b, -1, -1)) + args[2:]
        with pytest.raises(ValueError, match="z_draft has 1 node rows, but a node from 1 on has children"):
            native.walk_sampled_native(rule, *short)
        ids = torch.arange(v)
        ids[3] = v  # past the target vocabulary
        with pytest.raises(ValueError, match=rf"draft_ids must hold one target id in \[0, {v}\) per draft logit "
                                             rf"\({v}\); got {v} ids, {v} among them"):
            native.walk_sampled_native(rule, *args[:2], ids, *args[3:])
