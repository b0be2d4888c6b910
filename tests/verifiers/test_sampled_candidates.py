"""Sampled candidates (verifiers/sampled.py): recursive rejection over candidates drawn from q
without replacement emits exactly p, and, started from a lossy rule's chain law P_R(p, q),
exactly P_R.

- closed form: enumerating every ordered draw of m candidates (its probability under
  sequential sampling without replacement) with a float64 reference of the recursion written
  here gives P = p to 1e-12, for truncated targets and drafts with holes;
- the batched verifier against that reference: for fixed candidates its empirical law is the
  reference's conditional law; with candidates from ``draw_without_replacement`` it is p;
- lossy rules: with drawn candidates (C++ and PyTorch) the emitted law is the rule's chain law
  (``induced_chain``, the closed form of its sampled chain), the behaviour log-prob is
  log P_R(y), the target log-prob log p(y), and ``relaxed`` marks accepted candidates that
  P_R favours over p; the one-candidate coupling accepts as overshoot's chain does and more
  than MARS's;
- ``draw_without_replacement`` draws ordered pairs with the Plackett-Luce probabilities;
- bad input is refused, naming what is wrong.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_verifiers_montecarlo import assert_matches

from verifiers import get_rule, induced_chain, target_probs, verify_chain
from verifiers.sampled import draw_without_replacement, verify_sampled_candidates

V = 6
N = 200_000
LOSSLESS = get_rule("lossless")


def _case(seed: int, top_k: int | None = None, hole: bool = True):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    draft = torch.randn(V, generator=g, dtype=torch.float64) * 1.5
    if hole:
        draft[1] = -math.inf  # outside the draft vocabulary
    z = target.clone()
    if top_k is not None:
        z[z < z.topk(top_k).values[-1]] = -math.inf
    p = torch.softmax(z, -1)
    assert torch.allclose(p.float(), target_probs(target.float(), 1.0, top_k), atol=1e-6)
    q = torch.softmax(draft, -1)
    return target.float(), draft.float(), p, q


def _reference(p: list[float], q: list[float], cands: tuple[int, ...]) -> list[float]:
    """P(y | candidates) of the recursion, in float64, one candidate at a time."""
    s, rest = list(p), list(q)
    out, reach = [0.0] * len(p), 1.0
    for c in cands:
        total = sum(rest)
        q_i = [r / total for r in rest]
        a = min(1.0, s[c] / q_i[c])
        out[c] += reach * a
        reach *= 1 - a
        r = [max(si - qi, 0.0) for si, qi in zip(s, q_i)]
        if sum(r) > 0:
            s = [x / sum(r) for x in r]
        rest[c] = 0.0
    return [o + reach * si for o, si in zip(out, s)]


def _draw_probability(q: list[float], cands: tuple[int, ...]) -> float:
    prob, left = 1.0, 1.0
    for c in cands:
        prob *= q[c] / left
        left -= q[c]
    return prob


@pytest.mark.parametrize("m", [1, 2, 3, 5])
@pytest.mark.parametrize("seed, top_k, hole", [(0, None, True), (1, 3, True), (2, None, False), (3, 2, False)])
def test_enumeration_gives_p(m, seed, top_k, hole):
    _, _, p, q = _case(seed, top_k, hole)
    p, q = p.tolist(), q.tolist()
    support = [i for i in range(V) if q[i] > 0]
    P = [0.0] * V
    total = 0.0
    for cands in itertools.permutations(support, min(m, len(support))):
        w = _draw_probability(q, cands)
        total += w
        P = [a + w * b for a, b in zip(P, _reference(p, q, cands))]
    assert total == pytest.approx(1.0, abs=1e-12)
    assert P == pytest.approx(p, abs=1e-12)
    if m > 1:  # the conditional law is not p: the test above is not trivially true
        assert max(abs(a - b) for a, b in zip(_reference(p, q, tuple(support[:m])), p)) > 1e-3


def _verify(target, draft, cands, seed, top_k=None):
    n = cands.shape[0]
    return verify_sampled_candidates(LOSSLESS, target.expand(n, V), draft.expand(n, V), cands, temperature=1.0,
                                     top_k=top_k, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("cands", [(0,), (2, 0), (3, 4, 0), (5, 2, 3, 0, 4)])
def test_conditional_law_matches_reference(cands):
    target, draft, p, q = _case(0)
    res = _verify(target, draft, torch.tensor(cands).expand(N, -1), seed=1)
    expected = torch.tensor(_reference(p.tolist(), q.tolist(), cands))
    assert_matches(res.tokens, expected)
    assert torch.allclose(res.behaviour_logprobs, p.log()[res.tokens].float(), atol=1e-6)
    assert torch.equal(res.behaviour_logprobs, res.target_logprobs)
    acc = res.accepted_index >= 0
    assert torch.equal(res.tokens[acc], torch.tensor(cands)[res.accepted_index[acc]])


@pytest.mark.parametrize("m, top_k", [(1, None), (2, None), (3, 3), (4, None)])
def test_drawn_candidates_emit_p(m, top_k):
    target, draft, p, _ = _case(1 + m, top_k)
    g = torch.Generator().manual_seed(7)
    cands = draw_without_replacement(draft.expand(N, V), m, 1.0, g)
    assert (cands != 1).all(), "drew a token outside the draft vocabulary"
    res = _verify(target, draft, cands, seed=8, top_k=top_k)
    assert_matches(res.tokens, p)


LOSSY = [("mars", {"theta": 0.5}), ("overshoot", {"lenience": 0.5}), ("overshoot", {"lenience": 0.4, "min_p": 0.3}),
         ("typical", {}), ("min_p", {"p_base": 0.2}), ("cos", {"lam": 0.3})]


@pytest.mark.parametrize("name, params", LOSSY, ids=[f"{n}-{'-'.join(map(str, p.values()))}" for n, p in LOSSY])
@pytest.mark.parametrize("m, top_k", [(1, None), (3, 4)])
def test_lossy_rules_emit_their_chain_law(name, params, m, top_k):
    """Drawn candidates verified towards a lossy rule emit its sampled chain's law P_R: the
    law, the log-probs and ``relaxed`` against the closed form ``induced_chain``."""
    rule = get_rule(name, **params)
    target, draft, p, _ = _case(5, top_k)
    target = target + 5  # the same p; MARS's ratio z2 / z1 then exceeds theta (it relaxes)
    n = N // 2
    cands = draw_without_replacement(draft.expand(n, V), m, 1.0, torch.Generator().manual_seed(9))
    res = verify_sampled_candidates(rule, target.expand(n, V), draft.expand(n, V), cands, temperature=1.0,
                                    top_k=top_k, generator=torch.Generator().manual_seed(10))
    law = induced_chain(rule, target[None], draft[None], temperature=1.0, top_k=top_k)[0].double()
    assert (law - p).abs().sum() > 0.05, "the rule's law differs from p here: the test can fail"
    assert_matches(res.tokens, law)
    torch.testing.assert_close(res.behaviour_logprobs, law.log()[res.tokens].float(), atol=2e-6, rtol=2e-6)
    torch.testing.assert_close(res.target_logprobs, p.log()[res.tokens].float(), atol=2e-6, rtol=2e-6)
    acc = res.accepted_index >= 0
    favoured = acc & (law[res.tokens] > p[res.tokens])
    assert torch.equal(res.relaxed, favoured) and favoured.any()


def test_a_rule_that_does_not_relax_here_emits_p_and_flags_nothing():
    """MARS with theta above every ratio z2 / z1 is lossless: P_R = p exactly, nothing relaxed."""
    target, draft, p, _ = _case(5)
    n = 20_000
    cands = draw_without_replacement(draft.expand(n, V), 2, 1.0, torch.Generator().manual_seed(5))
    res = verify_sampled_candidates(get_rule("mars", theta=0.999), target.expand(n, V) + 5, draft.expand(n, V), cands,
                                    temperature=1.0, generator=torch.Generator().manual_seed(6))
    assert (res.accepted_index >= 0).any() and not res.relaxed.any()
    torch.testing.assert_close(res.behaviour_logprobs, res.target_logprobs, atol=1e-6, rtol=1e-6)


def test_lossy_coupling_accepts_at_least_as_the_chain_rule():
    """One candidate verified towards P_R accepts sum min(q, P_R): for overshoot exactly the
    chain rule's acceptance sum min(q, p / l), for MARS (where it relaxes) more than q(v1) + q(v2)."""
    target, draft, p, _ = _case(5)
    target = target + 5  # (MARS relaxes)
    n = N
    cands = draw_without_replacement(draft.expand(n, V), 1, 1.0, torch.Generator().manual_seed(3))
    for name, params in (("overshoot", {"lenience": 0.5}), ("mars", {"theta": 0.5})):
        rule = get_rule(name, **params)
        res = verify_sampled_candidates(rule, target.expand(n, V), draft.expand(n, V), cands, temperature=1.0,
                                        generator=torch.Generator().manual_seed(4))
        chain = verify_chain(rule, target.expand(n, 2, V), draft.expand(n, 1, V), cands, temperature=1.0,
                             generator=torch.Generator().manual_seed(4))
        law = induced_chain(rule, target[None], draft[None], temperature=1.0)[0].double()
        q = torch.softmax(draft.double(), -1)
        towards = torch.minimum(q, law).sum()
        rate, chain_rate = (res.accepted_index >= 0).double().mean(), (chain.num_emitted > 1).double().mean()
        assert abs(rate - towards) < 4 / math.sqrt(n)
        if name == "overshoot":
            assert towards == pytest.approx(float(torch.minimum(q, p / 0.5).sum()), abs=1e-6)  # (P in float32)
            assert abs(rate - chain_rate) < 6 / math.sqrt(n)
        else:
            assert rate > chain_rate + 0.02


