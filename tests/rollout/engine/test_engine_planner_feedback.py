"""What the engine tells the planner of ``max_batch: auto`` (``RoundPlanner.observe``): each
round's choice, and whether its draft caught up on skipped pairs (the call's first draft, and
the first draft after plain rounds); the planner keeps catch-ups out of the typical draft cost.
And what it tells ``choose``: the largest token budget a live row has left."""

from __future__ import annotations

import pytest
from test_engine_utils import PROMPTS, single_thread, tiny_target, trained_head  # noqa: F401

from rollout.engine.engine import Engine
from rollout.engine.planner import RoundPlanner
from rollout.params import SamplingParams, SpecConfig


@pytest.fixture(scope="module")
def models(single_thread):
    target = tiny_target()
    return target, trained_head(target, draft_vocab=48)


def test_the_planner_is_told_which_drafts_caught_up(models, monkeypatch):
    target, head = models
    script = [2, 2, 0, 0, 1, 3, 0, 2, 1, 0, 0, 0, 3, 3]  # draft lengths (0: a plain round), then cycled
    chosen, seen, remaining_ = [], [], []

    def choose(self, b, remaining=None):
        k = script[len(chosen) % len(script)]
        chosen.append(k)
        remaining_.append(remaining)
        return k

    def observe(self, b, k, round_s, draft_s, emitted, catch_up=False):
        seen.append((k, catch_up, list(emitted)))

    monkeypatch.setattr(RoundPlanner, "choose", choose)
    monkeypatch.setattr(RoundPlanner, "observe", observe)
    spec = SpecConfig(mode="chain", num_draft_tokens=3, max_batch="auto", adaptive_k=True)
    res = Engine(target, head, num_threads=1).generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=20),
                                                      spec, seed=4)
    assert [k for k, _, _ in seen] == chosen and len(chosen) == res.timings.rounds
    for i, (k, catch_up, emitted) in enumerate(seen):
        if k:  # a draft catches up when the round before it did not draft (or it is the call's first)
            assert catch_up == (i == 0 or chosen[i - 1] == 0), (i, chosen[: i + 1])
            assert all(1 <= e <= k + 1 for e in emitted)
        else:
            assert emitted == [1] * len(emitted)
    assert res.timings.plain_rounds == chosen.count(0)
    # before round i the longest-running live row has 20 tokens less what the rows have emitted
    assert remaining_[0] == 20 - 1  # the prefill emitted one token per row
    assert all(0 < r <= 20 for r in remaining_) and remaining_ == sorted(remaining_, reverse=True)
