"""The rollout actor: a thin Ray wrapper around the speculative engine.

Vocabulary:
- **shard**: the part of a step's rollout requests handed to one actor. It carries the
  request ids (``"<step>/<prompt>/<sample>"``), the prompt token ids and a seed derived
  from the step and the shard index, so a shard re-run on another actor (after a failure)
  gives the same completions.
- **policy version**: the number of optimizer steps behind the weights an actor holds.
  Every result is tagged with the version that produced it; the driver refuses stale ones.

:class:`RolloutWorker` is plain Python (tested without Ray); :func:`remote_actor_class`
returns the Ray actor class built from it.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from rollout.models import TargetConfig, load_target
from rollout.outputs import Completion, Timings
from rollout.params import SamplingParams, SpecConfig, VerifierConfig


@dataclass(frozen=True)
class WorkerSpec:
    """Everything an actor needs to build its engine (picklable, validated configs)."""

    target: TargetConfig
    drafter_path: str | None
    sampling: SamplingParams
    spec: SpecConfig
    verifier: VerifierConfig
    threads: int = 2
    device: str = "cpu"


@dataclass(frozen=True)
class Shard:
    shard_id: int
    request_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    seed: int

    def __post_init__(self) -> None:
        if len(self.request_ids) != len(self.prompts):
            raise ValueError(f"shard {self.shard_id}: {len(self.request_ids)} ids for {len(self.prompts)} prompts")


@dataclass
class ShardResult:
    shard_id: int
    request_ids: tuple[str, ...]
    completions: list[Completion]
    timings: Timings
    policy_version: int
    actor_pid: int


class RolloutWorker:
    """Holds one target (the policy copy) and its EAGLE-3 head; generates shards."""

    def __init__(self, spec: WorkerSpec):
        from rollout.engine import Engine  # the engine imports models lazily too

        torch.set_num_threads(spec.threads)
        self.spec = spec
        self.target, _ = load_target(spec.target)
        self.target.to(spec.device)
        self.head = None
        if spec.drafter_path is not None and spec.spec.mode != "off":
            from rollout.eagle3 import load_eagle3

            self.head = load_eagle3(spec.drafter_path, self.target).to(spec.device)
        self.engine = Engine(self.target, self.head, num_threads=spec.threads)
        self.version = 0

    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> int:
        """Load new policy weights in place; returns the version now held."""
        self.target.model.load_state_dict(state_dict)
        self.version = int(version)
        return self.version

    def generate(self, shard: Shard) -> ShardResult:
        result = self.engine.generate(
            [list(p) for p in shard.prompts],
            sampling=self.spec.sampling,
            spec=self.spec.spec,
            verifier=self.spec.verifier,
            seed=shard.seed,
        )
        return ShardResult(shard.shard_id, shard.request_ids, result.completions, result.timings,
                           self.version, os.getpid())

    def ping(self) -> tuple[int, float]:
        return os.getpid(), time.time()


def remote_actor_class(num_cpus: float, num_gpus: float = 0.0):
    """The Ray actor class for RolloutWorker (restarts are the pool's job, not Ray's)."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)(RolloutWorker)
