"""run.keep_checkpoints (trainers/grpo/checkpoint.py, prune_checkpoints): only the newest N complete
checkpoints stay, an older one is removed only once the newer one is complete (renamed from .tmp),
a failed save removes none, and the resume still finds the newest."""

from __future__ import annotations

import errno
import os
import shutil

import pytest
import torch

from rollout.config import ConfigError
from tests.trainers.conftest import model_and_optimizer, write_config
from trainers.grpo.checkpoint import DiskFullError, latest_checkpoint, load_checkpoint, save_checkpoint
from trainers.grpo.config import load_train_config


def _steps(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


@pytest.mark.parametrize("keep, left", [(1, [5]), (2, [4, 5]), (3, [3, 4, 5]), (None, [1, 2, 3, 4, 5])])
def test_only_the_newest_n_stay(keep, left, tmp_path):
    model, opt = model_and_optimizer()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model, opt, {"version": step}, keep=keep)
    assert _steps(tmp_path) == [f"step_{s:06d}" for s in left]
    found = latest_checkpoint(tmp_path)
    assert found.name == "step_000005"
    assert load_checkpoint(found, *model_and_optimizer(seed=4))["step"] == 5


def test_an_old_checkpoint_goes_only_after_the_new_one_is_complete(tmp_path, monkeypatch):
    model, opt = model_and_optimizer()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, {"version": step}, keep=2)
    root = tmp_path / "checkpoints"
    removed = []
    real = shutil.rmtree

    def watched(path, *args, **kwargs):
        name = os.path.basename(path)
        if name.startswith("step_") and not name.endswith(".tmp") and name != "step_000003":
            # an old checkpoint is removed: the new one is complete, under its final name
            assert (root / "step_000003" / "state.json").is_file() and not (root / "step_000003.tmp").exists()
            removed.append(name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(shutil, "rmtree", watched)
    save_checkpoint(tmp_path, 3, model, opt, {"version": 3}, keep=2)
    assert removed == ["step_000001"] and _steps(tmp_path) == ["step_000002", "step_000003"]


def test_a_failed_newer_save_removes_no_older_checkpoint(tmp_path, monkeypatch):
    model, opt = model_and_optimizer()
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, model, opt, {"version": step}, keep=2)
    assert _steps(tmp_path) == ["step_000002", "step_000003"]
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    for point in ((torch, "save"), (os, "fsync"), (type(tmp_path), "rename")):
        with monkeypatch.context() as m:
            m.setattr(*point, lambda *a, **k: (_ for _ in ()).throw(enospc))
            with pytest.raises(DiskFullError):
                save_checkpoint(tmp_path, 4, model, opt, {"version": 4}, keep=2)
        assert _steps(tmp_path) == ["step_000002", "step_000003"], point
    assert latest_checkpoint(tmp_path).name == "step_000003"


def test_retention_leaves_unreadable_and_later_folders_and_clears_old_partial_ones(tmp_path):
    model, opt = model_and_optimizer()
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, opt, {"version": step})
    root = tmp_path / "checkpoints"
    (root / "step_000001.tmp").mkdir()  # a save of an earlier run killed half-way
    (root / "step_000009").mkdir()  # not a checkpoint (no state.json): never removed
    save_checkpoint(tmp_path, 3, model, opt, {"version": 3}, keep=1)
    assert _steps(tmp_path) == ["step_000003", "step_000009"]
    assert latest_checkpoint(tmp_path).name == "step_000003"


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_keep_checkpoints_is_validated(value, tmp_path, tiny_policy_dir, tiny_head_dir):
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out",
                        run={"keep_checkpoints": value})
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    assert err.value.field == "run.keep_checkpoints", str(err.value)


def test_keep_checkpoints_default_and_null(tmp_path, tiny_policy_dir, tiny_head_dir):
    default = write_config(tmp_path / "a.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out")
    assert load_train_config(default).run.keep_checkpoints == 2
    every = write_config(tmp_path / "b.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out",
                         run={"keep_checkpoints": None})
    assert load_train_config(every).run.keep_checkpoints is None
