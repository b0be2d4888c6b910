"""How far TRL's importance ratios pi_old / P move from 1 under bf16 with lossless rollouts on the
embedded SmolLM2-135M and its shipped head (slow; ``-m slow -s`` prints the figures).

The rollouts compute in the policy's own dtype outside autocast; TRL scores the same tokens with
its training forward. fp32: both are the same fp32 model (ratios 1 up to summation order).
Mixed precision (``bf16=True`` over fp32 weights): TRL's forward runs under bf16 autocast while
the rollouts sample from the fp32 model, so the ratios carry bf16 matmul rounding. Pure bf16
(bf16 weights): both sides hold the same bf16 weights but accumulate differently."""

from __future__ import annotations

import os

import pytest
import torch

from tests.trainers.trl.trl_fixtures import make_trainer

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
pytest.importorskip("trl")

SETTINGS = {"fp32": (False, torch.float32), "mixed_bf16": (True, torch.float32), "pure_bf16": (True, torch.bfloat16)}


def ratio_gap(tmp_path, setting: str, steps: int = 2) -> dict[str, float]:
    """max and mean |pi_old / P - 1| over every valid completion token of ``steps`` steps."""
    from rollout.eagle3 import default_head_path
    from rollout.models import embedded_cache_dir, load_embedded_target

    bf16, dtype = SETTINGS[setting]
    load_embedded_target()  # builds the safetensors cache the trainer loads from
    trainer = make_trainer(tmp_path / setting, embedded_cache_dir(), default_head_path(), "lossless", steps=steps,
                           bf16=bf16, learning_rate=1e-5, max_completion_length=16, per_device_train_batch_size=4,
                           wrap=lambda model: model.to(dtype))
    trainer.train()
    r = torch.cat([(o["old_per_token_logps"] - o["sampling_per_token_logps"]).double().exp()[o["completion_mask"].bool()]
                   for o in trainer.outputs])
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return {"tokens": r.numel(), "max_abs": float((r - 1).abs().max()), "mean_abs": float((r - 1).abs().mean()),
            "mean": float(r.mean()), "loss_finite": all(torch.isfinite(torch.tensor(losses)).tolist())}


@pytest.mark.slow
def test_bf16_ratio_gap_on_the_embedded_model(tmp_path):
    gaps = {}
    for name in SETTINGS:
        g = gaps[name] = ratio_gap(tmp_path, name)
        print(f"{name:>11}: {g['tokens']} tokens  max |r-1| {g['max_abs']:.3e}  mean |r-1| {g['mean_abs']:.3e}  "
              f"mean r {g['mean']:.6f}", flush=True)
    assert all(g["loss_finite"] and g["tokens"] > 0 for g in gaps.values())
    assert gaps["fp32"]["max_abs"] < 2e-3
    assert gaps["mixed_bf16"]["mean_abs"] > gaps["fp32"]["mean_abs"]  # bf16 autocast is a real gap
