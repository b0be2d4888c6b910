"""rollout.kernels.native_draft: a speculative draft step in one C++ call gives the bits of the head's own
(fused) forward: the same logits and hidden states, and the same engine outputs."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rollout.engine.engine import Engine
from rollout.engine.runner import ModelRunner
from rollout.kernels import native_draft, native_layers, native_linear
from rollout.kernels.quantize import quantize_int8_
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from tests.models import copy_head, tiny_target

pytestmark = pytest.mark.skipif(not native_linear.available(),
                                reason="the native linear kernel needs an AVX-512 CPU and a C++ compiler")


def _spy(monkeypatch, name: str) -> list[bool]:
    """Whether each call of ``native_draft.<name>`` ran in C++ (returned outputs)."""
    runs = []
    original = getattr(native_draft, name)

    def spy(*args, **kwargs):
        out = original(*args, **kwargs)
        runs.append(out is not None)
        return out

    monkeypatch.setattr(native_draft, name, spy)
    return runs


@pytest.fixture
def native_steps(monkeypatch):
    """Whether each ``native_draft.step`` call ran in C++ (returned outputs)."""
    return _spy(monkeypatch, "step")


@pytest.fixture
def chain_calls(monkeypatch):
    """Whether each ``native_draft.chain`` call ran the chain."""
    return _spy(monkeypatch, "chain")


def _engine(target, head, **off) -> Engine:
    """An engine on the native kernel with the options ``off`` (``native_draft=False``, ...)."""
    return Engine(target, head, num_threads=2, linear="native", options=EngineOptions(**off))


def _head(target, bf16: bool | str):
    """A head with fp32 weights (False), bf16-valued ones (True, ``"panels"`` or ``"tiles"``: as the
    shipped head; packed as AMX tiles where the CPU has them and ``EngineOptions.amx`` is on, else as
    bf16 panels) or ``"int8"`` ones (rollout.kernels.quantize: int8 panels)."""
    head = copy_head(target, noise=0.3)
    if bf16 == "int8":
        quantize_int8_(head)
    elif bf16:  # bf16-valued weights: packed as bf16 panels (EngineOptions.compact_panels)
        with torch.no_grad():
            for p in head.parameters():
                p.copy_(p.bfloat16().float())
    return head


def _draft_steps(target, head, native: list[bool], tree: bool = False, options: EngineOptions = EngineOptions()):
    """A prefill, a draft root and one draft step per further entry of ``native`` (whether the C++
    call may run the root, then each step: the runner's ``options`` with ``native_draft`` so);
    returns the root's and each step's logits and hidden states. The prompts differ in length, so
    the root's pairs land in different slots per row."""
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    out = []
    with torch.inference_mode(), native_linear.routed(target, head, options=options):
        runner = ModelRunner(target, head, options=options)
        logits = runner.start(prompts, 40)
        runner.set_first_tokens(logits.argmax(-1))
        runner.options = dataclasses.replace(options, native_draft=native[0])
        root = runner.draft_root()
        out.append((root.logits.clone(), root.hidden.clone()))
        hidden = root.hidden[:, None]  # [B, 1, H]
        ids = root.logits.argmax(-1)[:, None]  # [B, 1]
        seen = 0
        for level, allowed in enumerate(native[1:], start=1):
            runner.options = dataclasses.replace(options, native_draft=allowed)
            t = 2 if tree else 1
            tokens = runner.draft_ids[ids].expand(-1, t)
            h = hidden.expand(-1, t, -1)
            visible = None
            if seen:
                visible = torch.ones(len(prompts), t, seen, dtype=torch.bool)
                visible[0, -1, 0] = False  # a query that does not see an earlier slot (a tree branch)
            step = runner.draft_step(tokens, h, level, visible)
            seen += t
            out.append((step.logits.clone(), step.hidden.clone()))
            ids, hidden = step.logits[:, -1:].argmax(-1), step.hidden[:, -1:]
        out.append(tuple(x[0].clone() for x in runner.draft_kv.kv(0, max(runner.draft_kv.host_lengths))))
    return out


@pytest.mark.parametrize("bf16", [False, "panels", "tiles", "int8"])
@pytest.mark.parametrize("tree", [False, True])
def test_draft_steps_give_the_bits_of_the_heads_forward(native_steps, bf16, tree):
    """The C++ draft steps against the head's Python forwards, bit for bit: fp32 weights, bf16-valued
    ones as compact panels and (where the CPU has AMX) as AMX tiles, and int8 ones."""
    if bf16 == "tiles" and not native_linear.amx_available():
        pytest.skip("AMX tiles cannot run here (no AMX-BF16 CPU, or HONEST_ROLLOUTS_AMX=0)")
    packing = EngineOptions(amx=bf16 == "tiles")
    target = tiny_target(seed=2)
    head = _head(target, bf16)
    own = _draft_steps(target, head, [False] * 4, tree, packing)
    packed = {False: torch.float32, "panels": torch.bfloat16, "tiles": torch.int16, "int8": torch.int8}[bf16]
    assert native_linear.panels_of(head.lm_head).dtype == packed
    assert not any(native_steps)  # (option off; after a Python step the round stays in Python)
    native_steps.clear()
    fast = _draft_steps(target, head, [True] * 4, tree, packing)
    assert native_steps == [True] * 4  # the root and three steps
    for (la, ha), (lb, hb) in zip(fast, own):  # logits and hidden states, then the committed cache
        assert torch.equal(la, lb) and torch.equal(ha, hb)


def test_a_python_step_after_native_ones_reads_their_entries_from_the_cache(native_steps):
    """The round's first steps in C++ (their keys and values in the cache), a later one from
    Python (they are read back from the cache slots): the bits of an all-Python round."""
    target = tiny_target(seed=4)
    head = _head(target, bf16=True)
    own = _draft_steps(target, head, [False] * 5)
    mixed = _draft_steps(target, head, [True, True, True, False, False])
    for (la, ha), (lb, hb) in zip(mixed, own):
        assert torch.equal(la, lb) and torch.equal(ha, hb)


def test_a_hooked_head_runs_its_own_forward(native_steps):
    target = tiny_target(seed=4)
    head = _head(target, bf16=False)
    calls = []
    handle = head.midlayer.register_forward_hook(lambda *a: calls.append(1))
    try:
        _draft_steps(target, head, [True] * 3)
    finally:
        handle.remove()
    assert not any(native_steps) and len(calls) == 3  # the root and both steps


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_engine_outputs_with_and_without_the_native_draft(native_steps, mode):
    """Every token, kind and log-prob the same (the draft's samples follow its logits)."""
    target = tiny_target()
    head = _head(target, bf16=True)
    spec = SpecConfig(mode="chain", num_draft_tokens=3) if mode == "chain" else SpecConfig(mode="tree")
    kw = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=30), spec=spec,
              verifier=VerifierConfig(name="mars", params={"theta": 0.9}), seed=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [1, 2, 3]]
    fast = _engine(target, head).generate(prompts, **kw)
    assert native_steps and all(native_steps)
    native_steps.clear()
    own = _engine(target, head, native_draft=False).generate(prompts, **kw)
    assert native_steps and not any(native_steps)
    for a, b in zip(fast.completions, own.completions):
        assert a.completion_ids == b.completion_ids and a.kinds == b.kinds and a.step_emitted == b.step_emitted
        assert a.behaviour_logprobs == b.behaviour_logprobs and a.target_logprobs == b.target_logprobs


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("temperature, drafts", [(1.0, "sampled"), (0.7, "sampled"), (0.0, "sampled"),
                                                 (0.7, "greedy")])
