"""A new rule (experiment_rule.TemperedLossless), registered for the length of a test, goes
through the generic checks every registered rule gets: closed forms against enumeration, Monte
Carlo, the slow reference. Also: registering it adds it to the cases every generic test is
parametrised over, and a rule class without its closed forms cannot be registered."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest
import test_verifiers_montecarlo as montecarlo
import test_verifiers_reference as reference
import test_verifiers_rules as closed_forms
import torch
from experiment_rule import TemperedLossless
from verifier_cases import RuleCase, candidate_inputs, chain_inputs, rule_cases

from verifiers import RULES, get_rule, induced_candidates, induced_chain, native, register, target_probs
from verifiers.rule_base import RuleBase

CASE = RuleCase("tempered_lossless")  # its default parameters (scale 1.5), as rule_cases() builds it


@pytest.fixture(autouse=True)
def registered():
    register(TemperedLossless)
    try:
        yield
    finally:
        RULES.pop(TemperedLossless.name)


def test_registered_rule_is_a_case_of_every_generic_test():
    assert CASE in rule_cases()
    assert not native.supports(CASE.rule())  # no kernel id: the PyTorch path


@pytest.mark.parametrize("top_k, top_p", [(None, None), (5, None), (None, 0.7)])
def test_closed_forms_equal_enumeration(top_k, top_p):
    closed_forms.test_chain_closed_form_equals_enumeration(CASE, top_k, top_p)
    closed_forms.test_candidate_closed_form_equals_path_enumeration(CASE, top_k, top_p)
    closed_forms.test_every_P_sums_to_one_on_a_large_vocabulary(CASE)


def test_chain_P_is_p_at_the_scaled_temperature_and_candidates_P_is_p():
    """The rule's closed forms, written independently: m = softmax(logits / (scale T))."""
    rule = get_rule("tempered_lossless", scale=1.5)
    target, draft, _ = chain_inputs(3, 16, 1, 9, 0.8)
    P = induced_chain(rule, target[:, 0], draft[:, 0], temperature=0.8)
    torch.testing.assert_close(P, target_probs(target[:, 0], 0.8 * 1.5), atol=1e-6, rtol=0)
    _, cands = candidate_inputs(3, 16, 3, 9)
    P = induced_candidates(rule, target[:, 0], cands, temperature=0.8)
    torch.testing.assert_close(P, target_probs(target[:, 0], 0.8), atol=1e-6, rtol=0)


@pytest.mark.parametrize("temperature, top_p", [(1.0, None), (0.8, 0.85)])
def test_monte_carlo(temperature, top_p):
    cpu = torch.device("cpu")
    montecarlo.test_chain_monte_carlo(cpu, CASE, temperature, None, top_p)
    montecarlo.test_candidates_monte_carlo(cpu, CASE, [1, 3, 6, 0, 2, 5])


@pytest.mark.parametrize("sampling", reference.SAMPLING, ids=reference.SAMPLING_IDS)
def test_matches_the_reference(sampling):
    reference.test_chain_matches_reference(CASE, sampling)
    reference.test_candidates_match_reference(CASE, sampling)


def test_collection_parametrises_the_generic_tests_over_it():
    """A fresh pytest run with the rule registered before the cases are built collects the
    closed-form, Monte Carlo and reference tests for it."""
    here = os.path.dirname(__file__)
    code = ("import sys, pytest\nsys.path.insert(0, %r)\nfrom experiment_rule import TemperedLossless\n"
            "from verifiers import register\nregister(TemperedLossless)\n"
            "sys.exit(pytest.main(['-q', '--collect-only', '-p', 'no:cacheprovider', *sys.argv[1:]]))\n") % here
    files = [os.path.join(here, f"test_verifiers_{name}.py") for name in ("rules", "montecarlo", "reference")]
    out = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ids = [line for line in out.stdout.splitlines() if "tempered_lossless" in line]
    for test in ("test_chain_closed_form_equals_enumeration", "test_candidate_closed_form_equals_path_enumeration",
                 "test_closed_forms_follow_the_verification_table", "test_chain_monte_carlo",
                 "test_candidates_monte_carlo", "test_chain_matches_reference", "test_candidates_match_reference"):
        assert any(f"::{test}[" in line for line in ids), test


def test_a_rule_without_its_closed_forms_cannot_be_registered():
    @dataclass(frozen=True)
    class Forgetful(RuleBase):  # a lossy acceptance, but no induced / prob_at of its own
        name: ClassVar[str] = "forgetful"

        def accept_prob(self, p_x, q_x, x, ctx):
            return torch.ones_like(p_x)

    with pytest.raises(TypeError, match="does not define induced, prob_at: every rule writes its own closed form"):
        register(Forgetful)
    assert "forgetful" not in RULES
    with pytest.raises(TypeError, match="abstract"):
        Forgetful()


def test_registration_refuses_a_taken_name_or_kernel_id():
    with pytest.raises(TypeError, match="needs a name no registered rule has"):
        register(TemperedLossless)

    @dataclass(frozen=True)
    class Clash(TemperedLossless):
        name: ClassVar[str] = "clash"
        kernel_id: ClassVar[int] = 1

    with pytest.raises(TypeError, match="kernel id 1 is already rule 'mars'"):
        register(Clash)
