"""One writer per run folder (trainers/grpo/run_lock.py): a second writer is refused naming the
holder while a real child process holds the lock, and allowed once it ends (SIGTERM: the file is
removed) or is killed (SIGKILL: the stale record is taken over with a note); a record from another
host, or of a live pid that holds no flock, refuses the folder; the commands that write a run
folder take the lock before Ray or any model, and the read-only ones take none."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.trainers.conftest import write_config
from trainers.grpo.run_lock import LOCK_NAME, RunLock, RunLockedError

REPO = Path(__file__).resolve().parents[3]

HOLDER = """
import sys, time
from trainers.grpo.run_lock import RunLock
with RunLock(sys.argv[1], "test.holder"):
    print("locked", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(out: Path, seconds: float = 120) -> subprocess.Popen:
    """A child process holding ``out``'s lock (it has printed "locked")."""
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(out), str(seconds)], cwd=REPO, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    line = p.stdout.readline().strip()
    assert line == "locked", (line, p.stderr.read() if p.poll() is not None else "")
    return p


@pytest.fixture
def holder(tmp_path):
    procs = []

    def start(out: Path, seconds: float = 120) -> subprocess.Popen:
        procs.append(_holder(out, seconds))
        return procs[-1]

    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait()


def _record(out: Path) -> dict:
    return json.loads((out / LOCK_NAME).read_text())


def test_a_second_writer_is_refused_naming_the_holder_until_sigterm_ends_it(tmp_path, holder, capfd):
    out = tmp_path / "run"
    child = holder(out)
    rec = _record(out)
    assert rec["pid"] == child.pid and rec["host"] == socket.gethostname() and rec["command"] == "test.holder"
    with pytest.raises(RunLockedError) as refused:
        with RunLock(out, "scripts.train"):
            pytest.fail("entered a folder another process holds")
    text = str(refused.value)
    for part in (str(out), "test.holder", f"pid {child.pid}", f"host {socket.gethostname()}", rec["started"],
                 "wait for it to finish", f"kill {child.pid}"):
        assert part in text, (part, text)
    assert _record(out) == rec  # the refused writer changed nothing
    child.send_signal(signal.SIGTERM)  # released on SIGTERM: the lock file removed
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert not (out / LOCK_NAME).exists()
    capfd.readouterr()
    with RunLock(out, "scripts.train") as lock:
        assert _record(out)["pid"] == os.getpid() and lock.takeover is None
    assert "took over" not in capfd.readouterr().err
    assert not (out / LOCK_NAME).exists()


def test_a_killed_holders_lock_is_taken_over_with_a_note(tmp_path, holder, capfd):
    out = tmp_path / "run"
    child = holder(out)
    child.kill()  # SIGKILL: nothing of it runs; the kernel releases its flock, its record stays
    child.wait()
    stale = _record(out)
    assert stale["pid"] == child.pid
    capfd.readouterr()
    with RunLock(out, "scripts.train") as lock:
        assert lock.takeover == stale and _record(out)["pid"] == os.getpid()
    err = capfd.readouterr().err
    assert f"note: took over the lock of {out}" in err and f"pid {child.pid}" in err and "no longer runs" in err
    assert not (out / LOCK_NAME).exists()


def test_a_record_from_another_host_is_refused_naming_it(tmp_path):
    """Where flock does not reach across hosts, the record alone refuses the folder: that host's
    process cannot be checked from here."""
    out = tmp_path / "run"
    out.mkdir()
    rec = {"host": "node-7", "pid": 4242, "started": "2026-01-02T03:04:05+00:00", "command": "scripts.train"}
    (out / LOCK_NAME).write_text(json.dumps(rec))
    with pytest.raises(RunLockedError) as refused:
        with RunLock(out, "scripts.train"):
            pytest.fail("entered a folder held from another host")
    text = str(refused.value)
    for part in ("host node-7", "pid 4242", "2026-01-02T03:04:05+00:00", "scripts.train", "kill 4242 on host node-7",
                 f"remove {out / LOCK_NAME}"):
        assert part in text, (part, text)
    assert json.loads((out / LOCK_NAME).read_text()) == rec


def test_a_live_holder_without_a_flock_is_refused(tmp_path):
    """A record of a live process on this host whose flock is not there (storage where flock does
    nothing): refused, never taken over."""
    out = tmp_path / "run"
    out.mkdir()
    other = subprocess.Popen(["sleep", "60"])
    try:
        rec = {"host": socket.gethostname(), "pid": other.pid, "started": "2026-01-02T03:04:05+00:00",
               "command": "scripts.drift"}
        (out / LOCK_NAME).write_text(json.dumps(rec))
        with pytest.raises(RunLockedError, match=f"scripts.drift \\(pid {other.pid} on host"):
            with RunLock(out, "scripts.train"):
                pytest.fail("entered a folder a live process holds")
    finally:
        other.kill()
        other.wait()


def test_locks_nest_on_different_folders_and_refuse_the_same_one_twice(tmp_path):
    study, sub = tmp_path / "study", tmp_path / "study" / "run_1"
    with RunLock(study, "study"):
        with RunLock(sub, "scripts.train"):
            assert _record(study)["command"] == "study" and _record(sub)["command"] == "scripts.train"
        assert not (sub / LOCK_NAME).exists() and (study / LOCK_NAME).exists()
        with pytest.raises(RunLockedError, match=r"already held by this process \(study, pid"):
            with RunLock(study, "again"):
                pytest.fail("entered a folder this process holds")
        assert _record(study)["command"] == "study"
    assert not (study / LOCK_NAME).exists()


