"""The TRL plug-in with peft LoRA adapters (a real TRL GRPOTrainer on the tiny random policy, CPU):
the rollouts sample the adapted policy (TRL's importance ratios stay 1 after the adapter moved),
their weights are the merged ones under the base model's names, and the trainer's model never
holds merged weights."""

from __future__ import annotations

import os

import pytest
import torch

from rollout.config import ConfigError
from tests.trainers.trl.trl_fixtures import make_trainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytest.importorskip("trl")
peft = pytest.importorskip("peft")

LORA = dict(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"], lora_dropout=0.0)


def _tiny_peft(policy_dir, **lora):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir))
    return peft.get_peft_model(model, peft.LoraConfig(**{**LORA, **lora}))


def _base_weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if "lora_" not in k}


def _check_adapted_training(trainer, steps: int) -> None:
    """Trains; the adapter moves, the ratios stay 1 at every step, the base weights stay as they were."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    base = _base_weights(model)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == steps and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    moved = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert moved and max(float(p.detach().abs().max()) for p in moved) > 1e-2, "the adapter did not move"
    for h in logs:  # each step's generation sampled the policy TRL scores, the adapter included
        assert abs(h["sampling/importance_sampling_ratio/min"] - 1) < 2e-3, h
        assert abs(h["sampling/importance_sampling_ratio/max"] - 1) < 2e-3, h
    for out in trainer.outputs:
        ratio = trainer.importance_ratios(out)[out["completion_mask"].bool()]
        assert ratio.numel() > 0 and (ratio - 1).abs().max() < 2e-3
    after = _base_weights(model)  # nothing merged into the trainer's model, not even rounded back
    assert after.keys() == base.keys()
    for name, value in base.items():
        assert torch.equal(after[name], value), name
    assert not any(getattr(m, "merged_adapters", []) for m in model.modules())
    # the rollouts' model holds the adapted policy: the same next-token logits as the trainer's
    trainer.rollouts.sync(trainer)
    prompts = [[1, 20, 300], [5, 6]]
    with torch.no_grad():
        ref = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts]).float()
    assert torch.allclose(trainer.rollouts.backend.next_token_logits(prompts), ref, atol=1e-4)


def test_lora_from_peft_config_samples_the_adapted_policy(tmp_path, tiny_policy_dir, tiny_head_dir):
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=3, learning_rate=0.05,
                           peft_config=peft.LoraConfig(**LORA))
    assert isinstance(trainer.model, peft.PeftModel)
    _check_adapted_training(trainer, 3)


def test_lora_from_a_peft_model_samples_the_adapted_policy(tmp_path, tiny_policy_dir, tiny_head_dir):
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=2, learning_rate=0.05,
                           wrap=lambda model: peft.get_peft_model(model, peft.LoraConfig(**LORA)))
    _check_adapted_training(trainer, 2)


@pytest.mark.parametrize("lora", [{}, {"use_dora": True}, {"use_rslora": True, "lora_bias": False}])
def test_merged_weights_are_the_adapted_policys_under_the_base_names(tiny_policy_dir, lora):
    from transformers import AutoModelForCausalLM

    from trainers.trl.peft_policy import merged_state_dict, plain_copy

    model = _tiny_peft(tiny_policy_dir, **lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.05)  # an adapter that moved
    base = _base_weights(model)
    merged = merged_state_dict(model)
    plain_keys = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir)).state_dict().keys()
    assert merged.keys() == plain_keys
    assert not any("base_layer" in k or "lora_" in k or k.startswith("base_model") for k in merged)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"])
    copy = plain_copy(model)
    ids = torch.tensor([[1, 20, 300, 4000, 7]])
    with torch.no_grad():
        assert torch.allclose(copy(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-5)
    for name, value in _base_weights(model).items():  # computed out of place
        assert torch.equal(value, base[name]), name


def test_adapters_without_merged_weights_are_refused(tiny_policy_dir):
    from transformers import AutoModelForCausalLM

    from trainers.trl.peft_policy import check_lora

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir))
    ia3 = peft.get_peft_model(model, peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                    feedforward_modules=["down_proj"]))
    with pytest.raises(ConfigError, match="peft_config.*IA3.*LoraConfig"):
        check_lora(ia3)
