"""Boundaries that random inputs never hit, and checks the other files make only loosely: a MARS
ratio equal to theta (the test is strict), min_p with p_base = 1 (p(v1) sits on the threshold of
A = {v1}), its matched baseline, a top-p prefix whose mass equals top_p, the diagnostics' values
(against metrics of the closed forms), and small batches on the PyTorch path (per-row statistics).
Each is checked against verifiers/README.md's closed forms or the loop reference, on both backends."""

from __future__ import annotations

import math

import pytest
import torch
from verifier_cases import RULE_CASES, RULE_IDS, candidate_inputs, chain_inputs

from verifiers import (TruncationSampling, get_rule, induced_candidates, induced_chain, target_probs, verify_candidates,
                       verify_chain)


def _accept_rate_bound(n: int, a: float) -> float:
    """Six standard errors of a Bernoulli(a) mean over n draws (plus a floor for a near 0 or 1)."""
    return 6 * math.sqrt(max(a * (1 - a), 1e-4) / n)


def test_mars_ratio_equal_to_theta_does_not_relax():
    """relax = z1 > 0 and z2 / z1 > theta, strictly: at z1 = 10, z2 = 9 the float32 ratio is
    float32(0.9) exactly, so theta = 0.9 must leave MARS lossless (P = p, a = min(1, p / q),
    log P(y) = log p(y)); theta = 0.89 relaxes the same row."""
    mars = get_rule("mars", theta=0.9)
    target = torch.tensor([[10.0, 9.0, 8.0, 7.5, 6.0, 5.0]])
    assert float(target[0, 1] / target[0, 0]) == float(torch.tensor(0.9))
    draft = torch.tensor([[7.0, 10.0, 9.5, 7.0, 6.0, 5.0]])  # q(v2) > p(v2): lossless rejects v2 often
    p, q = target_probs(target, 1.0)[0], torch.softmax(draft, -1)[0]
    torch.testing.assert_close(induced_chain(mars, target, draft, temperature=1.0)[0], p, atol=1e-7, rtol=0)
    cands = torch.tensor([[1, 2]])
    torch.testing.assert_close(induced_candidates(mars, target, cands, temperature=1.0),
                               target_probs(target, 1.0), atol=1e-7, rtol=0)
    assert not bool(mars.greedy_second(target)[0])
    # chains drafting v2 = 1 at one position: accepted with probability p(1) / q(1) < 1, P = p
    n = 4000
    tl = target[:, None].expand(n, 2, 6).contiguous()
    res = verify_chain(mars, tl, draft[:, None].expand(n, 1, 6).contiguous(), torch.ones(n, 1, dtype=torch.long),
                       temperature=1.0, generator=torch.Generator().manual_seed(0))
    a = float(p[1] / q[1])
    assert a < 0.5
    assert abs((res.kinds[:, 0] == 0).float().mean().item() - a) < _accept_rate_bound(n, a)
    emitted = res.tokens >= 0
    torch.testing.assert_close(res.behaviour_logprobs[emitted], res.target_logprobs[emitted], atol=1e-6, rtol=0)
    assert not res.relaxed.any()
    # a theta just below the ratio relaxes: v2 always accepted, P(v2) = q(v2) + (1 - q(v1) - q(v2)) p(v2)
    relaxing = get_rule("mars", theta=0.89)
    res = verify_chain(relaxing, tl, draft[:, None].expand(n, 1, 6).contiguous(), torch.ones(n, 1, dtype=torch.long),
                       temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert (res.kinds[:, 0] == 0).all()
    expected = math.log(float(q[1] + (1 - q[0] - q[1]) * p[1]))
    torch.testing.assert_close(res.behaviour_logprobs[:, 0], torch.full((n,), expected), atol=1e-5, rtol=0)


def _min_p_table(p: torch.Tensor, q: torch.Tensor, in_a: torch.Tensor) -> torch.Tensor:
    """verifiers/README.md's truncation row: q 1_A + sum_{x not in A} q(x) p(y) 1[y != x] / (1 - p(x))."""
    out = (q * in_a).double()
    for x in torch.nonzero(~in_a).flatten():
        r = p.double().clone()
        r[x] = 0
        out += float(q[x]) * r / (1 - float(p[x]))
    return out


def test_min_p_with_p_base_one_accepts_exactly_the_argmax():
    """min_p(p_base = 1): A = {p >= max p} = {v1} (no ties), p(v1) sits exactly on the threshold.
    A chain accepts a drafted v1 always and any other draft never; the closed form is the table's;
    deterministic candidates (c, v1) give a point mass at v1 (c rejected, v1 accepted outright)."""
    rule = get_rule("min_p", p_base=1.0)
    g = torch.Generator().manual_seed(4)
    target = torch.randn(8, 7, generator=g) * 1.5
    draft = target + torch.randn(8, 7, generator=g)
    p, q = target_probs(target, 1.0), torch.softmax(draft, -1)
    v1 = p.argmax(-1)
    P = induced_chain(rule, target, draft, temperature=1.0)
    for r in range(8):
        in_a = torch.zeros(7, dtype=torch.bool)
        in_a[v1[r]] = True
        torch.testing.assert_close(P[r].double(), _min_p_table(p[r], q[r], in_a), atol=1e-6, rtol=0)
    # candidates: c (not v1) then v1 -> v1 with probability 1
    other = (v1 + 1) % 7
    cands = torch.stack([other, v1], 1)
    torch.testing.assert_close(induced_candidates(rule, target, cands, temperature=1.0),
                               torch.nn.functional.one_hot(v1, 7).float(), atol=1e-7, rtol=0)
    res = verify_candidates(rule, target, cands, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(res.tokens, v1) and (res.accepted_index == 1).all()
    torch.testing.assert_close(res.behaviour_logprobs, torch.zeros(8), atol=1e-6, rtol=0)
    # chains: x = v1 accepted at every row, with log P(v1) from the table; x = other rejected
    tl = torch.cat([target[:, None], target[:, None]], 1)
    res = verify_chain(rule, tl, draft[:, None], v1[:, None], temperature=1.0,
                       generator=torch.Generator().manual_seed(2))
    assert (res.kinds[:, 0] == 0).all()
    torch.testing.assert_close(res.behaviour_logprobs[:, 0].double(), P.gather(1, v1[:, None])[:, 0].double().log(),
                               atol=1e-5, rtol=0)
    res = verify_chain(rule, tl, draft[:, None], other[:, None], temperature=1.0,
                       generator=torch.Generator().manual_seed(2))
    assert (res.kinds[:, 0] == 1).all() and (res.tokens[:, 0] != other).all()
    y = res.tokens[:, 0]
    torch.testing.assert_close(res.behaviour_logprobs[:, 0].double(), P.gather(1, y[:, None])[:, 0].double().log(),
                               atol=1e-5, rtol=0)


def _expected_metrics(P: torch.Tensor, p: torch.Tensor, pi: torch.Tensor) -> dict[str, torch.Tensor]:
    """verifiers/README.md's diagnostics from full float64 vectors: TV(P, p), KL(P || p), H(P), H(p),
    and the untruncated target's mass where P = 0."""
    P, p, pi = P.double(), p.double(), pi.double()
    logratio = torch.where(P > 0, P.log() - p.log(), 0.0)
    return {"tv": 0.5 * (P - p).abs().sum(-1), "kl": (P * logratio).sum(-1),
            "entropy_P": -(P * torch.where(P > 0, P.log(), 0.0)).sum(-1),
            "entropy_p": -(p * torch.where(p > 0, p.log(), 0.0)).sum(-1),
            "uncovered": (pi * (P == 0)).sum(-1)}


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
def test_diagnostics_are_the_metrics_of_the_closed_forms(case):
    """Chain and candidate diagnostics equal TV, KL, entropies and uncovered mass computed here from
    the closed-form P of each position (the bonus position: P = p) under top-p truncation, at the
    positions each row emitted (0 elsewhere)."""
    rule, temperature, top_p = case.rule(), 0.9, 0.8
    target, draft, x = chain_inputs(31, 16, 3, 10, temperature, case.shift(6.0))
    res = verify_chain(rule, target, draft, x, temperature=temperature, top_p=top_p,
                       generator=torch.Generator().manual_seed(3), diagnostics=True)
    emitted = res.tokens >= 0
    pi = torch.softmax(target / temperature, -1)
    for j in range(4):
        p = target_probs(target[:, j], temperature, top_p=top_p)
        P = p if j == 3 else induced_chain(rule, target[:, j], draft[:, j], temperature=temperature, top_p=top_p)
        for key, want in _expected_metrics(P, p, pi[:, j]).items():
            want = want.float().masked_fill(~emitted[:, j], 0.0)
            torch.testing.assert_close(res.diagnostics[key][:, j], want, atol=2e-5, rtol=1e-5, msg=f"{key} {j}")
    _, cands = candidate_inputs(31, 16, 3, 10, case.shift(6.0))
    out = verify_candidates(rule, target[:, 0], cands, temperature=temperature, top_p=top_p,
                            generator=torch.Generator().manual_seed(3), diagnostics=True)
    P = induced_candidates(rule, target[:, 0], cands, temperature=temperature, top_p=top_p)
    p = target_probs(target[:, 0], temperature, top_p=top_p)
    for key, want in _expected_metrics(P, p, pi[:, 0]).items():
        torch.testing.assert_close(out.diagnostics[key], want.float(), atol=2e-5, rtol=1e-5, msg=key)


def test_truncation_sampling_with_p_base_one_is_greedy():
    """The matched baseline of min_p(p_base = 1) samples p restricted to A = {p >= max p} = {v1}:
    a point mass at v1 (behaviour log-prob 0) in both modes, whatever the drafts or candidates."""
    rule = TruncationSampling(get_rule("min_p", p_base=1.0))
    g = torch.Generator().manual_seed(6)
    target = torch.randn(8, 7, generator=g) * 1.5
    draft = target + torch.randn(8, 7, generator=g)
    v1 = target.argmax(-1)
    point = torch.nn.functional.one_hot(v1, 7).float()
    cands = torch.stack([(v1 + 1) % 7, (v1 + 2) % 7], 1)
    torch.testing.assert_close(induced_chain(rule, target, draft, temperature=1.0), point, atol=1e-7, rtol=0)
    torch.testing.assert_close(induced_candidates(rule, target, cands, temperature=1.0), point, atol=1e-7, rtol=0)
    res = verify_candidates(rule, target, cands, temperature=1.0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(res.tokens, v1)
    torch.testing.assert_close(res.behaviour_logprobs, torch.zeros(8), atol=1e-6, rtol=0)
    tl = torch.stack([target, target], 1)
    res = verify_chain(rule, tl, draft[:, None], ((v1 + 1) % 7)[:, None], temperature=1.0,
                       generator=torch.Generator().manual_seed(2))
    assert torch.equal(res.tokens[:, 0], v1) and (res.kinds[:, 0] == 1).all()
    torch.testing.assert_close(res.behaviour_logprobs[:, 0], torch.zeros(8), atol=1e-6, rtol=0)


def test_top_p_stops_at_the_prefix_whose_mass_equals_top_p():
    """top-p keeps the smallest prefix (by decreasing p) whose mass *reaches* top_p: when the
    mass of the first two tokens equals top_p exactly (as float32 sums it), the third is cut.
    (Distinct logits: the boundary-tie rule plays no part.)"""
    from verifiers import process_logits

    z = torch.tensor([[1.3, 0.2, -0.4, -1.1, -2.0]])
    p = torch.softmax(z, -1)[0]
    top_p = float((torch.cumsum(p, -1) - p)[2])  # the mass before the third token = p1 + p2
    kept = process_logits(z, 1.0, top_p=top_p) > -math.inf
    assert kept.tolist() == [[True, True, False, False, False]]
    # just above that mass the third token is needed
    kept = process_logits(z, 1.0, top_p=top_p * (1 + 1e-6)) > -math.inf
    assert kept.tolist() == [[True, True, True, False, False]]


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("b", [1, 12])
def test_small_batches_match_reference(case, b):
    """Batches of at most 16 rows (the PyTorch path reduces each row's prefix of positions in
    place, verifiers/chain.py ``_stats_upto``) equal the loop reference token for token, with the
    same behaviour log-probs, at every position including the final one."""
    from verifiers.reference import reference_chain

    rule = case.rule()
    for seed in range(4):
        target, draft, x = chain_inputs(40 + seed, b, 3, 9, 0.8, case.shift(6.0))
        res = verify_chain(rule, target, draft, x, temperature=0.8, generator=torch.Generator().manual_seed(seed))
        ref = reference_chain(rule, target, draft, x, temperature=0.8, generator=torch.Generator().manual_seed(seed))
        for r, row in enumerate(ref):
            assert res.tokens[r, :len(row)].tolist() == [t for t, *_ in row]
            torch.testing.assert_close(res.behaviour_logprobs[r, :len(row)],
                                       torch.tensor([lp for _, _, lp, _ in row]), atol=1e-5, rtol=1e-5)
