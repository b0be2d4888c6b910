"""Every numeric trl argument is range-checked when the config loads (trainers/trl/arg_ranges.py):
a value outside TRL's, transformers' or torch's bounds exits 2 with `error: config field
'trl.<name>'` before any model loads, the bounds themselves pass, and every numeric GRPOConfig field
has a range. The TRL path's checkpoints are checked for disk space and removed whole when a write
fails (scripts.train_trl exits 4)."""

from __future__ import annotations

import errno
import os
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl")

Usage = namedtuple("Usage", "total used free")


def _config(tmp_path, policy, head, out, **trl) -> Path:
    cfg = {"run": {"out_dir": str(out), "steps": 1, "seed": 0},
           "model": {"target": {"path": str(policy)}, "drafter": str(head)},
           "rollout": {"spec": {"mode": "chain", "num_draft_tokens": 3}, "threads": 2},
           "task": {"source": "arithmetic", "difficulty": 1, "prompts_per_step": 2},
           "trl": {"num_generations": 4, "max_completion_length": 8, "temperature": 1.0, "learning_rate": 1e-3,
                   "logging_steps": 1, "save_strategy": "no", "report_to": [], **trl}}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _no_model(*args, **kwargs):
    raise AssertionError("a model loaded before the config was refused")


BAD = [
    ("num_generations", 1), ("temperature", -1), ("temperature", 0), ("learning_rate", -1),
    ("max_completion_length", 0), ("epsilon", -0.1), ("epsilon_high", -0.2), ("beta", -1), ("num_iterations", 0),
    ("top_p", 1.5), ("top_p", 0), ("top_k", -2), ("min_p", 2.0), ("repetition_penalty", 0), ("weight_decay", -1),
    ("adam_beta1", 1.5), ("adam_beta2", 1.0), ("adam_epsilon", -1e-8), ("max_grad_norm", -1), ("warmup_steps", -1),
    ("logging_steps", -1), ("logging_steps", 0), ("save_steps", 0), ("eval_steps", -5),
    ("gradient_accumulation_steps", 0), ("steps_per_generation", 0), ("generation_batch_size", 0),
    ("save_total_limit", 0), ("dataloader_num_workers", -1), ("per_device_eval_batch_size", 0),
    ("num_train_epochs", 0), ("delta", 0.5), ("top_entropy_quantile", 1.5), ("ref_model_mixup_alpha", -0.1),
    ("vllm_gpu_memory_utilization", 1.2), ("vllm_server_port", 70000), ("sapo_temperature_neg", 0),
    ("vespo_lambda_pos", 0), ("entropy_coef", -0.1), ("off_policy_mask_threshold", 0), ("pad_to_multiple_of", 0),
    ("num_completions_to_print", -1), ("ddp_timeout", 0), ("torch_empty_cache_steps", 0),
]


@pytest.mark.parametrize("name, value", BAD)
def test_an_out_of_range_argument_is_refused_naming_it(name, value, tmp_path, tiny_policy_dir, tiny_head_dir):
    from rollout.config import ConfigError
    from trainers.trl.config import load_trl_config

    path = _config(tmp_path, tiny_policy_dir, tiny_head_dir, tmp_path / "out", **{name: value})
    with pytest.raises(ConfigError) as err:
        load_trl_config(path)
    assert err.value.field == f"trl.{name}", str(err.value)
    assert f"got {value!r}" in str(err.value)


@pytest.mark.parametrize("name, value", [("learning_rate", -1), ("beta", -1), ("num_iterations", 0), ("top_p", 1.5)])
def test_the_cli_exits_2_before_any_model_loads(name, value, tmp_path, tiny_policy_dir, tiny_head_dir, capsys,
                                                 monkeypatch):
    from scripts.train_trl import main

    monkeypatch.setattr("rollout.models.load_target", _no_model)
    path = _config(tmp_path, tiny_policy_dir, tiny_head_dir, tmp_path / "out", **{name: value})
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: config field 'trl.{name}': must be") and "Traceback" not in err, err
    assert not (tmp_path / "out").exists()


