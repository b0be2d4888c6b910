"""scripts.research.rounding_gap on the tiny random policy: the target is left exact, the figures are
the rounded copy's gap (checked against a direct computation), and a temperature other than 1
is refused."""

from __future__ import annotations

import pytest
import torch

from rollout.models import TargetConfig, load_target, round_weights_
from rollout.params import SamplingParams
from scripts.research.rounding_gap import rounding_gap
from trainers.drift.stats import effective_sample_size as ess


def test_gap_is_measured_on_a_rounded_copy(tiny_policy_dir):
    target, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    before = [p.detach().clone() for p in target.model.parameters()]
    prompts = [[1, 20, 300], [5, 6, 7, 8]]
    g = rounding_gap(target, prompts, SamplingParams(temperature=1.0, max_new_tokens=8), seed=2, threads=1)
    assert all(torch.equal(p, b) for p, b in zip(target.model.parameters(), before))  # left exact
    assert g["tokens"] == 16
    assert g["behaviour_vs_rounded_max"] < 2e-5  # the engine samples from the rounded copy
    assert 0 < g["kl_mean"] <= g["kl_max"] < 1e-3
    assert 0 < g["log_ratio_abs_mean"] <= g["log_ratio_abs_max"] < 0.05
    assert 0.99 < g["token_ess"] < 1 and 0.9 < g["sequence_ess"] < 1
    # the KL of the first position of the first prompt, computed directly
    rounded, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    round_weights_(rounded.model, "bfloat16", seed=2)  # as rounding_gap rounds with the call's seed
    with torch.no_grad():
        lr = torch.log_softmax(rounded.model(input_ids=torch.tensor([prompts[0]])).logits[0, -1].double(), -1)
        le = torch.log_softmax(target.model(input_ids=torch.tensor([prompts[0]])).logits[0, -1].double(), -1)
    assert g["kl_max"] >= float((lr.exp() * (lr - le)).sum()) * (1 - 1e-3)  # up to float rounding


def test_ess_and_refusals(tiny_policy_dir):
    assert ess(torch.ones(5)) == pytest.approx(1.0)
    assert ess(torch.tensor([1.0, 0.0])) == pytest.approx(0.5)
    target, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    with pytest.raises(ValueError, match="temperature 1.0"):
        rounding_gap(target, [[1, 2]], SamplingParams(temperature=0.8, max_new_tokens=4), seed=0)
