"""TruncationSampling, the truncation rules' matched baseline (a comparator, not in RULES): its
closed forms against enumeration and written out (P = p on A, renormalised, in both modes), a
Monte Carlo check of what it emits (on the CPU and, marker ``gpu``, on CUDA), and the rules it
accepts as a base."""

from __future__ import annotations

import pytest
import test_verifiers_montecarlo as montecarlo
import test_verifiers_rules as closed_forms
import torch
from verifier_cases import RuleCase, candidate_inputs, chain_inputs, on_devices

from verifiers import TruncationSampling, get_rule, induced_candidates, induced_chain, native, target_probs

BASES = [("min_p", {"p_base": 0.3}), ("typical", {"epsilon": 0.2, "delta": 0.5})]
CASES = [RuleCase(f"sampling[{name}]", params, make=lambda n=name, k=params: TruncationSampling(get_rule(n, **k)))
         for name, params in BASES]
IDS = [case.id for case in CASES]


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("top_k, top_p", [(None, None), (5, None), (None, 0.7)])
def test_closed_forms_equal_enumeration(case, top_k, top_p):
    closed_forms.test_chain_closed_form_equals_enumeration(case, top_k, top_p)
    closed_forms.test_candidate_closed_form_equals_path_enumeration(case, top_k, top_p)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_P_is_p_restricted_to_the_base_rules_set(case):
    rule = case.rule()
    assert rule.name == case.name and not native.supports(rule)
    target, draft, _ = chain_inputs(2, 32, 1, 12, 1.0)
    p = target_probs(target[:, 0], 0.9)
    keep = torch.where(p >= rule.base.context(target[:, 0] / 0.9, p)["thr"].unsqueeze(-1), p, 0.0)
    expected = keep / keep.sum(-1, keepdim=True)
    _, cands = candidate_inputs(2, 32, 3, 12)
    for P in (induced_chain(rule, target[:, 0], draft[:, 0], temperature=0.9),
              induced_candidates(rule, target[:, 0], cands, temperature=0.9)):
        torch.testing.assert_close(P, expected, atol=1e-6, rtol=0)
    assert (expected < p).any()  # A excludes some tokens on these inputs


@pytest.mark.parametrize("case", CASES, ids=IDS)
@pytest.mark.parametrize("cands", [[2, 5, 0], [1, 3, 6, 0, 2, 5]])
@on_devices(cpu_backends=("torch",))
def test_monte_carlo(device, case, cands):
    """``test_verifiers_montecarlo``'s candidate check on ``device``: the law ``induced_candidates``,
    exp(behaviour log-prob) = P(y), accepted tokens are the candidates. On the CPU one run, on the
    PyTorch code: no kernel runs these rules (``native.supports`` is False, checked above), so a
    native run would repeat it."""
    montecarlo.test_candidates_monte_carlo(device, case, cands)


@pytest.mark.parametrize("base", [get_rule("lossless"), get_rule("overshoot", lenience=0.5, min_p=0.2)])
def test_needs_a_truncation_rule(base):
    with pytest.raises(TypeError, match="needs a truncation rule"):
        TruncationSampling(base)
