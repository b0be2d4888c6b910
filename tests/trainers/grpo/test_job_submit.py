"""`ray job submit` as the README and docs/cluster.md show it keeps the run, with token
authentication on (slow: starts its own Ray head).

A head is started with its own port, temp folder and token (``RAY_AUTH_MODE=token``,
``RAY_AUTH_TOKEN_PATH``), a client without the token is refused, and a tiny training job is
submitted with the ``ray job submit`` command line (the token from ``RAY_AUTH_TOKEN_PATH`` on the
client side; the job itself reads the head's) with ``--working-dir`` and an absolute out_dir; the
head is stopped (only the processes of that temp folder, never a bare ``ray stop``, which would stop
other Ray instances on the machine), and the outputs are where the job said. A second head resumes
from them while the same command submitted twice at once is refused for one of the two (one writer
per run folder), and a relative out_dir is refused inside the job's temporary working-directory
copy."""

from __future__ import annotations

import json
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
RAY_BIN = str(Path(sys.executable).parent / "ray")
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
        import secrets

        self.temp_dir, self.dash = temp_dir, _free_port()
        self.marker = f"HONEST_ROLLOUTS_TEST_HEAD={temp_dir.name}"
        self.token = secrets.token_hex(32)  # what `ray get-auth-token --generate` writes to ~/.ray/auth_token
        self.token_file = Path(f"{temp_dir}.token")
        self.token_file.write_text(self.token)
        self.token_file.chmod(0o600)
        self.auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(self.token_file)}
        self.env = dict(_without_auth(os.environ), **self.auth, MKL_CBWR="AVX2", TOKENIZERS_PARALLELISM="false",
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

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dash}"

    def _start(self) -> subprocess.CompletedProcess:
        # every port named: the defaults (e.g. the job agent's 52365) may belong to another Ray here
        ports = [f"--{name}={_free_port()}" for name in (
            "port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "metrics-export-port",
            "runtime-env-agent-port", "ray-client-server-port", "node-manager-port", "object-manager-port")]
        return subprocess.run([RAY_BIN, "start", "--head", *ports, f"--dashboard-port={self.dash}",
                               "--include-dashboard=true", "--dashboard-host=127.0.0.1", "--num-cpus=2",
                               f"--temp-dir={self.temp_dir}", "--disable-usage-stats"],
                              env=self.env, capture_output=True, text=True, timeout=180)

    def cli(self, *args: str, auth: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
        """``ray <args>`` as a client on this machine: with ``auth`` (default: the token) in its environment."""
        env = dict(_without_auth(os.environ), **(self.auth if auth is None else auth))
        return subprocess.run([RAY_BIN, *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)

    def client(self):
        """A Jobs client holding the token (its Authorization header), for what the CLI does not wait on."""
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.address, headers={"Authorization": f"Bearer {self.token}"})

    def submit(self, entrypoint: list[str], timeout: float = 600, wait: bool = True) -> tuple[str, str]:
        """``ray job submit --address ... --working-dir <repo> -- <entrypoint>`` as the docs show it;
        returns the job's final status and logs (``wait=False``: its id and the CLI's output)."""
        runtime_env = json.dumps({"env_vars": {"MKL_CBWR": "AVX2", "TOKENIZERS_PARALLELISM": "false"}})
        args = ["job", "submit", "--address", self.address, "--working-dir", str(REPO),
                "--runtime-env-json", runtime_env, *([] if wait else ["--no-wait"]), "--", *entrypoint]
        end = time.monotonic() + 180
        while True:  # a head just started may have no job agent yet ("No available agent")
            done = self.cli(*args, timeout=timeout + 120)
            said = done.stdout + done.stderr
            if "No available agent" not in said or time.monotonic() > end:
                break
            time.sleep(3)
        found = re.search(r"raysubmit_\w+", said)
        assert found, said
        if not wait:
            return found.group(0), said
        return self.wait(found.group(0), timeout)

    def wait(self, job: str, timeout: float = 600) -> tuple[str, str]:
        from ray.job_submission import JobStatus

        client = self.client()
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
        self.token_file.unlink(missing_ok=True)


def _without_auth(env) -> dict:
    """``env`` without Ray's authentication settings (the test process's own local Ray may have set
    RAY_AUTH_MODE)."""
    return {k: v for k, v in env.items() if not k.startswith("RAY_AUTH_")}


def test_job_outputs_survive_the_head_and_a_resubmission_resumes(tmp_path, tiny_policy_dir, tiny_head_dir):
    out = tmp_path / "job_run"
    cfg = write_config(tmp_path / "job.yaml", tiny_policy_dir, tiny_head_dir, out, run={"steps": 1, "checkpoint_every": 1})
    train = [sys.executable, "-m", "scripts.train", "--config", str(cfg)]
    head = Head(Path("/tmp") / f"rayjob13_{os.getpid()}")
    try:
        # authentication is on: a client without the token, or with another, is refused
        bare = head.cli("job", "list", "--address", head.address, auth={})
        wrong = head.cli("job", "list", "--address", head.address, auth={"RAY_AUTH_MODE": "token",
                                                                        "RAY_AUTH_TOKEN": "0" * 64})
        status, logs = head.submit(train)
        said = re.search(r"run folder: (\S+)", logs).group(1)
        relative, rlogs = head.submit(train + ["--out-dir", "runs/in_the_copy"], timeout=120)
    finally:
        head.stop()
    assert bare.returncode != 0 and "Missing authentication token" in bare.stdout + bare.stderr, bare
    assert wrong.returncode != 0 and "Invalid authentication token" in wrong.stdout + wrong.stderr, wrong
    assert status == "SUCCEEDED", logs
    assert not _pids_of(head.marker)
    assert Path(said) == out
    for name in ("metrics.jsonl", "rollouts.jsonl", "config.json", "summary.md", "checkpoints/step_000001/state.json"):
        assert (out / name).is_file(), name
    assert relative == "FAILED" and "error: config field 'run.out_dir'" in rlogs and "absolute" in rlogs, rlogs

    head = Head(Path("/tmp") / f"rayjob13_{os.getpid()}_b")
    try:  # the same command twice at once: one trains on, the other is refused naming it
        jobs = [head.submit(train + ["--steps", "2"], wait=False)[0] for _ in range(2)]
        (s1, logs1), (s2, logs2) = (head.wait(job) for job in jobs)
    finally:
        head.stop()
    ended = {s1: logs1, s2: logs2}
    assert sorted(ended) == ["FAILED", "SUCCEEDED"], (logs1, logs2)
    assert "resumed from" in ended["SUCCEEDED"] and "step_000001" in ended["SUCCEEDED"], ended["SUCCEEDED"]
    refused = ended["FAILED"]
    assert f"error: run folder {out} is in use: scripts.train (pid" in refused, refused
    assert (out / "checkpoints" / "step_000002" / "state.json").is_file() and not (out / ".lock").exists()
