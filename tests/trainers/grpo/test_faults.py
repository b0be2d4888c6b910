"""Faults through the trainer with real Ray actors on the tiny policy: an actor killed during
the weight broadcast and one killed during generation, a hung (SIGSTOPped) actor, and an
update that makes the weights non-finite."""

from __future__ import annotations

import json
import logging
import math
import os
import signal

import pytest
import torch

from rollout.ray.actor_pool import RolloutPool
from tests.trainers.conftest import write_config
from trainers.grpo.config import load_train_config


def _trainer(tmp_path, policy, head, name, **sections):
    from trainers.grpo.loop import GRPOTrainer

    sections.setdefault("run", {"steps": 3, "checkpoint_every": 0})
    sections.setdefault("rollout", {"num_actors": 2})
    path = write_config(tmp_path / f"{name}.yaml", policy, head, tmp_path / name, **sections)
    return GRPOTrainer(load_train_config(path))


def _completions_by_step(out_dir) -> dict[int, list[list[int]]]:
    steps: dict[int, list[list[int]]] = {}
    for line in (out_dir / "rollouts.jsonl").read_text().splitlines():
        rec = json.loads(line)
        steps.setdefault(rec["step"], []).append(rec["completion_ids"])
    return steps


class KillingPool(RolloutPool):
    """Kills actor 0 right after the 2nd set_weights broadcast (the one after step 1's
    optimizer step) and right after the 3rd generate dispatch (step 3's rollouts); records
    which policy version and actor process produced every shard."""

    def __init__(self, *a, **k):
        self.broadcasts = self.dispatches = 0
        self.shard_log: list[tuple[int, int, int]] = []  # (dispatch, policy version, actor pid)
        super().__init__(*a, **k)

    def _weights_dispatched(self):
        self.broadcasts += 1
        if self.broadcasts == 2:
            self.kill_actor(0)

    def _dispatched(self, shards):
        self.dispatches += 1
        if self.dispatches == 3:
            self.kill_actor(0)

    def generate(self, *a, **k):
        completions, results = super().generate(*a, **k)
        self.shard_log += [(self.dispatches, r.policy_version, r.actor_pid) for r in results]
        return completions, results


def test_actor_killed_in_set_weights_and_in_generate(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray,
                                                     monkeypatch, caplog):
    reference = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "clean")
    reference.run()
    monkeypatch.setattr("trainers.grpo.loop.RolloutPool", KillingPool)
    faulty = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "faulty")
    with caplog.at_level(logging.WARNING, logger="rollout.ray.actor_pool"):
        rows = faulty.run()
    said = [r.getMessage() for r in caplog.records if r.name == "rollout.ray.actor_pool"]
    assert [m.split(" (")[0] for m in said] == ["rollout actor 0 died during set_weights",
                                               "rollout actor 0 died during generate"], said
    pool = faulty.pool
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert pool.stats.restarts == 2 and rows[-1]["actor_restarts"] == 2.0
    # every shard came from the policy version current at its step, replacements included
    assert sorted({(d, v) for d, v, _ in pool.shard_log}) == [(1, 0), (2, 1), (3, 2)]
    pids = {d: sorted(p for dd, _, p in pool.shard_log if dd == d) for d in (1, 2, 3)}
    assert len(set(pids[1]) & set(pids[2])) == 1  # actor 0 was replaced after step 1's broadcast
    assert len(set(pids[2]) & set(pids[3])) == 1  # and again during step 3's generation
    # nothing lost, nothing duplicated: the same completions as the run without faults
    clean, got = _completions_by_step(tmp_path / "clean"), _completions_by_step(tmp_path / "faulty")
    assert got == clean and all(len(v) == 6 for v in got.values())
    for (name, a), b in zip(reference.policy.state_dict().items(), faulty.policy.state_dict().values()):
        assert torch.equal(a, b), name


@pytest.mark.slow  # waits out a 30 s timeout (a healthy shard takes seconds on a loaded 2-core machine)
def test_hung_actor_is_replaced_after_the_timeout(tiny_policy_dir, tiny_head_dir, local_ray):
    from rollout.ray.actor import WorkerSpec
    from rollout.models import TargetConfig
    from rollout.params import SamplingParams, SpecConfig, VerifierConfig

    spec = WorkerSpec(TargetConfig(path=str(tiny_policy_dir)), str(tiny_head_dir), SamplingParams(max_new_tokens=16),
                      SpecConfig(mode="chain", num_draft_tokens=3), VerifierConfig("lossless"), threads=1)

    stopped = []

    class StoppingPool(RolloutPool):
        victim = None  # pid of the actor to stop once its shard is submitted

        def _dispatched(self, shards):
            if self.victim is not None:
                os.kill(self.victim, signal.SIGSTOP)  # a hung actor: alive, never answers
                stopped.append(self.victim)
                self.victim = None

    pool = StoppingPool(spec, 2, num_cpus_per_actor=1, max_restarts=2, timeout_s=30.0)
    prompts = [[1 + i, 20 + i, 300 + i] for i in range(4)]
    ids = [f"r{i}" for i in range(4)]
    try:
        reference, _ = pool.generate(ids, prompts, seed=5)
        pool.victim, _ = local_ray.get(pool.actors[1].ping.remote())
        batch, _ = pool.generate(ids, prompts, seed=5)
    finally:
        pool.shutdown()
        for pid in stopped:  # the process this test stopped, whatever Ray did with it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert pool.stats.restarts == 1
    assert batch.completion_lists() == reference.completion_lists()


def test_non_finite_update_is_never_broadcast_or_saved(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray):
    from trainers.grpo.guards import NonFiniteError

    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "inf", run={"steps": 2, "checkpoint_every": 1},
                       rollout={"num_actors": 1})
    for group in trainer.optimizer.param_groups:  # what `optim.lr: .inf` did before the validator refused it
        group["lr"] = math.inf
    with pytest.raises(NonFiniteError, match="step 1: updated weights is not finite"):
        trainer.run()
    assert trainer.pool.version == 0  # the broken weights never left the trainer
    out = tmp_path / "inf"
    assert not list(out.glob("checkpoints/step_*"))  # no checkpoint, not even a .tmp one
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