def test_the_bounds_themselves_pass(tmp_path, tiny_policy_dir, tiny_head_dir):
    from trainers.trl.config import load_trl_config

    edges = dict(learning_rate=0.0, beta=0.0, epsilon=0.0, top_p=1.0, top_k=0, max_grad_norm=0.0, weight_decay=0.0,
                 adam_beta1=0.0, num_iterations=1, save_total_limit=1, delta=1.5, top_entropy_quantile=0.0,
                 warmup_steps=0.0, logging_steps=0.5)
    cfg = load_trl_config(_config(tmp_path, tiny_policy_dir, tiny_head_dir, tmp_path / "out", **edges))
    assert cfg.grpo_config().top_p == 1.0


def test_entropy_bounds_are_ordered(tmp_path, tiny_policy_dir, tiny_head_dir):
    from rollout.config import ConfigError
    from trainers.trl.config import load_trl_config

    path = _config(tmp_path, tiny_policy_dir, tiny_head_dir, tmp_path / "out", entropy_coef_min=0.5,
                   entropy_coef_max=0.1)
    with pytest.raises(ConfigError, match="'trl.entropy_coef_min': must not exceed trl.entropy_coef_max"):
        load_trl_config(path)


def test_every_numeric_grpo_argument_has_a_range():
    """A numeric field a newer TRL adds must get its range here (or be one the script sets)."""
    from trainers.trl.arg_ranges import RANGES, numeric_fields
    from trainers.trl.config import CORRECTION_PREFIX, OWNED, _grpo_fields

    fields = _grpo_fields()
    numeric = set(numeric_fields(fields))
    assert {"learning_rate", "num_generations", "temperature", "beta", "epsilon"} <= numeric
    missing = sorted(n for n in numeric - set(RANGES) - set(OWNED) if not n.startswith(CORRECTION_PREFIX))
    assert not missing, f"numeric GRPOConfig arguments without a range: {missing}"
    assert not set(RANGES) - numeric, "a range for a field GRPOConfig no longer has"


def test_reward_weights_are_the_scripts(tmp_path, tiny_policy_dir, tiny_head_dir):
    from rollout.config import ConfigError
    from trainers.trl.config import load_trl_config

    path = _config(tmp_path, tiny_policy_dir, tiny_head_dir, tmp_path / "out", reward_weights=[1.0, 2.0])
    with pytest.raises(ConfigError, match="'trl.reward_weights': is set by the script"):
        load_trl_config(path)


# ---------------------------------------------------------------------------- the TRL path's checkpoints


def test_a_trl_checkpoint_that_does_not_fit_exits_4(tmp_path, tiny_policy_dir, tiny_head_dir, capsys, monkeypatch):
    from scripts.train_trl import main

    out = tmp_path / "out"
    path = _config(tmp_path, tiny_policy_dir, tiny_head_dir, out, save_strategy="steps", save_steps=1)
    text = yaml.safe_load(path.read_text())
    text["run"]["steps"] = 2
    path.write_text(yaml.safe_dump(text))
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 ** 12, 10 ** 12, 5000)
                        if Path(p) == out and (out / "checkpoint-1").is_dir() else real(p))
    assert main(["--config", str(path)]) == 4
    err = capsys.readouterr().err  # (after TRL's progress bar, which ends without a newline)
    assert err.count("error: ") == 1
    line = err[err.index("error: "):].splitlines()[0]
    assert line.startswith(f"error: not enough disk space for checkpoint checkpoint-2 in {out}")
    assert "5.00 kB (5000 bytes) free" in line and f"the last complete checkpoint is {out / 'checkpoint-1'}" in line
    assert (out / "checkpoint-1" / "trainer_state.json").is_file() and not (out / "checkpoint-2").exists()
    assert not (out / ".lock").exists()


def test_a_trl_checkpoint_that_runs_out_of_space_is_removed_whole(tmp_path, tiny_policy_dir, tiny_head_dir,
                                                                  monkeypatch):
    import torch

    from tests.trainers.trl.trl_fixtures import make_trainer
    from trainers.grpo.checkpoint import DiskFullError

    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=2, save_strategy="steps", save_steps=1)
    out = tmp_path / "out"
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if "checkpoint-2" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)
    with pytest.raises(DiskFullError) as full:
        trainer.train()
    assert not (out / "checkpoint-2").exists() and (out / "checkpoint-1" / "trainer_state.json").is_file()
    text = str(full.value)
    assert f"writing checkpoint checkpoint-2 in {out} ran out of disk space" in text
    assert "removed the partial checkpoint-2" in text
    assert f"the last complete checkpoint is {out / 'checkpoint-1'}" in text
