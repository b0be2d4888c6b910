"""Memory soak (slow): 50 engine calls and 20 training steps on the tiny policy; the resident
set size after warm-up stays flat.

Bound: after the warm-up (10 engine calls; 5 training steps) the RSS may rise by at most
GROWTH_MB above its warm level, in the driver and in every rollout actor. A leak of one
batch's logits per call ([8, 4, 49152] float32 = 6 MB) or of one policy copy per step
(~14 MB for the tiny policy's fp32 state) exceeds it within the run."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from tests.trainers.conftest import write_config

pytestmark = pytest.mark.slow
GROWTH_MB = 30.0


def rss_mb(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _growth(series: list[float], warm: int) -> float:
    return max(series[warm:]) - series[warm - 1]


def test_fifty_engine_calls_keep_rss_flat(tiny_policy_dir, tiny_head_dir):
    from rollout.eagle3 import load_eagle3
    from rollout.engine.engine import Engine
    from rollout.models import TargetConfig, load_target
    from rollout.params import SamplingParams, SpecConfig, VerifierConfig

    target, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    engine = Engine(target, load_eagle3(tiny_head_dir, target), num_threads=1)
    prompts = [[1 + i, 20 + i, 300 + i, 4000 + i] for i in range(8)]
    series = []
    for call in range(50):
        engine.generate(prompts, sampling=SamplingParams(max_new_tokens=32), spec=SpecConfig(mode="chain", num_draft_tokens=3),
                        verifier=VerifierConfig("mars", {"theta": 0.5}), seed=call)
        gc.collect()
        series.append(rss_mb())
    print(f"engine RSS MB: warm {series[9]:.1f}, last {series[-1]:.1f}, growth {_growth(series, 10):.1f}")
    assert _growth(series, 10) < GROWTH_MB, [round(x, 1) for x in series]


def test_twenty_training_steps_keep_rss_flat(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray):
    from trainers.grpo.loop import GRPOTrainer
    from trainers.grpo.config import load_train_config

    path = write_config(tmp_path / "soak.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "soak",
                        run={"steps": 20, "checkpoint_every": 5})
    trainer = GRPOTrainer(load_train_config(path))
    trainer.start()
    driver, actors = [], []
    try:
        pids = [local_ray.get(a.ping.remote())[0] for a in trainer.pool.actors]
        for step in range(20):
            trainer.logger.log(step + 1, trainer.step(step))
            if (step + 1) % 5 == 0:
                trainer.save(step + 1)
            gc.collect()
            driver.append(rss_mb())
            actors.append([rss_mb(p) for p in pids])
    finally:
        trainer.logger.close()
        trainer.pool.shutdown()
    print(f"driver RSS MB: warm {driver[4]:.1f}, last {driver[-1]:.1f}, growth {_growth(driver, 5):.1f}")
    assert _growth(driver, 5) < GROWTH_MB, [round(x, 1) for x in driver]
    for i in range(len(pids)):
        series = [row[i] for row in actors]
        print(f"actor {i} RSS MB: warm {series[4]:.1f}, last {series[-1]:.1f}, growth {_growth(series, 5):.1f}")
        assert _growth(series, 5) < GROWTH_MB, [round(x, 1) for x in series]
