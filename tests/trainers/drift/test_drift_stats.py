"""Drift statistics (trainers.drift.stats) on hand-built inputs: effective sample sizes, IS
weight stats, KL estimates against the exact KL, accuracy intervals and gaps."""

import math

import pytest
import torch

from trainers.drift.stats import (compare_accuracy, drift_stats, effective_sample_size, sequence_ess, weight_stats,
                                  wilson)


def test_effective_sample_size_values():
    assert effective_sample_size(torch.ones(7)) == 1.0
    assert effective_sample_size(torch.tensor([3.0, 0.0, 0.0, 0.0])) == 0.25
    assert effective_sample_size(torch.tensor([2.0, 1.0])) == pytest.approx(0.9)
    assert effective_sample_size(torch.zeros(3)) == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        effective_sample_size(torch.tensor([1.0, -1.0]))


def test_weight_stats_on_hand_built_weights():
    w = torch.tensor([[2.0, 0.0, 9.0], [0.5, 1.0, 0.0]])
    keep = torch.tensor([[1, 0, 1], [1, 1, 0]], dtype=torch.bool)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)  # the 9.0 is padding
    s = weight_stats(w, keep, mask)
    assert (s["is_weight_min"], s["is_weight_max"]) == (0.5, 2.0)
    assert s["is_weight_mean"] == pytest.approx(3.5 / 3)
    assert s["is_masked_frac"] == pytest.approx(2 / 5)
    assert s["is_ess"] == pytest.approx(3.5 ** 2 / (5 * 5.25))


