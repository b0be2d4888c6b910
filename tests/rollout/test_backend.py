"""The rollout interface: HFBackend satisfies RolloutBackend, and the RolloutBatch it returns
keeps its contract field by field (shapes, right padding, masks, per-token values, policy
version, timings), also after the pool's join (cat + select)."""

from __future__ import annotations

import pytest
import torch

from rollout.backend import BACKENDS, RolloutBackend, WorkerSpec, build_backend
from rollout.engine.backend import HFBackend
from rollout.models import TargetConfig
from rollout.outputs import RolloutBatch
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from verifiers import TokenKind

PROMPTS = [[1, 20, 300], [5, 6], [7, 8, 9, 10, 11], [42]]
PAD = 2  # not 0: padding must come from pad_id


@pytest.fixture(scope="module")
def backend(tiny_policy_dir, tiny_head_dir) -> HFBackend:
    spec = WorkerSpec(TargetConfig(path=str(tiny_policy_dir)), str(tiny_head_dir), SamplingParams(),
                      SpecConfig(mode="chain", num_draft_tokens=3), VerifierConfig("overshoot", {"lenience": 0.3}),
                      threads=2)
    b = build_backend(spec)
    b.pad_id = PAD
    return b


@pytest.fixture(scope="module")
def batch(backend) -> RolloutBatch:
    backend.set_weights(None, 7)
    return backend.generate(PROMPTS, sampling=SamplingParams(max_new_tokens=10, stop_token_ids=(3,)),
                            spec=SpecConfig(mode="chain", num_draft_tokens=3),
                            verifier=VerifierConfig("overshoot", {"lenience": 0.3}), seed=11)


def test_hf_backend_is_a_rollout_backend(backend):
    assert isinstance(backend, RolloutBackend) and backend.name == "hf"
    assert set(BACKENDS) == {"hf", "vllm"}


def test_unknown_backend_is_refused(tiny_policy_dir):
    with pytest.raises(ValueError, match="allowed: hf, vllm"):
        WorkerSpec(TargetConfig(path=str(tiny_policy_dir)), None, SamplingParams(), SpecConfig(mode="off"),
                   VerifierConfig(), backend="sglang")


def test_prompt_ids_right_padded(batch):
    assert batch.prompt_ids.shape == (4, 5) and batch.prompt_ids.dtype == torch.long
    assert batch.prompt_lists() == PROMPTS
    assert batch.prompt_mask.tolist()[1] == [True, True, False, False, False]
    assert (batch.prompt_ids[~batch.prompt_mask] == PAD).all()


def test_completion_ids_and_mask(batch):
    n, c = batch.completion_ids.shape
    assert n == 4 and c == max(batch.completion_lengths) and c <= 10
    for row, length in zip(batch.completion_mask.tolist(), batch.completion_lengths):
        assert row == [True] * length + [False] * (c - length)  # right-padded, contiguous
    assert (batch.completion_ids[~batch.completion_mask] == PAD).all()


def test_per_token_fields_share_the_shape_and_are_zero_on_padding(batch):
    pad = ~batch.completion_mask
    for name in ("behaviour_logprobs", "target_logprobs", "kinds", "relaxed"):
        assert getattr(batch, name).shape == batch.completion_ids.shape, name
    assert batch.behaviour_logprobs.dtype == torch.float32 and batch.kinds.dtype == torch.int8
    assert (batch.behaviour_logprobs[pad] == 0).all() and (batch.target_logprobs[pad] == 0).all()
    assert (batch.kinds[pad] == -1).all() and not batch.relaxed[pad].any()


def test_log_probs_kinds_and_relaxed_flags(batch):
    valid = batch.completion_mask
    assert (batch.behaviour_logprobs[valid] <= 0).all() and (batch.target_logprobs[valid] <= 0).all()
    assert (batch.kinds[:, 0] == TokenKind.BONUS).all()  # the first token comes from the prefill's p
    assert set(batch.kinds[valid].tolist()) <= {int(k) for k in TokenKind}
    # where no relaxed branch fired the behaviour distribution may still differ (overshoot's
    # residual); a relaxed token is one the lossy rule accepted outright
    assert batch.relaxed.any()
    assert (batch.kinds[batch.relaxed] == TokenKind.ACCEPTED).all()


def test_policy_version_finish_reasons_and_timings(batch):
    assert batch.policy_version == 7
    assert len(batch.finish_reasons) == 4 and set(batch.finish_reasons) <= {"stop", "length"}
    for i, reason in enumerate(batch.finish_reasons):
        if reason == "length":
            assert batch.completion_lengths[i] == 10
        else:
            assert batch.completion_lists()[i][-1] == 3
    t = batch.timings
    assert t["tokens"] == sum(batch.completion_lengths)
    assert batch.tau == pytest.approx(t["emitted"] / t["row_rounds"]) and batch.tau > 1
    assert t["total_s"] > 0 and t["target_forwards"] >= t["rounds"] > 0


def test_cat_and_select_restore_any_order(batch):
    a, b = batch.select([0, 1]), batch.select([2, 3])
    assert a.completion_ids.shape[1] == max(batch.completion_lengths[:2])  # trimmed to its own width
    joined = RolloutBatch.cat([b, a]).select([2, 3, 0, 1])
    for name in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "behaviour_logprobs",
                 "target_logprobs", "kinds", "relaxed"):
        assert torch.equal(getattr(joined, name), getattr(batch, name)), name
    assert joined.finish_reasons == batch.finish_reasons
    assert joined.timings["tokens"] == 2 * batch.timings["tokens"]  # counters add up over the parts


def test_cat_refuses_mixed_policy_versions(batch):
    import dataclasses

    other = dataclasses.replace(batch, policy_version=8)
    with pytest.raises(ValueError, match="policy versions"):
        RolloutBatch.cat([batch, other])


def test_set_weights_loads_in_place_and_moves_the_version(backend):
    prompts = [[1, 20, 300]]
    before = backend.next_token_logits(prompts)
    state = {k: v.clone() for k, v in backend.target.model.state_dict().items()}
    perturbed = {k: v + 0.01 if v.is_floating_point() else v for k, v in state.items()}
    assert backend.set_weights(perturbed, 9) == 9 and backend.version == 9
    assert not torch.allclose(before, backend.next_token_logits(prompts), atol=1e-4)
    backend.set_weights(state, 10)
    assert torch.allclose(before, backend.next_token_logits(prompts), atol=1e-6)


def test_load_drafter_refuses_a_head_for_another_target(backend):
    from rollout.eagle3 import default_head_path

    with pytest.raises(Exception, match="(?i)hidden|mismatch"):
        backend.load_drafter(str(default_head_path()))


def test_load_drafter_drops_what_the_planner_learned(backend, tiny_head_dir):
    """``max_batch: auto`` planners learned acceptance with the old head; a new head starts afresh."""
    spec = SpecConfig(mode="chain", num_draft_tokens=2, max_batch="auto")
    sampling = SamplingParams(max_new_tokens=6)
    backend.generate(PROMPTS, sampling=sampling, spec=spec, verifier=VerifierConfig(), seed=1)
    assert backend.engine._planners
    backend.load_drafter(str(tiny_head_dir))
    assert not backend.engine._planners
