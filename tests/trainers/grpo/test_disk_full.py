"""Out of disk space, said plainly and survived (trainers/grpo/checkpoint.py): a checkpoint whose
estimated size exceeds the volume's free space is refused before anything is written; a write
that runs out of space anyway (ENOSPC from any writer, torch's and safetensors' own errors)
removes its .tmp folder and names the folder, the bytes needed and free and the last good
checkpoint, from which a resume continues; scripts.train exits 4 and a rerun resumes."""

from __future__ import annotations

import errno
import os
import pickle
import shutil
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from tests.trainers.conftest import model_and_optimizer, write_config
from trainers.grpo import checkpoint as ck
from trainers.grpo.checkpoint import (CheckpointWriteError, DiskFullError, latest_checkpoint, load_checkpoint,
                                      save_checkpoint, write_atomic)

Usage = namedtuple("Usage", "total used free")
REAL_DISK_USAGE = shutil.disk_usage


def _free_space(monkeypatch, free: int, full_once: Path | None = None) -> None:
    """``shutil.disk_usage`` reporting ``free`` bytes (with ``full_once``: only while that folder
    exists, e.g. a save's .tmp folder, so the check before the save passes)."""
    def fake(path):
        if full_once is not None and not full_once.is_dir():
            return REAL_DISK_USAGE(path)
        return Usage(10 ** 12, 10 ** 12 - free, free)

    monkeypatch.setattr(shutil, "disk_usage", fake)