def test_draws_follow_plackett_luce():
    _, draft, _, q = _case(4)
    g = torch.Generator().manual_seed(3)
    pairs = draw_without_replacement(draft.expand(N, V), 2, 1.0, g)
    assert (pairs[:, 0] != pairs[:, 1]).all()
    law = torch.zeros(V * V, dtype=torch.float64)
    for a, b in itertools.permutations(range(V), 2):
        law[a * V + b] = _draw_probability(q.tolist(), (a, b))
    assert_matches(pairs[:, 0] * V + pairs[:, 1], law)


def test_draws_pad_when_q_has_fewer_tokens():
    logits = torch.tensor([[0.0, -math.inf, 1.0, -math.inf]])
    ids = draw_without_replacement(logits, 3, 1.0, torch.Generator().manual_seed(0))
    assert ids[0, 2] == -1 and set(ids[0, :2].tolist()) == {0, 2}


def test_bad_input_is_refused():
    target, draft, _, _ = _case(0)
    t, d, c = target[None], draft[None], torch.tensor([[0, 2]])
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="temperature > 0"):
        verify_sampled_candidates(LOSSLESS, t, d, c, temperature=0.0, generator=g)
    with pytest.raises(ValueError, match="position 1: token 1 has draft probability 0"):
        verify_sampled_candidates(LOSSLESS, t, d, torch.tensor([[0, 1]]), temperature=1.0, generator=g)
    with pytest.raises(ValueError, match="draft_logits shape"):
        verify_sampled_candidates(LOSSLESS, t, d[:, :4], c, temperature=1.0, generator=g)
    bad = t.clone()
    bad[0, 3] = float("nan")
    with pytest.raises(ValueError, match="target_logits.*row 0"):
        verify_sampled_candidates(LOSSLESS, bad, d, c, temperature=1.0, generator=g)
    with pytest.raises(ValueError, match="repeats a token"):
        verify_sampled_candidates(LOSSLESS, t, d, torch.tensor([[2, 2]]), temperature=1.0, generator=g)


