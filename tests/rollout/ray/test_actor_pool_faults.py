"""The pool's failure handling on a scripted stand-in for Ray (no Ray processes): which errors
count as an actor death, replacements in set_weights, generate and load_drafter for every death
kind (Ray's out-of-memory kill, a lost node, a crashed worker), a hung actor after the timeout,
and a bug in the actor's own code re-raised instead of retried."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import save_file

from rollout.outputs import Completion, RolloutBatch, Timings
from rollout.ray.actor import Shard, ShardResult, read_head_files
from rollout.ray.actor_pool import RolloutPool, is_actor_death

EX = ray.exceptions
HANG = object()  # a call that never finishes


class Ref:
    def __init__(self, result):
        self.result = result


class FakeActor:
    """Answers calls from a script: ``faults[(method, call number)] = exception or HANG``."""

    def __init__(self, pool_faults: dict, name: int, head=None, origin=None):
        self.faults, self.name, self.version, self.calls = pool_faults, name, 0, {}
        self.head, self.origin = head, origin  # the head files it drafts with, and their folder
        for method in ("set_weights", "generate", "ping", "load_drafter_files"):
            setattr(self, method, types.SimpleNamespace(remote=self._caller(method)))

    def _caller(self, method):
        def call(*args):
            n = self.calls[method] = self.calls.get(method, 0) + 1
            fault = self.faults.get((self.name, method, n))
            if fault is not None:
                return Ref(fault)
            if method == "set_weights":
                self.version = args[1]
                return Ref(self.version)
            if method == "load_drafter_files":
                self.head, self.origin = args
                return Ref(None)
            if method == "generate":
                shard: Shard = args[0]
                rows = [Completion(list(p), [ord(ch) for ch in r], [0.0] * len(r), [0.0] * len(r), [2] * len(r),
                                   [False] * len(r), [len(r)], "length")
                        for r, p in zip(shard.request_ids, shard.prompts)]
                batch = RolloutBatch.from_completions(rows, Timings(), self.version)
                return Ref(ShardResult(shard.shard_id, shard.request_ids, batch, self.name))
            return Ref((self.name, 0.0))
        return call


class FakeRay:
    exceptions = EX

    def __init__(self):
        self.killed = []

    def put(self, value):
        return value

    def get(self, ref, timeout=None):
        if isinstance(ref, list):
            return [self.get(r) for r in ref]
        if ref.result is HANG:
            raise EX.GetTimeoutError("hung")
        if isinstance(ref.result, BaseException):
            raise ref.result
        return ref.result

    def wait(self, refs, num_returns=1, timeout=None):
        ready = [r for r in refs if r.result is not HANG]
        return ready[:num_returns], [r for r in refs if r not in ready[:num_returns]]

    def kill(self, actor, no_restart=True):
        self.killed.append(actor.name)


def fake_pool(n: int, faults: dict, max_restarts: int = 2) -> RolloutPool:
    pool = RolloutPool.__new__(RolloutPool)
    made = iter(range(100))
    pool._ray, pool.spec, pool.max_restarts, pool.timeout_s = FakeRay(), None, max_restarts, 5.0
    pool._cls = types.SimpleNamespace(remote=lambda spec, head=None, origin=None:
                                      FakeActor(faults, next(made), head, origin))
    pool.actors = [pool._cls.remote(None) for _ in range(n)]
    pool._weights_ref, pool._drafter_ref, pool._drafter_origin, pool.version = None, None, None, 0
    from rollout.ray.actor_pool import PoolStats

    pool.stats = PoolStats()
    return pool


def write_head(folder: Path, **config) -> Path:
    """A folder that passes the driver's head checks (``check_head_folder``): a config with the
    layer fields and safetensors weights with ``fc.weight``; ``config`` changes fields."""
    folder.mkdir(parents=True)
    cfg = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "vocab_size": 32, **config}
    (folder / "config.json").write_text(json.dumps(cfg))
    save_file({"fc.weight": torch.zeros(8, 24)}, str(folder / "model.safetensors"))
    return folder


DEATHS = {
    "killed": EX.ActorDiedError(),
    "out of memory": EX.OutOfMemoryError("the memory monitor killed the worker"),
    "node died": EX.NodeDiedError("node 10.0.0.2 died"),
    "worker crashed": EX.WorkerCrashedError(),
    "raylet died": EX.LocalRayletDiedError(),
    "hung": HANG,
}


def test_death_classification():
    for err in DEATHS.values():
        if err is not HANG:
            assert is_actor_death(ray, err), err
    bug = EX.RayTaskError("generate", "Traceback ...", ValueError("a bug"))
    for err in (ValueError("a bug"), bug, EX.GetTimeoutError("slow")):
        assert not is_actor_death(ray, err), err


@pytest.mark.parametrize("kind", list(DEATHS))
def test_set_weights_replaces_a_dead_or_hung_actor(kind):
    pool = fake_pool(2, {(1, "set_weights", 2): DEATHS[kind]})
    pool.set_weights({}, 1)
    pool.set_weights({}, 2)  # actor 1 dies (or hangs) here
    assert pool.stats.restarts == 1 and pool._ray.killed == [1]
    assert [a.name for a in pool.actors] == [0, 2] and [a.version for a in pool.actors] == [2, 2]


@pytest.mark.parametrize("kind", list(DEATHS))
def test_generate_reruns_the_lost_shard_on_a_replacement(kind):
    pool = fake_pool(2, {(0, "generate", 1): DEATHS[kind]})
    pool.set_weights({}, 3)
    ids = [f"r{i}" for i in range(4)]
    batch, results = pool.generate(ids, [[i] for i in range(4)], seed=0)
    assert batch.completion_lists() == [[ord(ch) for ch in r] for r in ids]  # each once, in request order
    assert sorted((r.shard_id, r.actor_pid, r.policy_version) for r in results) == [(0, 2, 3), (1, 1, 3)]


def test_a_replacement_that_dies_while_loading_counts_and_the_budget_ends_it():
    faults = {(1, "set_weights", 2): EX.ActorDiedError(), (2, "set_weights", 1): EX.OutOfMemoryError("oom")}
    pool = fake_pool(2, faults)
    pool.set_weights({}, 1)
    pool.set_weights({}, 2)
    assert pool.stats.restarts == 2 and [a.name for a in pool.actors] == [0, 3]
    assert set(pool._ray.killed) == {1, 2}  # the failed replacement (2) is not left running
    always = {(i, "set_weights", n): EX.NodeDiedError("gone") for i in range(1, 9) for n in (1, 2)}
    pool = fake_pool(2, always, max_restarts=2)
    with pytest.raises(RuntimeError, match="died or hung 3 times in one call"):
        pool.set_weights({}, 1)


def test_an_error_in_the_actors_own_code_is_raised_not_retried():
    bug = EX.RayTaskError("generate", "Traceback ...", ValueError("a bug"))
    pool = fake_pool(2, {(0, "generate", 1): bug})
    with pytest.raises(EX.RayTaskError):
        pool.generate(["a", "b"], [[1], [2]], seed=0)
    assert pool.stats.restarts == 0


@pytest.mark.parametrize("kind", list(DEATHS))
def test_load_drafter_replaces_a_dead_or_hung_actor_with_one_holding_the_new_head(kind, tmp_path, caplog):
    pool = fake_pool(2, {(1, "load_drafter_files", 2): DEATHS[kind]})
    pool.set_weights({}, 4)
    pool.load_drafter(str(write_head(tmp_path / "first")))
    trained = write_head(tmp_path / "trained", hidden_size=4)
    pool.load_drafter(str(trained))  # actor 1 dies (or hangs) here
    assert pool.stats.restarts == 1 and pool._ray.killed == [1]
    assert [a.name for a in pool.actors] == [0, 2] and [a.version for a in pool.actors] == [4, 4]
    for a in pool.actors:  # the replacement (2) was built with the new head, not the first
        assert a.head == read_head_files(trained) and a.origin == str(trained)
    if DEATHS[kind] is HANG:
        assert "did not finish load_drafter in 5 s" in caplog.text


def test_an_error_in_an_actors_head_load_is_raised_not_retried(tmp_path):
    """A head the actor's backend refuses (for another target) is the caller's error, and later
    replacements start with the head loaded before, not the refused one."""
    bug = EX.RayTaskError("load_drafter_files", "ValueError: head for another target", ValueError("another"))
    pool = fake_pool(2, {(1, "load_drafter_files", 2): bug})
    first = write_head(tmp_path / "first")
    pool.load_drafter(str(first))
    with pytest.raises(EX.RayTaskError, match="another target"):
        pool.load_drafter(str(write_head(tmp_path / "other", vocab_size=64)))
    assert pool.stats.restarts == 0 and pool._ray.killed == []
    assert pool._drafter_ref == read_head_files(first) and pool._drafter_origin == str(first)