def test_a_flock_held_before_its_record_is_written_refuses(tmp_path):
    """The flock alone refuses: a writer that holds it has not written its record yet."""
    import fcntl

    out = tmp_path / "run"
    out.mkdir()
    fd = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(RunLockedError, match="a writer whose record is not readable yet"):
            with RunLock(out, "scripts.train"):
                pytest.fail("entered a folder whose flock is held")
    finally:
        os.close(fd)


SPAWNER = """
import os, subprocess, sys, time
from trainers.grpo.run_lock import RunLock
with RunLock(sys.argv[1], "test.spawner"):
    if sys.argv[2] == "exec":  # a program started with every descriptor that may be inherited
        worker = subprocess.Popen(["sleep", "60"], close_fds=False).pid
    else:  # a forked copy of this process, which shares its descriptors
        worker = os.fork()
        if worker == 0:
            time.sleep(60)
            os._exit(0)
    print(worker, flush=True)
    time.sleep(60)
"""


def _killed_spawner(out: Path, how: str) -> int:
    """A holder that started a worker (``how``: exec or fork) and was then killed; returns the worker's pid."""
    holder = subprocess.Popen([sys.executable, "-c", SPAWNER, str(out), how], cwd=REPO, text=True,
                              stdout=subprocess.PIPE)
    worker = int(holder.stdout.readline())
    holder.kill()
    holder.wait()
    assert os.path.exists(f"/proc/{worker}")
    return worker


def test_the_lock_is_released_on_an_exception_and_not_inherited(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(ZeroDivisionError):
        with RunLock(out, "scripts.train"):
            raise ZeroDivisionError
    assert not (out / LOCK_NAME).exists()
    # a holder that started a program (a Ray worker) and was then killed: the program, still
    # running, does not hold the lock (the descriptor is close-on-exec), so the folder is free
    worker = _killed_spawner(out, "exec")
    try:
        with RunLock(out, "scripts.train") as lock:
            assert lock.takeover["command"] == "test.spawner"
    finally:
        os.kill(worker, signal.SIGKILL)


def test_a_forked_child_that_outlives_its_holder_is_named(tmp_path):
    """A forked child shares the holder's flock: after the holder's death the folder stays held, and
    the refusal says the holder is gone and how to find what still holds the file."""
    out = tmp_path / "run"
    worker = _killed_spawner(out, "fork")
    try:
        with pytest.raises(RunLockedError) as refused:
            with RunLock(out, "scripts.train"):
                pytest.fail("entered a folder whose flock a live process holds")
        assert "no longer runs, but a process it forked still holds" in str(refused.value)
        assert f"fuser -v {out / LOCK_NAME}" in str(refused.value)
    finally:
        os.kill(worker, signal.SIGKILL)
    for _ in range(50):  # the worker gone (reaped by init), the folder is free again
        try:
            if Path(f"/proc/{worker}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break
        except OSError:
            break
        time.sleep(0.1)
    with RunLock(out, "scripts.train") as lock:
        assert lock.takeover["command"] == "test.spawner"


# ---------------------------------------------------------------------------- the commands


def test_train_refuses_a_locked_run_folder_before_ray(tmp_path, holder, tiny_policy_dir, tiny_head_dir, capsys):
    import ray

    from scripts.train import main

    out = tmp_path / "run"
    child = holder(out)
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, out)
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: run folder {out} is in use: test.holder (pid {child.pid} on host")
    assert len(err.strip().splitlines()) == 1 and not ray.is_initialized()
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]  # nothing of the run written


def _no_model(*args, **kwargs):
    raise AssertionError("a model loaded in a locked folder")


def test_the_other_writers_refuse_a_locked_folder(tmp_path, holder, tiny_policy_dir, tiny_head_dir, capsys,
                                                   monkeypatch):
    """scripts.drift, scripts.train_trl and scripts.train_drafter take the lock of their output
    folder before any model loads."""
    from scripts import drift, train_drafter, train_trl

    monkeypatch.setattr("rollout.models.load_target", _no_model)
    monkeypatch.setattr(train_drafter, "load_target", _no_model)
    monkeypatch.setattr("trainers.drift.run.load_models", _no_model)
    out = tmp_path / "run"
    child = holder(out)
    said = f"is in use: test.holder (pid {child.pid} on host"

    assert drift.main(["--quick", "--out", str(out)]) == 2
    assert said in capsys.readouterr().err

    trl_cfg = {"run": {"out_dir": str(out), "steps": 1}, "model": {"target": {"path": str(tiny_policy_dir)},
                                                                   "drafter": str(tiny_head_dir)},
               "task": {"prompts_per_step": 2}, "trl": {"num_generations": 4, "max_completion_length": 8,
                                                         "report_to": [], "save_strategy": "no"}}
    (tmp_path / "trl.yaml").write_text(yaml.safe_dump(trl_cfg))
    assert train_trl.main(["--config", str(tmp_path / "trl.yaml")]) == 2
    assert said in capsys.readouterr().err

    (tmp_path / "drafter.yaml").write_text(yaml.safe_dump({"out_dir": str(out)}))
    with pytest.raises(SystemExit) as stopped:
        train_drafter.main(["--config", str(tmp_path / "drafter.yaml")])
    assert stopped.value.code == 2 and said in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME]


def test_read_only_commands_take_no_lock(tmp_path, holder, capsys):
    from scripts import compare_runs

    out = tmp_path / "run"
    out.mkdir()
    rows = [{"step": s, "reward_mean": 0.1 * s, "accuracy": 0.1, "is_ess": 0.9} for s in (1, 2)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    holder(out)
    assert compare_runs.main([str(out), "--metrics", "reward_mean,accuracy"]) == 0
    assert "reward" in capsys.readouterr().out
