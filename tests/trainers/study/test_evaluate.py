"""The held-out evaluation samples the policy exactly: its records on a tiny policy, its problems
disjoint from training, and a lossy rule or speculation swapped into it fails instead of being
recorded."""

from __future__ import annotations

import pytest

from rollout.outputs import Completion, GenerationResult, Timings
from rollout.params import SpecConfig, TruncationSamplingConfig, VerifierConfig
from trainers.study import evaluate
from trainers.study.config import EvalConfig
from trainers.study.evaluate import (EvalLog, InexactEvaluationError, check_exact, due_steps, evaluate_policy,
                                     heldout_problems)
from trainers.tasks.arithmetic import make_problems

CFG = EvalConfig(every=2, difficulties=(1, 2), problems_per_difficulty=3, temperatures=(0.0, 1.0), seed=1,
                 batch_size=4)


@pytest.fixture(scope="module")
def policy(tiny_policy_dir, tiny_head_dir):
    from rollout.eagle3 import load_eagle3
    from rollout.engine.engine import Engine
    from rollout.models import TargetConfig, load_target

    target, tokenizer = load_target(TargetConfig(path=str(tiny_policy_dir)))
    head = load_eagle3(str(tiny_head_dir), target)
    return Engine(target, None, num_threads=1), Engine(target, head, num_threads=1), tokenizer


def test_records_of_an_exact_evaluation(policy):
    engine, _, tokenizer = policy
    problems = heldout_problems(CFG)
    recs = evaluate_policy(engine, tokenizer, problems, CFG, step=4, max_new_tokens=6)
    assert [r["temperature"] for r in recs] == [0.0, 1.0] and {r["step"] for r in recs} == {4}
    for r in recs:
        assert r["ids"] == [p.id for p in problems] and r["difficulty"] == [1, 1, 1, 2, 2, 2]
        assert len(r["correct"]) == 6 and set(r["correct"]) <= {0, 1} and all(1 <= n <= 6 for n in r["length"])
        assert r["accuracy"] == sum(r["correct"]) / 6
    again = evaluate_policy(engine, tokenizer, problems, CFG, step=4, max_new_tokens=6)
    assert [r["digest"] for r in again] == [r["digest"] for r in recs]  # the same draws every time
    assert recs[0]["key"] != recs[1]["key"]


def test_heldout_problems_are_never_training_problems():
    problems = heldout_problems(EvalConfig(difficulties=(1, 2, 3), problems_per_difficulty=40, seed=1))
    assert {p.split for p in problems} == {"heldout"} and len({p.id for p in problems}) == 120
    train = {p.id for d in (1, 2, 3) for s in range(20) for p in make_problems(8, d, "train", seed=s)}
    assert not train & {p.id for p in problems}


@pytest.mark.parametrize("swap", ["truncation sampling", "overshoot chain"])
def test_a_lossy_sampler_swapped_into_the_evaluation_fails(policy, monkeypatch, swap):
    engine, with_head, tokenizer = policy
    if swap == "truncation sampling":  # a lossy rule in plain decoding: P = p restricted to A
        monkeypatch.setattr(evaluate, "EXACT_VERIFIER", TruncationSamplingConfig("min_p", {"p_base": 0.3}))
    else:  # speculation under a lossy verifier: relaxed tokens
        monkeypatch.setattr(evaluate, "EXACT_SPEC", SpecConfig(mode="chain", num_draft_tokens=3))
        monkeypatch.setattr(evaluate, "EXACT_VERIFIER", VerifierConfig("overshoot", {"lenience": 0.1}))
        engine = with_head
    one_temp = EvalConfig(difficulties=(1,), problems_per_difficulty=4, temperatures=(1.0,), seed=1, batch_size=4)
    with pytest.raises(InexactEvaluationError):
        evaluate_policy(engine, tokenizer, heldout_problems(one_temp), one_temp, step=0, max_new_tokens=12)


def _result(behaviour, target, relaxed):
    c = Completion([1], [5] * len(behaviour), behaviour, target, [2] * len(behaviour), relaxed, [1] * len(behaviour),
                   "length")
    return GenerationResult([c], Timings())


def test_check_exact_refuses_relaxed_tokens_and_behaviour_off_target():
    check_exact(_result([-1.0, -2.0], [-1.0, -2.0], [False, False]))
    with pytest.raises(InexactEvaluationError, match="relaxed"):
        check_exact(_result([-1.0, -2.0], [-1.0, -2.0], [False, True]))
    with pytest.raises(InexactEvaluationError, match="token 1"):
        check_exact(_result([-1.0, -1.5], [-1.0, -2.0], [False, False]))


def test_due_steps_and_the_log(tmp_path):
    assert due_steps(6, 3) == [0, 3, 6] and due_steps(7, 3) == [0, 3, 6, 7] and due_steps(5, 0) == [0, 5]
    log = EvalLog(tmp_path)
    log.append([{"step": s, "key": k} for s in (0, 1, 2) for k in ("a", "b")] + [{"step": 3, "key": "a"}])
    assert log.done_steps({"a", "b"}) == {0, 1, 2} and log.done_steps({"a"}) == {0, 1, 2, 3}
    log.truncate_after(1)
    assert {r["step"] for r in log.records()} == {0, 1}