def test_drift_stats_on_hand_built_log_ratios():
    lr = torch.log(torch.tensor([[2.0, 0.5, 1.0], [8.0, 1.0, 1.0]]))
    mask = torch.tensor([[1, 1, 1], [0, 0, 0]], dtype=torch.bool)
    s = drift_stats(lr, mask)
    assert s["log_ratio_mean"] == pytest.approx(0.0, abs=1e-7)
    assert s["log_ratio_abs_mean"] == pytest.approx(2 * math.log(2) / 3)
    assert s["log_ratio_abs_max"] == pytest.approx(math.log(2))
    assert s["kl_k1"] == pytest.approx(0.0, abs=1e-7)
    assert s["kl_k3"] == pytest.approx(((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 3)


def test_kl_estimates_match_the_exact_kl_on_samples_from_the_behaviour():
    gen = torch.Generator().manual_seed(4)
    log_pi = torch.log_softmax(torch.randn(5, generator=gen, dtype=torch.float64), 0)
    log_P = torch.log_softmax(torch.randn(5, generator=gen, dtype=torch.float64), 0)
    exact = float((log_P.exp() * (log_P - log_pi)).sum())  # KL(P || pi)
    n = 40_000
    y = torch.multinomial(log_P.exp(), n, replacement=True, generator=gen)
    lr = (log_pi[y] - log_P[y]).view(1, n)
    s = drift_stats(lr, torch.ones(1, n, dtype=torch.bool))
    k1_sd = float((log_P - log_pi).pow(2).mul(log_P.exp()).sum().sqrt()) / math.sqrt(n)
    assert abs(s["kl_k1"] - exact) < 5 * k1_sd
    assert abs(s["kl_k3"] - exact) < 5 * k1_sd + 0.01 * exact
    assert s["kl_k3"] >= 0


@pytest.mark.parametrize("P", [[0.5, 0.5, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])
def test_k3_is_low_by_the_policys_mass_outside_the_behaviours_support_and_k1_is_not(P):
    """E_P[k3] = KL(P || pi) - m, m = pi's mass on {P = 0} (e.g. a lossy rule emitting a tree node
    outright: P a point mass); E_P[k1] = KL(P || pi). Exact expectations: one sample per 1/4 of P."""
    pi = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
    P = torch.tensor(P, dtype=torch.float64)
    y = torch.tensor([i for i, p in enumerate(P.tolist()) for _ in range(round(4 * p))])
    on = P > 0
    exact = float((P[on] * (P[on].log() - pi[on].log())).sum())
    m = float(pi[~on].sum())
    s = drift_stats((pi[y].log() - P[y].log())[None], torch.ones(1, len(y), dtype=torch.bool))
    assert s["kl_k1"] == pytest.approx(exact, abs=1e-12)
    assert s["kl_k3"] == pytest.approx(exact - m, abs=1e-12)


def test_the_training_summary_shows_k1_next_to_k3():
    """The GRPO summary table (``trainers.grpo.report``) shows the unbiased k1 as well as k3."""
    from trainers.grpo.report import summary_table

    table = summary_table([{"step": 1, "kl_k1": 0.9163, "kl_k3": 0.3163}]).splitlines()
    assert table[0] == "| step | KL(P||pi) k1 | KL(P||pi) k3 |" and table[2] == "| 1 | 0.9163 | 0.3163 |"


def test_wilson_and_comparisons():
    lo, hi = wilson(5, 10)
    assert abs(lo - 0.2366) < 1e-4 and abs(hi - 0.7634) < 1e-4
    assert wilson(0, 10)[0] == 0.0 and abs(wilson(0, 10)[1] - 0.2775) < 1e-4
    for n in range(1, 200):  # the interval always holds k / n, with exact ends at 0 and n
        assert wilson(0, n)[0] == 0.0 and wilson(n, n)[1] == 1.0
        assert all(wilson(k, n)[0] <= k / n <= wilson(k, n)[1] for k in range(n + 1))
    a = {"k": 30, "n": 100, "ci_low": wilson(30, 100)[0], "ci_high": wilson(30, 100)[1]}
    b = {"k": 50, "n": 100, "ci_low": wilson(50, 100)[0], "ci_high": wilson(50, 100)[1]}
    g = compare_accuracy(a, b)
    assert abs(g["diff"] + 0.2) < 1e-12 and g["diff_ci_low"] < -0.2 < g["diff_ci_high"] < 0
    assert g["p_value"] < 0.01 and not g["intervals_overlap"]
    assert compare_accuracy(a, a)["p_value"] == 1.0 and compare_accuracy(a, a)["intervals_overlap"]
    log_w = torch.tensor([0.0, 0.0, math.log(3.0)], dtype=torch.float64)
    assert abs(sequence_ess(log_w) - 25 / 33) < 1e-12 and sequence_ess(torch.zeros(4)) == 1.0
    assert abs(sequence_ess(log_w + 1000.0) - 25 / 33) < 1e-12  # scale-free and overflow-safe


def test_a_runs_step_view_and_the_training_log_agree_on_the_same_tokens():
    """step_stats (a run's rollouts.jsonl) reports the KL and ESS the correction logged for the step."""
    from trainers.drift.report import step_stats

    g = torch.Generator().manual_seed(1)
    beh = -torch.rand(2, 6, dtype=torch.float64, generator=g) * 2
    pol = beh + 0.3 * torch.randn(2, 6, dtype=torch.float64, generator=g)
    w = torch.exp(pol - beh).clamp(max=2.0)
    records = [{"behaviour_logprobs": beh[i].tolist(), "target_logprobs": beh[i].tolist(),
                "policy_logprobs": pol[i].tolist(), "relaxed": [0] * 6, "weights": w[i].tolist(), "reward": 0.0}
               for i in range(2)]
    row = step_stats(records)
    mask = torch.ones(2, 6, dtype=torch.bool)
    logged = drift_stats(pol - beh, mask)
    assert (row["kl_P_pi_k1"], row["kl_P_pi_k3"]) == (logged["kl_k1"], logged["kl_k3"]) and logged["kl_k3"] > 0
    assert (row["kl_P_p_k1"], row["kl_P_p_k3"]) == (0.0, 0.0)
    assert row["weight_ess"] == weight_stats(w, mask, mask)["is_ess"] < 1


def test_newcombe_interval_and_z_test_match_published_and_scipy_values():
    """Newcombe (1998, Stat. Med. 17:873, Table II, example (a)): 56/70 - 48/80 = 0.2000 with
    the hybrid score interval (method 10) [0.0524, 0.3339]; the pooled z-test is the 2x2
    chi-square test without continuity correction (z^2 = chi^2)."""
    from scipy.stats import chi2_contingency

    from trainers.drift.stats import accuracy_stats

    a = accuracy_stats([1.0] * 56 + [0.0] * 14)
    b = accuracy_stats([1.0] * 48 + [0.0] * 32)
    g = compare_accuracy(a, b)
    assert g["diff"] == pytest.approx(0.2, abs=1e-12)
    assert g["diff_ci_low"] == pytest.approx(0.0524, abs=5e-5)
    assert g["diff_ci_high"] == pytest.approx(0.3339, abs=5e-5)
    chi2, p, _, _ = chi2_contingency([[56, 14], [48, 32]], correction=False)
    assert g["z"] == pytest.approx(math.sqrt(chi2), rel=1e-9) and g["p_value"] == pytest.approx(p, rel=1e-9)
    # the gap is antisymmetric: b - a mirrors the interval
    r = compare_accuracy(b, a)
    assert (r["diff_ci_low"], r["diff_ci_high"]) == pytest.approx((-g["diff_ci_high"], -g["diff_ci_low"]), abs=1e-12)


def test_sequence_ess_survives_log_weights_far_apart():
    """Sequence log weights routinely span hundreds of nats: ESS of [e^0, e^1000] is that of [0, 1]."""
    assert sequence_ess(torch.tensor([0.0, 1000.0], dtype=torch.float64)) == pytest.approx(0.5, abs=1e-12)
    log_w = torch.tensor([-800.0, 0.0, 0.0, math.log(3.0)], dtype=torch.float64)
    assert sequence_ess(log_w) == pytest.approx(25 / 44, abs=1e-12)  # (1 + 1 + 3)^2 / (4 (1 + 1 + 9))
