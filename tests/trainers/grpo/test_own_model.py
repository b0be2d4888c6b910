"""A training run on a model of another family than the embedded Llama: a tiny Gemma 2 (attention
and logit soft-capping, alternating sliding windows, scaled embeddings) given by path, with a head
for it, through the real Ray actor and the trainer. Its lossless rollouts are on the policy at
every step, after the weights moved: the actor's engine and the trainer's forward agree."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import build_tiny_head, build_tiny_policy
from tests.trainers.conftest import write_config


@pytest.fixture(scope="module")
def gemma2_policy(tmp_path_factory):
    return build_tiny_policy(tmp_path_factory.mktemp("gemma2"), "gemma2", sliding_window=8,
                             attn_logit_softcapping=0.05, final_logit_softcapping=2.0)


def test_lossless_rollouts_of_a_gemma2_policy_are_on_policy(tmp_path, gemma2_policy, local_ray):
    from trainers.grpo.config import load_train_config
    from trainers.grpo.loop import GRPOTrainer

    head = build_tiny_head(gemma2_policy, tmp_path / "head")
    path = write_config(tmp_path / "gemma2.yaml", gemma2_policy, head, tmp_path / "run",
                        run={"steps": 2, "checkpoint_every": 0},
                        rollout={"sampling": {"temperature": 1.0, "max_new_tokens": 16},
                                 "verifier": {"name": "lossless", "params": {}}},
                        correction={"mode": "token_mis", "low": 0.999, "high": 1.001})
    rows = GRPOTrainer(load_train_config(path)).run()
    assert len(rows) == 2
    for r in rows:  # step 2 runs on weights updated by step 1
        assert r["log_ratio_abs_max"] < 1e-3, r
        assert r["rollout_vs_trainer_logp_max"] < 1e-3, r
        assert r["is_masked_frac"] == 0.0
    records = [json.loads(x) for x in (tmp_path / "run" / "rollouts.jsonl").read_text().splitlines()]
    assert max(len(r["completion_ids"]) for r in records) > 8, "completions longer than the window"
    for rec in records:
        w = torch.tensor(rec["weights"])
        assert torch.allclose(w, torch.ones_like(w), atol=1e-3)
