"""``rollout.truncation_sampling``: the GRPO job's matched baseline of a truncation rule (the target
sampled from the rule's set A, no speculation). Its refusals name the field, a resume that switches
it is refused, and a training step's recorded behaviour log-probs equal the closed form
log p(y) - log p(A) of typical's set under the rollout's policy, every token inside A."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rollout.config import ConfigError
from tests.trainers.conftest import write_config
from trainers.grpo.config import load_train_config
from trainers.grpo.run_dir import config_dict, config_differences

TYPICAL = {"name": "typical", "params": {"epsilon": 0.3, "delta": 0.9}}


def _cfg(tmp_path, policy, head, **rollout):
    rollout = {"verifier": TYPICAL, "truncation_sampling": True, "spec": {"mode": "off"}, **rollout}
    return load_train_config(write_config(tmp_path / "c.yaml", policy, head, tmp_path / "out", rollout=rollout))


@pytest.mark.parametrize("rollout, field", [
    ({"verifier": {"name": "mars", "params": {"theta": 0.9}}}, "rollout.verifier.name"),
    ({"spec": {"mode": "chain", "num_draft_tokens": 3}}, "rollout.spec.mode"),
    ({"backend": "vllm"}, "rollout.backend"),
    ({"truncation_sampling": "yes"}, "rollout.truncation_sampling"),
])
def test_refusals_name_the_field(tmp_path, tiny_policy_dir, tiny_head_dir, rollout, field):
    with pytest.raises(ConfigError) as err:
        _cfg(tmp_path, tiny_policy_dir, tiny_head_dir, **rollout)
    assert err.value.field == field, str(err.value)


def test_the_actors_run_the_baseline_and_a_resume_may_not_switch_it(tmp_path, tiny_policy_dir, tiny_head_dir):
    cfg = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir)
    rule = cfg.rollout.behaviour_verifier.rule()
    assert rule.name == "sampling[typical]" and (rule.base.epsilon, rule.base.delta) == (0.3, 0.9)
    plain = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir, truncation_sampling=False)
    assert plain.rollout.behaviour_verifier == plain.rollout.verifier
    assert config_differences(config_dict(plain), config_dict(cfg)) == ["rollout.truncation_sampling: False -> True"]


def test_behaviour_logprobs_equal_the_closed_form(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray):
    from rollout.chat import chat_ids
    from rollout.models import TargetConfig, load_target
    from trainers.grpo.loop import GRPOTrainer, ProblemSource

    cfg = _cfg(tmp_path, tiny_policy_dir, tiny_head_dir)
    GRPOTrainer(cfg).run()
    records = [json.loads(line) for line in (tmp_path / "out" / "rollouts.jsonl").read_text().splitlines()]
    first = [r for r in records if r["step"] == 1]  # step 1's rollouts: the initial weights
    target, tok = load_target(TargetConfig(path=str(tiny_policy_dir)))
    prompts = [chat_ids(tok, p.prompt) for p in ProblemSource(cfg).for_step(0) for _ in range(cfg.grpo.group_size)]
    assert len(first) == len(prompts) == 6
    eps, delta = 0.3, 0.9
    gaps = []
    for prompt, rec in zip(prompts, first):
        ids = torch.tensor([prompt + rec["completion_ids"]])
        with torch.no_grad():
            logits = target.model(ids).logits[0, len(prompt) - 1:-1].double()  # [C, V]: the positions of the completion
        logp = torch.log_softmax(logits, dim=-1)
        p = logp.exp()
        entropy = -(p * logp).sum(-1, keepdim=True)
        inside = p >= torch.clamp(delta * torch.exp(-entropy), max=eps)  # typical's set A
        y = torch.tensor(rec["completion_ids"])[:, None]
        assert inside.gather(1, y).all(), "a token outside typical's set A was emitted"
        expected = logp.gather(1, y)[:, 0] - torch.log((p * inside).sum(-1))
        got = torch.tensor(rec["behaviour_logprobs"], dtype=torch.float64)
        assert torch.allclose(got, expected, atol=1e-3), (got - expected).abs().max()
        assert torch.allclose(torch.tensor(rec["target_logprobs"], dtype=torch.float64), logp.gather(1, y)[:, 0], atol=1e-3)
        gaps += (got - torch.tensor(rec["target_logprobs"], dtype=torch.float64)).tolist()
    assert min(gaps) > 0.05 and all(math.isfinite(g) for g in gaps)  # P(y) = p(y) / p(A) > p(y): truly truncated
