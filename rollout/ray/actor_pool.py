"""The driver's side of the rollout actors: weight broadcast, sharding, failure recovery.

A step's requests are split into one contiguous shard per live actor. When an actor dies
mid-shard or mid-broadcast (of weights or of the EAGLE-3 head; killed, crashed, out of memory,
its node gone: see ``is_actor_death``) or does not answer within ``timeout_s`` (hung), the pool
starts a replacement, gives it the current weights, version and head, and re-runs the lost
shard there with the shard's own seed, so the step's rollouts are the same as without the
failure. Results are keyed by request id: the pool checks that every request comes back
exactly once and from the current policy version before returning them in request order.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from rollout.outputs import RolloutBatch
from rollout.ray.actor import Shard, ShardResult, WorkerSpec, read_head_files, remote_actor_class

log = logging.getLogger(__name__)


@dataclass
class PoolStats:
    restarts: int = 0
    shards: int = 0
    per_actor_tokens: dict[int, int] = field(default_factory=dict)


class RolloutPool:
    def __init__(self, spec: WorkerSpec, num_actors: int, *, num_cpus_per_actor: float = 1.0,
                 num_gpus_per_actor: float = 0.0, max_restarts: int = 2, timeout_s: float = 1800.0):
        import ray

        self._ray = ray
        self.spec = spec
        self.max_restarts = max_restarts
        self.timeout_s = timeout_s
        self._cls = remote_actor_class(num_cpus_per_actor, num_gpus_per_actor)
        # the head the actors draft with, as its folder's files in the object store: read (and
        # checked, naming the folder) here, so actors on other nodes need neither the spec's
        # folder nor a later load_drafter's; the origin is named in the actors' load errors
        self._drafter_ref = ray.put(read_head_files(spec.drafter_path)) if spec.drafter_path else None
        self._drafter_origin = str(spec.drafter_path) if spec.drafter_path else None
        self.actors = [self._cls.remote(spec, self._drafter_ref, self._drafter_origin) for _ in range(num_actors)]
        self._weights_ref = None
        self.version = 0
        self.stats = PoolStats()
        ray.get([a.ping.remote() for a in self.actors])  # surface load errors now

    # ------------------------------------------------------------------ weights
    def set_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Broadcast weights (one object-store copy) and wait until every actor holds them;
        an actor that dies or hangs meanwhile is replaced (the replacement gets these weights)."""
        self._weights_ref = self._ray.put({k: v.detach().cpu() for k, v in state_dict.items()})
        self.version = version
        pending = {a.set_weights.remote(self._weights_ref, version): i for i, a in enumerate(self.actors)}
        self._weights_dispatched()
        for index, got in self._wait_all(pending, "set_weights").items():
            if got != version:
                raise RuntimeError(f"actor {index} holds version {got}, expected {version}")

    def _weights_dispatched(self) -> None:
        """Called once set_weights calls are submitted (a seam for failure-injection tests)."""

    def _wait_all(self, pending: dict, what: str) -> dict:
        """Wait for one ``what`` call per actor (``pending``: its ref -> the actor's index). An
        actor that dies or does not answer within ``timeout_s`` is replaced and its call not
        repeated: a replacement starts with the current weights, version and head. An error
        raised by the actor's own code is raised. Returns index -> result for the actors that
        answered."""
        results, deaths = {}, 0
        while pending:
            done = wait_one(self._ray, list(pending), self.timeout_s)
            if done is None:  # every actor still pending is hung
                for index in pending.values():
                    deaths = self._replace(index, deaths, f"did not finish {what} in {self.timeout_s:g} s")
                pending.clear()
                continue
            index = pending.pop(done)
            try:
                results[index] = self._ray.get(done)
            except Exception as err:
                if not is_actor_death(self._ray, err):
                    raise
                deaths = self._replace(index, deaths, f"died during {what} ({type(err).__name__})")
        return results

    def _replace(self, index: int, deaths: int, why: str) -> int:
        """Count one actor death within the current call and replace the actor (a replacement
        that dies or hangs while loading counts as another); returns the count."""
        while True:
            deaths += 1
            if deaths > self.max_restarts:
                raise RuntimeError(f"rollout actors died or hung {deaths} times in one call "
                                   f"(max_restarts {self.max_restarts}); last: actor {index} {why}")
            log.warning("rollout actor %d %s; starting a replacement", index, why)
            try:
                self._restart(index)
                return deaths
            except self._ray.exceptions.GetTimeoutError:
                why = f"(replacement) did not load in {self.timeout_s:g} s"
            except Exception as err:
                if not is_actor_death(self._ray, err):
                    raise
                why = f"(replacement) died while loading ({type(err).__name__})"

    def load_drafter(self, path: str) -> None:
        """Every actor re-loads its EAGLE-3 head from the folder ``path`` on this machine: its
        files go through the object store (one copy; ``read_head_files``, which first refuses a
        folder that cannot be a head, naming ``path``), so actors on other nodes need no shared
        storage; replacements start with them. An actor that dies or hangs meanwhile is
        replaced, as in ``set_weights``. An error in an actor's own load (a head for another
        target, named by ``path``) is raised, and later replacements keep the previous head."""
        files = read_head_files(path)
        previous = self._drafter_ref, self._drafter_origin
        self._drafter_ref, self._drafter_origin = self._ray.put(files), str(path)
        try:
            self._wait_all({a.load_drafter_files.remote(self._drafter_ref, self._drafter_origin): i
                            for i, a in enumerate(self.actors)}, "load_drafter")
        except BaseException:
            self._drafter_ref, self._drafter_origin = previous
            raise

    def _restart(self, index: int) -> None:
        """A fresh actor in slot ``index`` holding the current weights, version and head."""
        self.stats.restarts += 1
        try:
            self._ray.kill(self.actors[index], no_restart=True)
        except Exception:  # already gone
            pass
        actor = self._cls.remote(self.spec, self._drafter_ref, self._drafter_origin)  # with the current head
        try:
            if self._weights_ref is not None:
                got = self._ray.get(actor.set_weights.remote(self._weights_ref, self.version), timeout=self.timeout_s)
                if got != self.version:
                    raise RuntimeError(f"replacement actor {index} holds version {got}, expected {self.version}")
        except BaseException:
            try:
                self._ray.kill(actor, no_restart=True)  # a failed replacement is not left running
            except Exception:
                pass
            raise
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
        deaths = 0
        while pending:
            done = wait_one(self._ray, list(pending), self.timeout_s)
            if done is None:  # every shard still pending is on a hung actor: re-run them elsewhere
                lost = list(pending.values())
                pending.clear()
                for index, shard in lost:
                    deaths = self._replace(index, deaths, f"did not finish its shard in {self.timeout_s:g} s")
                    pending[self.actors[index].generate.remote(shard)] = (index, shard)
                continue
            index, shard = pending.pop(done)
            try:
                res: ShardResult = self._ray.get(done)
            except Exception as err:
                if not is_actor_death(self._ray, err):
                    raise
                deaths = self._replace(index, deaths, f"died during generate ({type(err).__name__})")
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


def is_actor_death(ray, err: BaseException) -> bool:
    """Whether ``err`` from ``ray.get`` means the actor is gone (killed, crashed, its node or
    raylet died, Ray's memory monitor killed it, its result object was lost), as opposed to
    an exception raised by the actor's own code (a bug: re-raised, not retried)."""
    ex = ray.exceptions
    deaths = (ex.RayActorError, ex.WorkerCrashedError, ex.NodeDiedError, ex.LocalRayletDiedError,
              ex.OutOfMemoryError, ex.ObjectLostError)
    return isinstance(err, deaths)


def wait_one(ray, refs: list, timeout_s: float):
    """The first of ``refs`` to finish, or None when none finished within ``timeout_s``."""
    done, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
    return done[0] if done else None

