"""The TRL plug-in tests' trainer: a real TRL GRPOTrainer with our rollouts on the tiny random
policy (CPU), recording every generation's output (``test_trl.py``, ``test_trl_head.py``)."""

from __future__ import annotations

import os

import torch

from rollout.models import TargetConfig
from rollout.params import SpecConfig, VerifierConfig
from trainers.grpo.correction import CorrectionConfig
from trainers.grpo.online_drafter import OnlineDrafterConfig

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

PROMPTS = [[{"role": "user", "content": f"What is {i} plus {2 * i}?"}] for i in range(8)]


def varied_reward(completions, **kwargs):
    """Varies within a group (so advantages, and the gradient, are non-zero)."""
    return [float(len(c[0]["content"]) % 3) for c in completions]


class Recording:
    """Mixed into the trainer: keeps every generation's output and TRL's ratios."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.outputs = getattr(self, "outputs", []) + [out]
        return out


def make_trainer(tmp_path, policy_dir, head_dir, verifier="lossless", params=None, correction=None, steps=2,
             placement="local", reload_every=0, spec=None, drafter_training=None, eval_prompts=None,
             peft_config=None, wrap=None, **args):
    """The trainer on the tiny policy; ``peft_config`` goes to TRL as it is, ``wrap`` (model -> model,
    e.g. peft's ``get_peft_model``) is applied to the policy before TRL sees it."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from trainers.trl import RolloutSettings, SpeculativeGRPOTrainer

    class Trainer(Recording, SpeculativeGRPOTrainer):
        pass

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir))
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    if wrap is not None:
        model = wrap(model)
    kw = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
              num_generations=4, max_completion_length=8, max_steps=steps, learning_rate=1e-3, report_to=[],
              logging_steps=1, save_strategy="no", temperature=1.0, seed=0)
    kw.update(args)
    settings = RolloutSettings(spec=spec or SpecConfig(mode="chain", num_draft_tokens=3),
                               verifier=VerifierConfig(verifier, params or {}), drafter=str(head_dir),
                               placement=placement, target=TargetConfig(path=str(policy_dir)),
                               drafter_reload_every=reload_every,
                               drafter_training=OnlineDrafterConfig(**(drafter_training or {})),
                               threads_per_actor=1, threads=2)
    return Trainer(model=model, reward_funcs=varied_reward, args=GRPOConfig(**kw),
                   train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]), processing_class=tok,
                   eval_dataset=Dataset.from_list([{"prompt": p} for p in eval_prompts]) if eval_prompts else None,
                   rollouts=settings, correction=correction or CorrectionConfig(mode="token_tis", cap=2.0),
                   **({"peft_config": peft_config} if peft_config is not None else {}))