def _steps(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def _saved(out: Path):
    """A run folder with the checkpoint of step 2, and the model and optimizer a step later."""
    model, opt = model_and_optimizer()
    save_checkpoint(out, 2, model, opt, {"version": 2})
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt, before


def _assert_resumes_from_step_2(out: Path, before: dict) -> None:
    found = latest_checkpoint(out)
    assert found is not None and found.name == "step_000002"
    model, opt = model_and_optimizer(seed=9)
    assert load_checkpoint(found, model, opt)["step"] == 2
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    save_checkpoint(out, 4, model, opt, {"version": 4})  # space made: the next save goes through
    assert latest_checkpoint(out).name == "step_000004"


def test_a_shortfall_stops_before_anything_is_written(tmp_path, monkeypatch):
    model, opt, before = _saved(tmp_path)
    _free_space(monkeypatch, 1000)
    writes = []
    monkeypatch.setattr(ck, "save_file", lambda *a, **k: writes.append(a))
    with pytest.raises(DiskFullError) as full:
        save_checkpoint(tmp_path, 4, model, opt, {"version": 4})
    err = full.value
    assert not writes and _steps(tmp_path) == ["step_000002"]
    root = tmp_path / "checkpoints"
    assert err.free == 1000 and err.needed > 1000 and err.folder == str(root)
    assert err.last_good == str(root / "step_000002")
    text = str(err)
    for part in (f"not enough disk space for checkpoint step_000004 in {root}", f"({err.needed} bytes)",
                 "1.00 kB (1000 bytes) free", f"the last good checkpoint is {root / 'step_000002'}",
                 "rerun the same command"):
        assert part in text, (part, text)
    monkeypatch.undo()
    _assert_resumes_from_step_2(tmp_path, before)


def test_the_estimate_covers_a_real_checkpoint(tmp_path, tiny_policy_dir, monkeypatch):
    """On the tiny Llama (tied embedding) after an AdamW step: the estimate is at least the size
    the checkpoint takes, and not much more."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    opt.step()
    seen = []
    monkeypatch.setattr(ck, "require_space", lambda folder, needed, *a: seen.append(needed))
    path = save_checkpoint(tmp_path, 1, model, opt, {"version": 1})
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    (needed,) = seen
    assert size <= needed <= size * 1.02 + (2 << 20), (size, needed)


# each write of a save that can meet a full disk, and the error it raises there
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
WRITE_FAILURES = {
    "weights (safetensors)": (ck, "save_file", "SafetensorError"),
    "optimizer (torch ENOSPC)": (torch, "save", ENOSPC),
    "optimizer (torch's zip writer)": (torch, "save", RuntimeError(
        "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")),
    "drafter copy": (shutil, "copytree", shutil.Error([("a", "b", "[Errno 28] No space left on device")])),
    "state.json": (os, "fsync", ENOSPC),
    "rename": (Path, "rename", ENOSPC),
}


@pytest.mark.parametrize("point", list(WRITE_FAILURES))
def test_running_out_of_space_during_a_save_removes_it_and_names_the_last_good_one(point, tmp_path, monkeypatch):
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text("{}")
    out = tmp_path / "run"
    model, opt, before = _saved(out)
    target, name, error = WRITE_FAILURES[point]
    if error == "SafetensorError":
        from safetensors import SafetensorError

        error = SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    def fail(*args, **kwargs):
        if name == "save" or name == "save_file":  # a partial file first, as a real write leaves
            Path(args[1]).write_bytes(b"\0" * 4096)
        raise error

    monkeypatch.setattr(target, name, fail)
    if isinstance(error, RuntimeError) and name == "save":  # no errno: the volume is full at that moment
        _free_space(monkeypatch, 100, full_once=out / "checkpoints" / "step_000004.tmp")
    with pytest.raises(DiskFullError) as full:
        save_checkpoint(out, 4, model, opt, {"version": 4}, head)
    monkeypatch.undo()
    root = out / "checkpoints"
    assert _steps(out) == ["step_000002"]  # no step_000004.tmp left
    text = str(full.value)
    for part in (f"writing checkpoint step_000004 in {root} ran out of disk space", f"({full.value.needed} bytes)",
                 "free after removing the partial copy", "removed the partial step_000004.tmp",
                 f"the last good checkpoint is {root / 'step_000002'}"):
        assert part in text, (part, text)
    _assert_resumes_from_step_2(out, before)


def test_another_write_error_is_named_as_such(tmp_path, monkeypatch):
    """A failed write that is not a full volume (an I/O error, torch's writer error with space
    left) is a CheckpointWriteError, not a DiskFullError; the partial checkpoint is removed too."""
    model, opt, before = _saved(tmp_path)
    for error in (OSError(errno.EIO, os.strerror(errno.EIO)),
                  RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")):
        with monkeypatch.context() as m:
            m.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(error))
            with pytest.raises(CheckpointWriteError) as failed:
                save_checkpoint(tmp_path, 4, model, opt, {"version": 4})
        assert type(failed.value) is CheckpointWriteError, failed.value
        assert "writing checkpoint step_000004" in str(failed.value) and "removed the partial" in str(failed.value)
        assert _steps(tmp_path) == ["step_000002"]
    with monkeypatch.context() as m:  # not a write failure: raised as it is, the partial folder removed
        m.setattr(torch, "save", lambda *a, **k: (_ for _ in ()).throw(TypeError("a bug")))
        with pytest.raises(TypeError, match="a bug"):
            save_checkpoint(tmp_path, 4, model, opt, {"version": 4})
    assert _steps(tmp_path) == ["step_000002"]
    _assert_resumes_from_step_2(tmp_path, before)


def test_write_atomic_out_of_space_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "config.json"
    path.write_text("old")
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(ENOSPC))
    with pytest.raises(DiskFullError, match=f"writing config.json in {tmp_path} ran out of disk space"):
        write_atomic(path, "new text")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]


def test_the_errors_cross_a_pickle_whole():
    err = DiskFullError("/r/checkpoints", "checkpoint step_000004", 5000, 10, "advice", "/r/checkpoints/step_000002")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is DiskFullError and str(back) == str(err)
    assert (back.needed, back.free, back.folder, back.last_good) == (5000, 10, "/r/checkpoints",
                                                                      "/r/checkpoints/step_000002")


def test_train_exits_4_when_a_checkpoint_does_not_fit_and_a_rerun_resumes(tmp_path, tiny_policy_dir, tiny_head_dir,
                                                                        monkeypatch, capsys):
    """scripts.train end to end (local Ray, tiny policy): the third checkpoint does not fit, the run
    stops with exit 4 and one message; the two kept checkpoints (run.keep_checkpoints 2) and the logs
    stay, and the same command, space made, resumes from step 2 and finishes."""
    from scripts.train import main
    from trainers.grpo.report import read_metrics

    out = tmp_path / "run"
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, out,
                        run={"steps": 3, "checkpoint_every": 1, "keep_checkpoints": 2})
    root = out / "checkpoints"
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 ** 12, 10 ** 12, 4096)
                        if Path(p) == root and (root / "step_000002").is_dir() else real(p))
    assert main(["--config", str(path)]) == 4
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1 and lines[0].startswith(f"error: not enough disk space for checkpoint step_000003 in {root}")
    assert "4.10 kB (4096 bytes) free" in lines[0] and f"the last good checkpoint is {root / 'step_000002'}" in lines[0]
    assert _steps(out) == ["step_000001", "step_000002"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]  # the logs intact
    monkeypatch.undo()
    assert main(["--config", str(path)]) == 0
    said = capsys.readouterr().out
    assert f"resumed from {root / 'step_000002'} (step 2)" in said
    assert _steps(out) == ["step_000002", "step_000003"]
    assert [r["step"] for r in read_metrics(out)] == [1, 2, 3]
