"""`ray job submit` as the README shows it keeps the run (slow: starts its own Ray head).

A head is started with its own port and temp folder (``ray start --head``), a tiny
training job is submitted through the Ray Jobs client with ``--working-dir`` and an
absolute out_dir, the head is stopped (only the processes of that temp folder, never a
bare ``ray stop``, which would stop other Ray instances on the machine), and the outputs
are where the job said. A second head and submission resume from them, and a relative
out_dir is refused inside the job's temporary working-directory copy."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.trainers.conftest import write_config

REPO = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pids_of(marker: str) -> list[int]:
    """Processes started by one head: every Ray process inherits the head's environment, so
    they all carry ``marker`` there (process titles such as ``ray::DashboardAgent`` hide the
    command line; other Ray instances on the machine do not have the marker)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit() and int(p.name) != os.getpid():
            try:
                if marker.encode() in (p / "environ").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


class Head:
    def __init__(self, temp_dir: Path):
        self.temp_dir, self.dash = temp_dir, _free_port()
        self.marker = f"HONEST_ROLLOUTS_TEST_HEAD={temp_dir.name}"
        self.env = dict(os.environ, RAY_AUTH_MODE="disabled", MKL_CBWR="AVX2", TOKENIZERS_PARALLELISM="false",
                        HONEST_ROLLOUTS_TEST_HEAD=temp_dir.name)
        # a port found free can be taken by another process before Ray binds it: a failed start is
        # cleaned up and tried once more on fresh ports, and a second failure shows Ray's output
        for _ in range(2):
            done = self._start()
            if done.returncode == 0:
                return
            self.stop()
            self.dash = _free_port()
        raise RuntimeError(f"ray start --head failed twice (exit {done.returncode}):\n"
                           f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}")

    def _start(self) -> subprocess.CompletedProcess:
        # every port named: the defaults (e.g. the job agent's 52365) may belong to another Ray here
        ports = [f"--{name}={_free_port()}" for name in (
            "port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
            "runtime-env-agent-port", "ray-client-server-port", "node-manager-port", "object-manager-port")]
        ray_bin = str(Path(sys.executable).parent / "ray")
        return subprocess.run([ray_bin, "start", "--head", *ports, f"--dashboard-port={self.dash}",
                               "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--num-cpus=2",
                               f"--temp-dir={self.temp_dir}", "--disable-usage-stats"],
                              env=self.env, capture_output=True, text=True, timeout=180)

    def submit(self, entrypoint: list[str], timeout: float = 600) -> tuple[str, str]:
        # the client runs with auth off, as the README says, only for this submission: left in
        # the test process's environment, it broke a later test's local Ray, whose driver had
        # read the token mode at an earlier ray.init (its actors died before they ran)
        with pytest.MonkeyPatch.context() as env:
            env.setenv("RAY_AUTH_MODE", "disabled")
            return self._submit(entrypoint, timeout)

    def _submit(self, entrypoint: list[str], timeout: float) -> tuple[str, str]:
        from ray.job_submission import JobStatus, JobSubmissionClient

        client = JobSubmissionClient(f"http://127.0.0.1:{self.dash}")
        end = time.monotonic() + min(timeout, 180)
        while True:  # a head just started may have no job agent yet ("No available agent")
            try:
                job = client.submit_job(entrypoint=" ".join(entrypoint), runtime_env={
                    "working_dir": str(REPO), "env_vars": {"MKL_CBWR": "AVX2", "TOKENIZERS_PARALLELISM": "false"}})
                break
            except RuntimeError as err:
                if "No available agent" not in str(err) or time.monotonic() > end:
                    raise
                time.sleep(3)
        end = time.monotonic() + timeout
        while (status := client.get_job_status(job)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            assert time.monotonic() < end, client.get_job_logs(job)
            time.sleep(2)
        return str(status), client.get_job_logs(job)

    def stop(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in _pids_of(self.marker):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            time.sleep(3)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def test_job_outputs_survive_the_head_and_a_resubmission_resumes(tmp_path, tiny_policy_dir, tiny_head_dir):
    out = tmp_path / "job_run"
    cfg = write_config(tmp_path / "job.yaml", tiny_policy_dir, tiny_head_dir, out, run={"steps": 1, "checkpoint_every": 1})
    train = [sys.executable, "-m", "scripts.train", "--config", str(cfg)]
    head = Head(Path("/tmp") / f"rayjob13_{os.getpid()}")
    try:
        status, logs = head.submit(train)
        assert status == "SUCCEEDED", logs
        said = re.search(r"run folder: (\S+)", logs).group(1)
        relative, rlogs = head.submit(train + ["--out-dir", "runs/in_the_copy"], timeout=120)
    finally:
        head.stop()
    assert not _pids_of(head.marker)
    assert Path(said) == out
    for name in ("metrics.jsonl", "rollouts.jsonl", "config.json", "summary.md", "checkpoints/step_000001/state.json"):
        assert (out / name).is_file(), name
    assert relative == "FAILED" and "error: config field 'run.out_dir'" in rlogs and "absolute" in rlogs, rlogs

    head = Head(Path("/tmp") / f"rayjob13_{os.getpid()}_b")
    try:
        status, logs = head.submit(train + ["--steps", "2"])
    finally:
        head.stop()
    assert status == "SUCCEEDED", logs
    assert "resumed from" in logs and "step_000001" in logs, logs
    assert (out / "checkpoints" / "step_000002" / "state.json").is_file()
