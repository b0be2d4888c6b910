"""``scripts/research/block_gain.py``: the engine's own rounds, each scored by both verifications' expected
accepted drafts; the engine's rounds are recorded once each and its verifier is put back."""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import PROMPTS, single_thread, tiny_target, trained_head  # noqa: F401

import rollout.engine.engine as engine_module
from rollout.engine.engine import Engine
from rollout.params import SamplingParams, SpecConfig
from scripts.research.block_gain import main, measure, recorded_rounds


def test_every_round_is_scored_by_both_verifications(single_thread):
    target = tiny_target(vocab=64, seed=5)
    engine = Engine(target, trained_head(target, draft_vocab=48, seed=6), num_threads=1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12)
    verify = engine_module.verify_chain
    with recorded_rounds(sampling) as rounds:
        res = engine.generate(PROMPTS[:1], sampling, SpecConfig(mode="chain", num_draft_tokens=3), None, seed=3)
    assert engine_module.verify_chain is verify
    assert len(rounds) == res.timings.rounds - res.timings.plain_rounds > 0
    out = measure(engine, PROMPTS, 3, sampling, seed=3)
    assert out["rounds"] >= len(PROMPTS) and out["k"] == 3
    for key in ("tau_token", "tau_block"):
        assert 1 <= out[key] <= 4
    assert out["ratio"] == pytest.approx(out["tau_block"] / out["tau_token"])
    assert torch.isfinite(torch.tensor([out["tau_token"], out["tau_block"]])).all()


@pytest.mark.parametrize("argv, words", [(["--k", "0"], "chain lengths must be >= 1"),
                                         (["--k", "four"], "comma list of integers"),
                                         (["--temperature", "0"], "must be > 0")])
def test_bad_arguments_say_what_is_wrong(argv, words):
    with pytest.raises(SystemExit, match=words):
        main(argv)