@pytest.mark.parametrize("weights", [True, "int8"])
def test_a_chain_in_one_call_gives_the_bits_of_its_steps(chain_calls, k, temperature, drafts, weights):
    """A chain drafted by one ``hr_draft_chain`` call, by one C++ call per step, and by the head's
    Python forwards: every token, kind and log-prob the same (the same uniforms, the same draws,
    the same logits), with a bf16-valued and an int8 head; sampled drafts, and greedy ones (T = 0,
    or ``draft_sampling: greedy``: each draft the argmax)."""
    target = tiny_target(seed=3)
    head = _head(target, weights)
    kw = dict(sampling=SamplingParams(temperature=temperature, max_new_tokens=30),
              spec=SpecConfig(mode="chain", num_draft_tokens=k, draft_sampling=drafts),
              verifier=VerifierConfig(name="lossless"), seed=5)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [1, 2, 3]]
    fused = _engine(target, head).generate(prompts, **kw)
    assert chain_calls and all(chain_calls)
    chain_calls.clear()
    steps = _engine(target, head, draft_chains=False).generate(prompts, **kw)
    assert not any(chain_calls)
    python = _engine(target, head, draft_chains=False, native_draft=False).generate(prompts, **kw)
    assert fused.timings.draft_forwards == steps.timings.draft_forwards > 0
    for a, b, c in zip(fused.completions, steps.completions, python.completions):
        assert a.completion_ids == b.completion_ids == c.completion_ids and a.kinds == b.kinds == c.kinds
        assert a.behaviour_logprobs == b.behaviour_logprobs == c.behaviour_logprobs
        assert a.target_logprobs == b.target_logprobs == c.target_logprobs


