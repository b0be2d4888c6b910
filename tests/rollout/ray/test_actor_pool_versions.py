"""The pool's policy versions and shard seeds on the scripted stand-in for Ray
(``test_actor_pool_faults``): a shard from another version is refused, a replacement that does
not hold the current version is refused, and every shard of a step has its own seed (a group
of identical prompts split over actors must not sample alike)."""

from __future__ import annotations

import pytest
from test_actor_pool_faults import EX, fake_pool


def test_every_shard_has_its_own_seed_and_steps_differ():
    pool = fake_pool(3, {})
    ids, prompts = [f"0/{i}/0" for i in range(7)], [[1, 2]] * 7
    shards = pool.make_shards(ids, prompts, seed=5)
    assert [r for s in shards for r in s.request_ids] == ids
    assert len({s.seed for s in shards}) == len(shards) == 3
    later = pool.make_shards(ids, prompts, seed=6)
    assert not {s.seed for s in shards} & {s.seed for s in later}


def test_a_shard_from_another_policy_version_is_refused():
    pool = fake_pool(2, {})
    pool.set_weights({}, 3)
    pool.actors[1].version = 2  # an actor that missed the sync
    with pytest.raises(RuntimeError, match="policy version 2, expected 3"):
        pool.generate(["0/0/0", "0/1/0"], [[1], [2]], seed=0)


def test_a_replacement_that_does_not_hold_the_current_version_is_refused():
    # actor 0 dies in generate; its replacement (the third actor made) answers set_weights with 7
    pool = fake_pool(2, {(0, "generate", 1): EX.ActorDiedError(), (2, "set_weights", 1): 7})
    pool.set_weights({}, 3)
    with pytest.raises(RuntimeError, match="replacement actor 0 holds version 7, expected 3"):
        pool.generate(["0/0/0", "0/1/0"], [[1], [2]], seed=0)
