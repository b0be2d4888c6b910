"""Registry, the rule Protocol, closed forms against brute-force enumeration, and the
reductions of verifiers/README.md (every P sums to 1; lossless P = p; limits that are lossless)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from verifier_cases import RULE_CASES, RULE_IDS, candidate_inputs, chain_inputs

from verifiers import (RULES, VerificationRule, get_rule, induced_candidates, induced_chain,
                       target_probs, verify_chain)
from verifiers.reference import brute_force_candidates, brute_force_chain


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_registered_rule_follows_the_protocol(name):
    rule = get_rule(name)
    assert isinstance(rule, VerificationRule)
    assert rule.name == name
    assert dataclasses.is_dataclass(rule)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(rule, "x", 1)


def test_registry_names_and_errors():
    assert {"lossless", "mars", "overshoot", "typical", "min_p", "cos"} <= set(RULES)
    with pytest.raises(ValueError, match="valid rules: lossless, mars, overshoot"):
        get_rule("marz")
    with pytest.raises(ValueError, match=r"no parameter 'tau'.*its parameters: theta"):
        get_rule("mars", tau=0.9)
    with pytest.raises(ValueError, match="its parameters: none"):
        get_rule("lossless", theta=0.9)
    assert get_rule("mars").theta == 0.9
    assert get_rule("overshoot", lenience=0.5, min_p=None).min_p is None


@pytest.mark.parametrize("name, params, text", [
    ("mars", {"theta": 1.5}, r"'theta' must be in \[0, 1\]"),
    ("mars", {"theta": -0.1}, r"'theta' must be in \[0, 1\]"),
    ("overshoot", {"lenience": 0.0}, r"'lenience' must be in \(0, 1\]"),
    ("overshoot", {"lenience": 1.2}, r"'lenience' must be in \(0, 1\]"),
    ("overshoot", {"lenience": 0.5, "min_p": 0.0}, r"'min_p' must be in \(0, 1\] or None"),
    ("typical", {"epsilon": 0.0}, r"'epsilon' must be in \(0, 1\]"),
    ("typical", {"delta": 2.0}, r"'delta' must be in \(0, 1\]"),
    ("min_p", {"p_base": 1.5}, r"'p_base' must be in \(0, 1\]"),
    ("cos", {"lam": -1}, r"'lam' must be in \[0, 1\]"),
    ("mars", {"theta": float("nan")}, "'theta' must be in"),
    ("mars", {"theta": "0.9"}, "'theta' must be in"),
])
def test_out_of_range_parameters_name_the_parameter_and_range(name, params, text):
    with pytest.raises(ValueError, match=text):
        get_rule(name, **params)


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("top_k, top_p", [(None, None), (5, None), (None, 0.7)])
def test_chain_closed_form_equals_enumeration(case, top_k, top_p):
    rule = case.rule()
    target, draft, _ = chain_inputs(1, 16, 1, 8, 1.0, case.shift(6.0))
    P = induced_chain(rule, target[:, 0], draft[:, 0], temperature=0.8, top_k=top_k, top_p=top_p)
    brute = brute_force_chain(rule, target[:, 0], draft[:, 0], temperature=0.8, top_k=top_k,
                              top_p=top_p)
    torch.testing.assert_close(P.double(), brute, atol=1e-6, rtol=0)
    torch.testing.assert_close(P.sum(-1), torch.ones(16), atol=1e-5, rtol=0)
    assert (P >= 0).all()


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("top_k, top_p", [(None, None), (5, None), (None, 0.7)])
def test_candidate_closed_form_equals_path_enumeration(case, top_k, top_p):
    rule = case.rule()
    target, cands = candidate_inputs(2, 24, 4, 8, case.shift(6.0))
    P = induced_candidates(rule, target, cands, temperature=0.8, top_k=top_k, top_p=top_p)
    brute = brute_force_candidates(rule, target, cands, temperature=0.8, top_k=top_k, top_p=top_p)
    torch.testing.assert_close(P.double(), brute, atol=1e-6, rtol=0)
    torch.testing.assert_close(P.sum(-1), torch.ones(24), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
def test_every_P_sums_to_one_on_a_large_vocabulary(case):
    rule = case.rule()
    target, draft, _ = chain_inputs(4, 8, 1, 1000, 1.0, case.shift(6.0))
    P = induced_chain(rule, target[:, 0], draft[:, 0], temperature=1.0, top_p=0.95)
    torch.testing.assert_close(P.sum(-1), torch.ones(8), atol=1e-5, rtol=0)
    _, cands = candidate_inputs(4, 8, 6, 1000)
    P = induced_candidates(rule, target[:, 0], cands, temperature=1.0, top_k=50)
    torch.testing.assert_close(P.sum(-1), torch.ones(8), atol=1e-5, rtol=0)


@pytest.mark.parametrize("top_k, top_p", [(None, None), (4, None), (None, 0.6)])
def test_lossless_induces_p(top_k, top_p):
    target, draft, _ = chain_inputs(5, 16, 1, 10, 1.0)
    _, cands = candidate_inputs(5, 16, 3, 10)
    rule = get_rule("lossless")
    p = target_probs(target[:, 0], 0.9, top_k, top_p)
    for P in (induced_chain(rule, target[:, 0], draft[:, 0], temperature=0.9, top_k=top_k, top_p=top_p),
              induced_candidates(rule, target[:, 0], cands, temperature=0.9, top_k=top_k, top_p=top_p)):
        torch.testing.assert_close(P, p, atol=1e-6, rtol=0)


def _same_chain(rule_a, rule_b, target, draft, x, **kw):
    res_a = verify_chain(rule_a, target, draft, x, generator=torch.Generator().manual_seed(3), **kw)
    res_b = verify_chain(rule_b, target, draft, x, generator=torch.Generator().manual_seed(3), **kw)
    assert torch.equal(res_a.tokens, res_b.tokens) and torch.equal(res_a.kinds, res_b.kinds)
    torch.testing.assert_close(res_a.behaviour_logprobs, res_b.behaviour_logprobs, atol=1e-5, rtol=0)
    return res_a


@pytest.mark.parametrize("other", [("overshoot", {"lenience": 1.0}), ("mars", {"theta": 1.0}),
                                   ("cos", {"lam": 1.0})])
def test_lossless_limits(other):
    """overshoot(l = 1), mars(theta = 1) and cos(lam = 1) are the lossless rule."""
    rule = get_rule(*other[:1], **other[1])
    lossless = get_rule("lossless")
    target, draft, x = chain_inputs(6, 64, 3, 10, 1.0, 6.0)
    _, cands = candidate_inputs(6, 64, 3, 10, 6.0)
    for P, Q in ((induced_chain(rule, target[:, 0], draft[:, 0], temperature=1.0),
                  induced_chain(lossless, target[:, 0], draft[:, 0], temperature=1.0)),
                 (induced_candidates(rule, target[:, 0], cands, temperature=1.0),
                  induced_candidates(lossless, target[:, 0], cands, temperature=1.0))):
        torch.testing.assert_close(P, Q, atol=1e-6, rtol=0)
    res = _same_chain(rule, lossless, target, draft, x, temperature=1.0)
    assert not res.relaxed.any()


def test_mars_with_theta_above_every_ratio_is_lossless():
    target, draft, x = chain_inputs(7, 64, 3, 10, 1.0, 6.0)
    top2 = target.topk(2, -1).values
    theta = float((top2[..., 1] / top2[..., 0]).max()) + 1e-4
    assert theta < 1
    res = _same_chain(get_rule("mars", theta=theta), get_rule("lossless"), target, draft, x,
                      temperature=1.0)
    assert not res.relaxed.any()
    # with a theta below some ratios the same inputs are relaxed
    res = verify_chain(get_rule("mars", theta=theta - 0.05), target, draft, x, temperature=1.0,
                       generator=torch.Generator().manual_seed(3))
    assert res.relaxed.any()


def test_mars_guard_never_relaxes_a_negative_top_logit():
    """z1 < 0 with z2/z1 > theta: the unguarded ratio would relax; ours stays lossless."""
    v = 6
    target = torch.tensor([[-1.0, -1.2, -5.0, -6.0, -7.0, -8.0]])  # z2 / z1 = 1.2 > 0.9
    draft = torch.tensor([[-6.0, -1.0, -0.5, -6.0, -7.0, -8.0]])
    mars, lossless = get_rule("mars", theta=0.9), get_rule("lossless")
    P = induced_chain(mars, target, draft, temperature=1.0)
    torch.testing.assert_close(P, induced_chain(lossless, target, draft, temperature=1.0))
    assert not bool(mars.context(target, torch.softmax(target, -1))["relax"])
    cands = torch.tensor([[1, 2]])
    torch.testing.assert_close(induced_candidates(mars, target, cands, temperature=1.0),
                               induced_candidates(lossless, target, cands, temperature=1.0))
    # the same shape of logits shifted positive relaxes: v1, v2 accepted outright
    P_pos = induced_chain(mars, target + 10, draft, temperature=1.0)
    assert (P_pos - target_probs(target + 10, 1.0)).abs().sum() > 1e-3
    x = torch.tensor([[1]])  # v2, rejected often by the lossless test, always accepted here
    res = verify_chain(mars, (target + 10)[:, None].expand(1, 2, v).contiguous(), draft[:, None], x,
                       temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert int(res.kinds[0, 0]) == 0
    # at T = 0 the test uses raw logits and the same guard
    assert mars.greedy_second(target)[0].item() is False
    assert mars.greedy_second(target + 10)[0].item() is True


def test_min_p_gate_with_p_base_one():
    """A = {v1}: the gate differs from plain overshoot only through v1, which it always accepts.
    It equals plain overshoot exactly where q(v1) <= p(v1) / l (the condition verifiers/README.md
    states for this reduction)."""
    plain, gated = get_rule("overshoot", lenience=0.5), get_rule("overshoot", lenience=0.5, min_p=1.0)
    target, draft, _ = chain_inputs(8, 200, 1, 8, 1.0)
    t, d = target[:, 0], draft[:, 0]
    p, q = target_probs(t, 1.0), torch.softmax(d, -1)
    v1 = p.argmax(-1, keepdim=True)
    capped = q.gather(-1, v1) <= p.gather(-1, v1) / 0.5
    P_plain = induced_chain(plain, t, d, temperature=1.0)
    P_gated = induced_chain(gated, t, d, temperature=1.0)
    torch.testing.assert_close(P_gated[capped[:, 0]], P_plain[capped[:, 0]], atol=1e-6, rtol=0)
    assert (~capped).any()
    diff = (P_gated - P_plain)[~capped[:, 0]]
    assert (diff.gather(-1, v1[~capped[:, 0]]) > 0).all()  # v1 gains mass when q(v1) overshoots


def _table_P(name: str, params: dict, p: torch.Tensor, q: torch.Tensor, z: torch.Tensor):
    """The 'induced P' column of verifiers/README.md's chain table, written out independently."""
    R = (p - q).clamp(min=0)
    R = R / R.sum(-1, keepdim=True)
    if name == "lossless":
        return p
    if name == "cos":
        return params["lam"] * p + (1 - params["lam"]) * q
    if name == "overshoot":
        g = torch.minimum(q, p / params["lenience"])
        if params.get("min_p") is not None:
            g = torch.where(p >= params["min_p"] * p.amax(-1, keepdim=True), q, g)
        return g + (1 - g.sum(-1, keepdim=True)) * R
    if name == "mars":
        (z1, z2), (v1, v2) = z.topk(2, -1)
        if not (z1 > 0 and z2 / z1 > params["theta"]):
            return p
        keep = torch.zeros_like(p)
        keep[v1] = keep[v2] = 1
        return q * keep + (1 - q[v1] - q[v2]) * p
    if name in ("typical", "min_p"):
        if name == "typical":
            entropy = -(p * p.log()).nansum()
            A = p >= torch.clamp(params["delta"] * torch.exp(-entropy), max=params["epsilon"])
        else:
            A = p >= params["p_base"] * p.max()
        out = q * A
        for x in torch.nonzero(~A).flatten():
            r = p.clone()
            r[x] = 0
            out += q[x] * r / (1 - p[x])
        return out
    raise AssertionError(f"write rule {name!r}'s induced P here, independently of its class")


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
def test_closed_forms_follow_the_verification_table(case):
    rule = case.rule()
    target, draft, _ = chain_inputs(12, 12, 1, 9, 1.0, case.shift(6.0))
    P = induced_chain(rule, target[:, 0], draft[:, 0], temperature=1.0)
    for r in range(12):
        p, q = torch.softmax(target[r, 0], -1), torch.softmax(draft[r, 0], -1)
        torch.testing.assert_close(P[r], _table_P(case.name, case.params, p, q, target[r, 0]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
def test_identical_draft_and_target(case):
    """p == q: TV = 0, the residual guard (R := p) keeps every closed form finite; lossless
    and overshoot accept every draft."""
    from verifiers.rules import lossless_residual

    rule = case.rule()
    target, _, x = chain_inputs(9, 32, 3, 10, 1.0, case.shift(6.0))
    draft = target[:, :3].clone()
    x = torch.multinomial(torch.softmax(draft, -1).reshape(-1, 10), 1,
                          generator=torch.Generator().manual_seed(0)).reshape(32, 3)
    p = torch.softmax(target[:, 0], -1)
    assert torch.equal(lossless_residual(p, p), p)
    P = induced_chain(rule, target[:, 0], draft[:, 0], temperature=1.0)
    assert torch.isfinite(P).all()
    torch.testing.assert_close(P.sum(-1), torch.ones(32), atol=1e-5, rtol=0)
    res = verify_chain(rule, target, draft, x, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(res.behaviour_logprobs[res.tokens >= 0]).all()
    if case.name in ("lossless", "overshoot", "cos"):
        assert (res.num_emitted == 4).all()


def test_candidate_zero_next_to_padding():
    """Token 0 as a real candidate in a padded row (padding also indexes 0 internally)."""
    target, _ = candidate_inputs(13, 4, 1, 6)
    cands = torch.tensor([[0, -1, -1], [-1, -1, -1], [3, 0, -1], [2, 1, 0]])
    for rule in (get_rule("lossless"), get_rule("overshoot", lenience=0.5)):
        P = induced_candidates(rule, target, cands, temperature=1.0)
        brute = brute_force_candidates(rule, target, cands, temperature=1.0)
        torch.testing.assert_close(P.double(), brute, atol=1e-6, rtol=0)
    torch.testing.assert_close(induced_candidates(get_rule("lossless"), target, cands, temperature=1.0),
                               target_probs(target, 1.0), atol=1e-6, rtol=0)
