"""Monte Carlo: the empirical distribution of emitted tokens matches the closed form P within
bounds that shrink with the sample count, and exp(behaviour log-prob) = P(y) for every token.

One small case (V <= 8) is replicated over the batch dimension, so a single call draws
n = 200,000 independent verifications. Each Monte Carlo test runs on the CPU, on both chain
backends, and on CUDA (marker ``gpu``; skipped without a device) on the PyTorch code, the only
code CUDA runs (``verifier_cases.on_devices``): the same draws, verification and checks on each.
The chi-square quantile is computed with torch alone (``chi2_quantile``): the GPU check runs where
scipy is not installed.
"""

from __future__ import annotations

import math

import pytest
import torch
from verifier_cases import RULE_CASES, RULE_IDS, on_devices

from verifiers import induced_candidates, induced_chain, target_probs, verify_candidates, verify_chain

N = 200_000
V = 7


def chi2_quantile(level: float, dof: int) -> float:
    """The chi-square quantile at ``level`` with ``dof`` degrees of freedom: the CDF
    ``gammainc(dof / 2, x / 2)`` inverted by bisection in float64."""
    half = torch.tensor(dof / 2, dtype=torch.float64)

    def cdf(x: float) -> float:
        return float(torch.special.gammainc(half, torch.tensor(x / 2, dtype=torch.float64)))

    lo, hi = 0.0, float(dof) + 10.0
    while cdf(hi) < level:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < level else (lo, mid)
    return hi


def assert_matches(tokens: torch.Tensor, P: torch.Tensor) -> None:
    """tokens [n] drawn i.i.d. from P [V]: never outside supp P; TV <= sqrt(V / n); chi-square
    (categories with expected count >= 5, the rest pooled) accepted at level 1e-6."""
    n = len(tokens)
    counts = torch.bincount(tokens, minlength=len(P)).double()
    P = P.double()
    assert counts[P == 0].sum() == 0, "emitted a token with P(y) = 0"
    tv = 0.5 * (counts / n - P).abs().sum()
    assert tv <= math.sqrt(len(P) / n), f"TV {tv:.5f} > {math.sqrt(len(P) / n):.5f}"
    expected = n * P
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    if len(exp) < 2:  # a point mass: the support check above is the whole test
        return
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < chi2_quantile(1 - 1e-6, len(exp) - 1), f"chi2 {chi2:.1f} with {len(exp) - 1} dof"


def _case_logits(seed: int, k: int, shift: float):
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(k + 1, V, generator=g) * 1.5 + shift
    draft = torch.randn(k, V, generator=g) * 1.5 + shift
    if k:
        draft[0, 0] = -math.inf  # a token outside the draft vocabulary
    return target, draft


@pytest.mark.parametrize("dof", [1, 2, 5, 13, 48, 300])
def test_chi2_quantile_is_scipys(dof):
    stats = pytest.importorskip("scipy.stats")
    for level in (0.5, 0.99, 1 - 1e-6):
        assert chi2_quantile(level, dof) == pytest.approx(stats.chi2.ppf(level, dof), rel=1e-9)


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.8, None, 0.85), (0.9, 4, None)])
@on_devices()
def test_chain_monte_carlo(device, case, temperature, top_k, top_p):
    """N verifications of one K = 2 chain on ``device``: each position's tokens follow the closed
    form P (``induced_chain``; the bonus position: p), and exp(behaviour log-prob) = P(y)."""
    rule = case.rule()
    k = 2
    target, draft = _case_logits(21, k, case.shift(3.0))
    gen = torch.Generator(device).manual_seed(1234)
    q = torch.softmax(draft / temperature, -1).to(device)  # [K, V]
    x = torch.stack([torch.multinomial(q[j], N, replacement=True, generator=gen) for j in range(k)], 1)
    res = verify_chain(rule, target.to(device).expand(N, k + 1, V), draft.to(device).expand(N, k, V), x,
                       temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    assert res.tokens.device.type == device.type
    P = induced_chain(rule, target[:k], draft, temperature=temperature, top_k=top_k, top_p=top_p)  # [K, V]
    P = torch.cat([P, target_probs(target[k:], temperature, top_k=top_k, top_p=top_p)])  # bonus: P = p
    tokens, emitted, behaviour = res.tokens.cpu(), res.num_emitted.cpu(), res.behaviour_logprobs.cpu()
    for j in range(k + 1):
        reached = emitted > j
        assert reached.sum() > 5000
        y = tokens[reached, j]
        assert_matches(y, P[j])
        torch.testing.assert_close(behaviour[reached, j].exp(), P[j][y], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(behaviour).all()


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("cands", [[2, 5, 0], [1, 3, 6, 0, 2, 5]])
@on_devices()
def test_candidates_monte_carlo(device, case, cands):
    """N verifications of one node's candidates on ``device``: the emitted tokens follow the closed
    form P (``induced_candidates``), exp(behaviour log-prob) = P(y), and an accepted token is the
    candidate at its accepted index."""
    rule = case.rule()
    target, _ = _case_logits(22, 0, case.shift(3.0))
    c = torch.tensor([cands])
    gen = torch.Generator(device).manual_seed(99)
    res = verify_candidates(rule, target.to(device).expand(N, V), c.to(device).expand(N, len(cands)),
                            temperature=0.9, generator=gen)
    assert res.tokens.device.type == device.type
    P = induced_candidates(rule, target, c, temperature=0.9)[0]
    tokens, index, behaviour = res.tokens.cpu(), res.accepted_index.cpu(), res.behaviour_logprobs.cpu()
    assert_matches(tokens, P)
    torch.testing.assert_close(behaviour.exp(), P[tokens], atol=1e-5, rtol=1e-5)
    accepted = index >= 0
    assert torch.equal(tokens[accepted], c[0][index[accepted]])
