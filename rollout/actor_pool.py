"""The driver's side of the rollout actors: weight broadcast, sharding, failure recovery.

A step's requests are split into one contiguous shard per live actor. When an actor dies
mid-shard (``RayActorError``), the pool starts a replacement, gives it the current
weights and version, and re-runs the lost shard there with the shard's own seed, so the
step's rollouts are the same as without the failure. Results are keyed by request id:
the pool checks that every request comes back exactly once and from the current policy
version before returning them in request order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from rollout.actor import Shard, ShardResult, WorkerSpec, remote_actor_class
from rollout.outputs import RolloutBatch

log = logging.getLogger(__name__)


@dataclass
class PoolStats:
    restarts: int = 0
    shards: int = 0
    per_actor_tokens: dict[int, int] = field(default_factory=dict)


class RolloutPool:
    def __init__(self, spec: WorkerSpec, num_actors: int, *, num_cpus_per_actor: float = 1.0,
                 num_gpus_per_actor: float = 0.0, max_restarts: int = 2):
        import ray

        self._ray = ray
        self.spec = spec
        self.max_restarts = max_restarts
        self._cls = remote_actor_class(num_cpus_per_actor, num_gpus_per_actor)
        self.actors = [self._cls.remote(spec) for _ in range(num_actors)]
        self._weights_ref = None
        self._drafter_path: str | None = None
        self.version = 0
        self.stats = PoolStats()
        ray.get([a.ping.remote() for a in self.actors])  # surface load errors now

    # ------------------------------------------------------------------ weights
    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Broadcast weights (one object-store copy) and wait until every actor holds them."""
        self._weights_ref = self._ray.put({k: v.detach().cpu() for k, v in state_dict.items()})
        self.version = version
        got = self._ray.get([a.set_weights.remote(self._weights_ref, version) for a in self.actors])
        assert all(v == version for v in got), f"actors hold versions {got}, expected {version}"

    def load_drafter(self, path: str) -> None:
        """Every actor re-loads its EAGLE-3 head from ``path`` (replacements load it too)."""
        self._drafter_path = path
        self._ray.get([a.load_drafter.remote(path) for a in self.actors])

    def _restart(self, index: int) -> None:
        self.stats.restarts += 1
        log.warning("rollout actor %d died; starting a replacement", index)
        try:
            self._ray.kill(self.actors[index])
        except Exception:  # already gone
            pass
        actor = self._cls.remote(self.spec)
        if self._weights_ref is not None:
            self._ray.get(actor.set_weights.remote(self._weights_ref, self.version))
        if self._drafter_path is not None:
            self._ray.get(actor.load_drafter.remote(self._drafter_path))
        self.actors[index] = actor

    # ------------------------------------------------------------------ rollouts
    def make_shards(self, request_ids: list[str], prompts: list[list[int]], seed: int) -> list[Shard]:
        n, k = len(prompts), len(self.actors)
        bounds = [round(i * n / k) for i in range(k + 1)]
        return [Shard(i, tuple(request_ids[a:b]), tuple(tuple(p) for p in prompts[a:b]), seed * 1009 + i)
                for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])) if b > a]

    def generate(self, request_ids: list[str], prompts: list[list[int]], seed: int,
                 ) -> tuple[RolloutBatch, list[ShardResult]]:
        """One RolloutBatch with a row per request in request order, plus the per-shard results."""
        if len(set(request_ids)) != len(request_ids):
            raise ValueError("request ids must be unique")
        shards = self.make_shards(request_ids, prompts, seed)
        self.stats.shards += len(shards)
        pending = {self.actors[i].generate.remote(s): (i, s) for i, s in enumerate(shards)}
        self._dispatched(shards)
        results: dict[int, ShardResult] = {}
        restarts = 0
        while pending:
            done, _ = self._ray.wait(list(pending), num_returns=1)
            index, shard = pending.pop(done[0])
            try:
                res: ShardResult = self._ray.get(done[0])
            except self._ray.exceptions.RayActorError:
                restarts += 1
                if restarts > self.max_restarts:
                    raise RuntimeError(f"rollout actors died {restarts} times in one step; giving up") from None
                self._restart(index)
                pending[self.actors[index].generate.remote(shard)] = (index, shard)
                continue
            if res.policy_version != self.version:
                raise RuntimeError(f"shard {shard.shard_id} came from policy version {res.policy_version}, "
                                   f"expected {self.version}")
            results[shard.shard_id] = res
        return self._collect(request_ids, results), [results[k] for k in sorted(results)]

    def _dispatched(self, shards: list[Shard]) -> None:
        """Called once a step's shards are submitted (a seam for failure-injection tests)."""

    @staticmethod
    def _collect(request_ids: list[str], results: dict[int, ShardResult]) -> RolloutBatch:
        """The shards' rows joined in request order; a request back twice or never is an error."""
        where: dict[str, tuple[int, int]] = {}  # request id -> (index into parts, row)
        parts = [results[k] for k in sorted(results)]
        for p, res in enumerate(parts):
            if len(res.request_ids) != len(res.batch):
                raise RuntimeError(f"shard {res.shard_id}: {len(res.batch)} rows for {len(res.request_ids)} requests")
            for row, rid in enumerate(res.request_ids):
                if rid in where:
                    raise RuntimeError(f"request {rid} came back twice")
                where[rid] = (p, row)
        missing = [r for r in request_ids if r not in where]
        if missing:
            raise RuntimeError(f"{len(missing)} requests came back without a completion, e.g. {missing[0]}")
        joined = RolloutBatch.cat([res.batch for res in parts])
        offsets = [0]
        for res in parts:
            offsets.append(offsets[-1] + len(res.batch))
        return joined.select([offsets[where[r][0]] + where[r][1] for r in request_ids])

    def next_token_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Each actor's raw next-token logits [N, V] for ``prompts`` (a weight-sync check)."""
        return self._ray.get([a.next_token_logits.remote(prompts) for a in self.actors])

    def kill_actor(self, index: int) -> None:
        """Kill one actor (tests use this to simulate a node failure)."""
        self._ray.kill(self.actors[index], no_restart=True)

    def shutdown(self) -> None:
        for a in self.actors:
            try:
                self._ray.kill(a)
            except Exception:
                pass
        self.actors = []