def test_trees_draft_step_by_step(chain_calls, native_steps):
    target = tiny_target()
    head = _head(target, True)
    engine = Engine(target, head, num_threads=2, linear="native")
    for temperature in [1.0, 0.0]:
        engine.generate([[1, 2, 3]], SamplingParams(temperature=temperature, max_new_tokens=12),
                        SpecConfig(mode="tree"), seed=1)
    assert not any(chain_calls) and native_steps and all(native_steps)


def test_a_greedy_chain_picks_what_torch_argmax_picks():
    """Ties go to the first maximum and a NaN wins, as ``torch.argmax`` (``sample_draft``) has it:
    root logits with tied maxima, a NaN, a NaN first, -inf everywhere but one id, all equal."""
    target = tiny_target(seed=2)
    head = _head(target, True)
    with torch.inference_mode(), native_linear.routed(target, head):
        runner = ModelRunner(target, head)
        prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9], [1]]
        runner.set_first_tokens(runner.start(prompts, 40).argmax(-1))
        root = runner.draft_root()
        logits = torch.zeros_like(root.logits)
        logits[0, [5, 9]] = 2.0
        logits[1, 3], logits[1, 7], logits[1, 11] = 5.0, float("nan"), float("nan")
        logits[2, 0] = float("nan")
        logits[3] = float("-inf")
        logits[3, 40] = -1.0
        ids, out = runner.draft_chain(logits, root.hidden, 1, 0.0, None)
    assert ids[:, 0].tolist() == logits.argmax(-1).tolist() == [5, 7, 0, 40, 0]
    assert torch.equal(out[:, 0].nan_to_num(), logits.nan_to_num())  # the root's logits, kept


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_step_costs_time_the_one_call_chain_only_where_it_runs(chain_calls, temperature):
    """``rollout.engine.timing.step_costs(chains=...)`` times each chain length as one ``hr_draft_chain``
    call (sampled, and greedy at T = 0), and leaves the cost out where the call does not run."""
    from rollout.engine.timing import step_costs

    target = tiny_target(seed=3)
    head = _head(target, True)
    costs = step_costs(_engine(target, head), [[1, 2, 3], [4, 5]], [1, 4], 2, chains=(2, 3), temperature=temperature)
    assert set(costs) == {1, 4, "draft", "chain2", "chain3"} and all(v > 0 for v in costs.values())
    assert len(chain_calls) == 6 and all(chain_calls)  # a warm-up and two timed calls per length
    steps = _engine(target, head, draft_chains=False)
    assert set(step_costs(steps, [[1, 2, 3]], [1], 1, chains=(3,), temperature=temperature)) == {1, "draft"}