@pytest.mark.parametrize("rule", [LOSSLESS, get_rule("mars", theta=0.5), get_rule("overshoot", lenience=0.5),
                                  get_rule("overshoot", lenience=0.5, min_p=0.2), get_rule("typical"),
                                  get_rule("min_p", p_base=0.1), get_rule("cos", lam=0.5)], ids=lambda r: r.name)
def test_cpp_and_torch_agree_on_the_same_uniforms(rule):
    """The fused kernels (csrc/sampled.cpp; a lossy rule's chain law from rules.h) and the PyTorch
    code (``rule.induced``) draw and verify alike on a 49,152-token vocabulary (a draft vocabulary
    of 8192 inside it), at T = 1 and T = 0.7 with top-k."""
    from verifiers import native

    g = torch.Generator().manual_seed(11)
    n, v, vd = 128, 49152, 8192
    target = torch.randn(n, v, generator=g) * 3 + 10  # (+10: MARS's z2 / z1 exceeds theta)
    target[:, vd:] -= 8  # most of p inside the draft vocabulary
    draft_small = target[:, :vd] + torch.randn(n, vd, generator=g) * 1.5
    draft = torch.full((n, v), -math.inf)
    draft[:, :vd] = draft_small
    for temperature, top_k in ((1.0, None), (0.7, 500)):
        out = {}
        for use in (True, False):
            with native.forced(use):
                cands = draw_without_replacement(draft_small, 3, temperature, torch.Generator().manual_seed(1))
                res = verify_sampled_candidates(rule, target, draft, cands, temperature=temperature, top_k=top_k,
                                                generator=torch.Generator().manual_seed(2))
            out[use] = cands, res
        (c1, r1), (c0, r0) = out[True], out[False]
        assert torch.equal(c1, c0)
        assert torch.equal(r1.tokens, r0.tokens) and torch.equal(r1.accepted_index, r0.accepted_index)
        # the backends sum the V = 49152 exponentials of log Z in different orders (the C++ in its
        # SIMD width's partial sums: 16 lanes with AVX-512, 8 with AVX2), so the log-probs agree to
        # float32 rounding of that sum: up to 1.8e-5 measured on an AVX2 build, within 1e-5 on AVX-512
        torch.testing.assert_close(r1.behaviour_logprobs, r0.behaviour_logprobs, atol=5e-5, rtol=5e-5)
        torch.testing.assert_close(r1.target_logprobs, r0.target_logprobs, atol=5e-5, rtol=5e-5)
        assert torch.equal(r1.relaxed, r0.relaxed) and (rule is LOSSLESS) == (not r1.relaxed.any())
        accepted = (r1.accepted_index >= 0).float().mean()
        assert 0.05 < accepted < 0.95, "both branches (accept, fallback) are exercised"
        assert (r1.accepted_index >= 1).any(), "later candidates are accepted too"