# -- the kernels' float32 buffers whatever torch's default dtype ---------------------------------
def _native_round(target, head) -> list[torch.Tensor]:
    """Through ``ModelRunner`` inside ``routed``: a prefill (the target's layers in C++, their
    EAGLE-3 features kept), a draft root and a draft step (``hr_draft_layer``) and a sampled chain
    (``hr_draft_chain``); every tensor they return."""
    with torch.inference_mode(), native_linear.routed(target, head):
        runner = ModelRunner(target, head)
        logits = runner.start([[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], 40)
        feats = runner._waiting_feats.clone()
        runner.set_first_tokens(logits.argmax(-1))
        root = runner.draft_root()
        step = runner.draft_step(runner.draft_ids[root.logits.argmax(-1)][:, None], root.hidden[:, None], 1, None)
        runner.drop_speculation()
        uniforms = torch.rand(3, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
        chain = runner.draft_chain(root.logits, root.hidden, 3, 1.0, uniforms)
    return [logits, feats, root.logits, root.hidden, step.logits, step.hidden, *chain]


_OTHER_DEFAULT = textwrap.dedent("""
    import sys
    import torch
    from tests.models import copy_head, tiny_target
    sys.path.insert(0, sys.argv[2])
    from test_native_draft import _native_round
    target = tiny_target(seed=3)
    head = copy_head(target, noise=0.3)
    first = _native_round(target, head)
    torch.set_default_dtype(getattr(torch, sys.argv[1]))
    again = _native_round(target, head)
    print(all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(first, again)))
""")


def test_the_native_round_is_the_same_under_a_float64_default_dtype(native_steps, chain_calls, monkeypatch):
    """Under torch.set_default_dtype(torch.float64) (fp32 models built before), the C++ layers, draft
    steps and chain give the bits they give under float32: their float buffers are float32 whatever
    the default (they followed it once, so the features, hidden states and logits were the
    kernels' floats read back as doubles)."""
    layers = []
    original = native_layers._run
    monkeypatch.setattr(native_layers, "_run", lambda *a: layers.append(1) or original(*a))
    target = tiny_target(seed=3)
    head = copy_head(target, noise=0.3)
    first = _native_round(target, head)
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        again = _native_round(target, head)
    finally:
        torch.set_default_dtype(saved)
    assert len(layers) == 2 and native_steps == [True] * 4 and chain_calls == [True] * 2
    for a, b in zip(first, again):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_the_native_round_is_the_same_under_a_bfloat16_default_dtype():
    """The same under a bfloat16 default, in a process of its own: there a scratch buffer that
    followed the default dtype held half the bytes the kernels write (heap corruption, an abort)."""
    root = Path(__file__).parents[3]
    out = subprocess.run([sys.executable, "-c", _OTHER_DEFAULT, "bfloat16", str(Path(__file__).parent)],
                         capture_output=True, text=True, cwd=root, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "True"


def test_the_draft_kernels_refuse_a_cache_they_cannot_write():
    """A draft step and a chain over value buffers of another dtype or shape than the keys', or
    a cache of other kv heads than the head's, return None (the caller runs the head's forward):
    the kernels write and read both with the keys' strides and sizes."""
    target = tiny_target(seed=3)
    head = _head(target, False)
    cfg = head.cfg
    b, t, vd = 2, 3, cfg.draft_vocab_size
    keys = torch.zeros(b, cfg.num_key_value_heads, 8, cfg.head_dim)
    g = torch.Generator().manual_seed(0)
    tokens, hidden = torch.randint(0, 64, (b, t), generator=g), torch.randn(b, t, cfg.hidden_size, generator=g)
    mask = torch.ones(b, t, t, dtype=torch.bool)
    chain = (torch.randn(b, vd, generator=g), hidden[:, 0], t, 1.0, torch.rand(t, b, dtype=torch.float64),
             head.target_ids, torch.zeros(b, 0, dtype=torch.bool), torch.arange(1, t)[:, None].expand(t - 1, b))
    with torch.inference_mode(), native_linear.routed(target, head):
        assert native_draft.step(head, tokens, hidden, torch.arange(t).expand(b, t), mask, keys, keys.clone(), 0)
        assert native_draft.chain(head, *chain, keys, keys.clone(), 0)
        for k, v in ((keys, keys.bfloat16()), (keys, keys[:, :1].clone()), (keys, keys[:1].clone()),
                     (keys[:, :1].clone(), keys[:, :1].clone())):
            assert native_draft.step(head, tokens, hidden, torch.arange(t).expand(b, t), mask, k, v, 0) is None
            assert native_draft.chain(head, *chain, k, v, 0) is None


def test_a_chain_takes_a_strided_draft_id_map_by_its_values():
    """``draft_ids`` as a strided view: the chain gives the drafts and logits it gives with a
    contiguous copy (the kernel once read the view's storage as ``[Vd]`` contiguous)."""
    target = tiny_target(seed=3)
    head = _head(target, False)
    b, t, vd = 2, 3, head.cfg.draft_vocab_size
    g = torch.Generator().manual_seed(0)
    inputs = (torch.randn(b, vd, generator=g), torch.randn(b, head.cfg.hidden_size, generator=g), t, 1.0,
              torch.rand(t, b, dtype=torch.float64, generator=g))
    ids = head.target_ids
    strided = torch.stack([ids, ids.flip(0)], 1)[:, 0]
    assert strided.stride() == (2,) and torch.equal(strided, ids)
    runs = []
    with torch.inference_mode(), native_linear.routed(target, head):
        for id_map in (ids, strided):
            keys = torch.zeros(b, head.cfg.num_key_value_heads, 8, head.cfg.head_dim)
            runs.append(native_draft.chain(head, *inputs, id_map, torch.zeros(b, 0, dtype=torch.bool),
                                           torch.arange(1, t)[:, None].expand(t - 1, b), keys, keys.clone(), 0))
    (ids_a, out_a), (ids_b, out_b) = runs
    assert torch.equal(ids_a, ids_b) and torch.equal(out_a, out_b)
