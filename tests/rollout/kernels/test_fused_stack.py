"""rollout.kernels.fused_layers.stack_forward: inside an engine call the decoder stack runs as one loop
over the fused layers: the same bits as the model's own forward around the same layers."""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

from rollout.engine.engine import Engine
from rollout.engine.kv_cache import RowKVCache
from rollout.engine.runner import ModelRunner
from rollout.kernels import fused_layers, native_layers, native_lib, native_linear
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from tests.models import copy_head, tiny_target

pytestmark = pytest.mark.skipif(not native_linear.available(),
                                reason="the native linear kernel needs an AVX-512 CPU and a C++ compiler")


def _spy_runs(monkeypatch, name: str, module=fused_layers, arg: int = 2) -> list:
    """The shapes of the hidden states (or input ids) each call of ``module.<name>`` got
    (its positional argument ``arg``)."""
    runs = []
    original = getattr(module, name)

    def spy(*args, **kwargs):
        runs.append(args[arg].shape)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return runs


def _stack(options: EngineOptions = EngineOptions()):
    """The stack kernel the engine hands the target's forwards under ``options``
    (``ModelRunner.stack_kernel``): the stack loop with the C++ layer kernel."""
    return lambda base: fused_layers.stack_forward(base, functools.partial(native_layers.run, options=options),
                                                   options)


@pytest.fixture
def stack_runs(monkeypatch):
    """Counts the stack loop's runs."""
    return _spy_runs(monkeypatch, "_run_stack", arg=3)  # (base, layers, layer_kernel, input_ids, ...)


def _cached_forward(target, ids, mask, final=True, stack=None):
    """A prefill of ``ids [B, T]`` with ``mask [B, 1, T, T]`` into a fresh cache, then a 3-token block
    after it whose middle token does not see the first (a tree-like mask); through ``stack`` (default:
    the engine's stack kernel under the default options)."""
    stack = stack or _stack()
    cfg = target.config
    b, t = ids.shape
    cache = RowKVCache(cfg.num_hidden_layers, b, cfg.num_key_value_heads, cfg.head_dim, 32, target.dtype, "cpu")
    cache.prepare(t)
    pos = torch.arange(t)[None].expand(b, t)
    first = target(ids, position_ids=pos, attention_mask=mask, cache=cache, final=final, stack=stack)
    cache.commit(torch.full((b,), t), [t] * b)
    _, length = cache.prepare(3)
    block = torch.ones(3, length, dtype=torch.bool).tril(t)
    block[1, t] = False
    second = target(ids[:, :3], position_ids=pos[:, :3] + t, attention_mask=block.expand(b, 1, 3, length),
                    cache=cache, final=final, stack=stack)
    return first, second


def test_stack_gives_the_bits_of_the_models_own_forward(stack_runs):
    target = tiny_target(seed=3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (2, 6), generator=g)
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6).clone()
    mask[1, 0, :, 0] = False  # row 1 does not see its first token (padding)
    mask[1, 0, 0, 0] = True
    outs = {}
    with torch.inference_mode(), native_linear.routed(target):
        for on in (True, False):
            outs[on] = _cached_forward(target, ids, mask, stack=_stack(EngineOptions(fused_stack=on)))
    assert len(stack_runs) == 2  # the stack ran (twice) with the option on, never with it off
    for lean, own in zip(outs[True], outs[False]):
        assert torch.equal(lean.logits, own.logits)
        assert torch.equal(lean.features, own.features)
        assert torch.equal(lean.final, own.final)


def test_hooks_autograd_and_the_plain_model_keep_the_models_own_forward(stack_runs):
    target = tiny_target(seed=4)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(5, 5, dtype=torch.bool).tril().expand(1, 1, 5, 5)
    seen = []
    handle = target.decoder_layers[2].mlp.register_forward_hook(lambda *a: seen.append(1))
    with torch.inference_mode(), native_linear.routed(target):
        _cached_forward(target, ids, mask)
    handle.remove()
    assert seen == [1, 1] and not stack_runs  # the hook ran: no stack
    with torch.no_grad():  # outside routed: the modules' own forwards, no stack
        _cached_forward(target, ids, mask)
    assert not stack_runs
    with native_linear.routed(target):  # autograd on
        _cached_forward(target, ids, mask)
    assert not stack_runs
    with torch.inference_mode(), native_linear.routed(target):
        _cached_forward(target, ids, mask)
    assert len(stack_runs) == 2


def test_layers_are_checked_once_per_routed_block(stack_runs):
    """A hook registered on a layer inside a ``routed`` block runs from the next block on (the
    stack checks the layers when a block's first forward asks, not at every forward)."""
    target = tiny_target(seed=4)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(5, 5, dtype=torch.bool).tril().expand(1, 1, 5, 5)
    seen = []
    with torch.inference_mode(), native_linear.routed(target):
        _cached_forward(target, ids, mask)
        handle = target.decoder_layers[1].self_attn.register_forward_pre_hook(lambda *a: seen.append(1))
        _cached_forward(target, ids, mask)
    assert len(stack_runs) == 4 and not seen
    with torch.inference_mode(), native_linear.routed(target):
        _cached_forward(target, ids, mask)
    handle.remove()
    assert len(stack_runs) == 4 and seen == [1, 1]


@pytest.mark.parametrize("mode", ["off", "chain", "tree"])
def test_engine_outputs_with_and_without_the_stack(mode, stack_runs):
    """Every token, kind and log-prob the same, prefill and rounds through the stack."""
    target = tiny_target()
    head = copy_head(target, noise=0.3)
    spec = {"off": SpecConfig(mode="off"), "chain": SpecConfig(mode="chain", num_draft_tokens=3),
            "tree": SpecConfig(mode="tree")}[mode]
    kw = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=30), spec=spec,
              verifier=VerifierConfig(name="mars", params={"theta": 0.9}), seed=4)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [1, 2, 3]]
    engine = Engine(target, head, num_threads=2, linear="native")
    lean = engine.generate(prompts, **kw)
    assert len(stack_runs) >= 2
    runs = len(stack_runs)
    own = Engine(target, head, num_threads=2, linear="native",
                 options=EngineOptions(fused_stack=False)).generate(prompts, **kw)
    assert len(stack_runs) == runs
    for a, b in zip(lean.completions, own.completions):
        assert a.completion_ids == b.completion_ids and a.kinds == b.kinds
        assert a.behaviour_logprobs == b.behaviour_logprobs and a.target_logprobs == b.target_logprobs


def test_capture_mode_records_the_same_features(stack_runs):
    """The drafter's data (features and final norm outputs of plain decoding) through the stack."""
    target = tiny_target(seed=5)
    prompts = [[1, 2, 3, 4], [5, 6]]
    got = {}
    for on in (True, False):
        runner = ModelRunner(target, None, capture=True, options=EngineOptions(fused_stack=on))
        with torch.inference_mode(), native_linear.routed(target):
            logits = runner.start(prompts, 16)
            runner.set_first_tokens(logits.argmax(-1))
            for _ in range(3):
                logits, _ = runner.verify_forward(runner.pending[:, None], torch.zeros(1, 1, dtype=torch.long), None)
                host = [1] * runner.batch
                runner.commit(torch.ones(runner.batch, dtype=torch.long), host, logits[:, 0].argmax(-1)[:, None],
                              None, None)
                runner.pending = logits[:, 0].argmax(-1)
        got[on] = runner.captures()
    assert stack_runs
    for (fa, xa), (fb, xb) in zip(got[True], got[False]):
        assert torch.equal(fa, fb) and torch.equal(xa, xb)


# -- the whole layer in one C++ call (csrc/layer.cpp) ------------------------------------------
@pytest.fixture
def native_layer_runs(monkeypatch):
    """Counts the forwards whose layers ran in ``hr_decoder_layer``."""
    return _spy_runs(monkeypatch, "_run", native_layers)


def _bf16_valued(target):
    """The target with every weight rounded to a bfloat16 value (packed as compact panels)."""
    with torch.no_grad():
        for p in target.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return target


@pytest.mark.parametrize("weights", ["fp32", "bf16-valued", "bf16-valued-amx"])
def test_native_layers_give_the_bits_of_the_python_layers(weights, native_layer_runs):
    """Prefill and a tree-like block, two rows (one padded): logits, features, final norm outputs
    and the cache's keys and values equal bit for bit with the layers run from Python; with
    bf16-valued weights as compact panels and, where the CPU has AMX, as AMX tiles."""
    if weights == "bf16-valued-amx" and not native_linear.amx_available():
        pytest.skip("AMX tiles cannot run here (no AMX-BF16 CPU, or HONEST_ROLLOUTS_AMX=0)")
    packing = EngineOptions(amx=weights == "bf16-valued-amx")
    target = tiny_target(seed=6)
    if weights != "fp32":
        _bf16_valued(target)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (2, 6), generator=g)
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6).clone()
    mask[1, 0, 1:, 0] = False  # row 1 does not see its first token (padding)
    outs, caches = {}, {}
    with torch.inference_mode(), native_linear.routed(target, options=packing):
        if weights != "fp32":
            packed = native_linear.panels_of(target.decoder_layers[0].mlp).dtype
            assert packed == (torch.int16 if weights == "bf16-valued-amx" else torch.bfloat16)
        for on in (True, False):
            stack = _stack(dataclasses.replace(packing, native_layers=on))
            calls = len(native_layer_runs)
            cfg = target.config
            cache = RowKVCache(cfg.num_hidden_layers, 2, cfg.num_key_value_heads, cfg.head_dim, 32, target.dtype, "cpu")
            cache.prepare(6)
            pos = torch.arange(6)[None].expand(2, 6)
            first = target(ids, position_ids=pos, attention_mask=mask, cache=cache, final=True, stack=stack)
            cache.commit(torch.tensor([6, 5]), [6, 5])  # rows of different lengths
            _, length = cache.prepare(3)
            block = torch.zeros(2, 3, length, dtype=torch.bool)
            block[0, :, :6], block[1, :, :5] = True, True
            for row, start in ((0, 6), (1, 5)):
                block[row, :, start:start + 3] = torch.ones(3, 3, dtype=torch.bool).tril()
                block[row, 2, start + 1] = False  # the third token does not see the second (a tree)
            second = target(ids[:, :3], position_ids=torch.tensor([[6, 7, 7], [5, 6, 6]]),
                            attention_mask=block[:, None], cache=cache, final=True, stack=stack)
            outs[on], caches[on] = (first, second), cache
            assert len(native_layer_runs) == calls + (2 if on else 0)
    for native, python in zip(outs[True], outs[False]):
        assert torch.equal(native.logits, python.logits)
        assert torch.equal(native.features, python.features)
        assert torch.equal(native.final, python.final)
    for a, b in zip(caches[True].keys + caches[True].values, caches[False].keys + caches[False].values):
        assert torch.equal(a, b)


@pytest.mark.parametrize("mode", ["off", "chain", "tree"])
def test_engine_outputs_with_and_without_native_layers(mode, native_layer_runs):
    """Every token, kind and log-prob the same through a whole call (prefill, rounds, rows
    finishing at different times and moving in the cache)."""
    target = tiny_target(seed=7)
    head = copy_head(target, noise=0.3)
    spec = {"off": SpecConfig(mode="off"), "chain": SpecConfig(mode="chain", num_draft_tokens=3),
            "tree": SpecConfig(mode="tree")}[mode]
    kw = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(5,)), spec=spec,
              verifier=VerifierConfig(name="overshoot", params={"lenience": 0.5}), seed=2)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [1, 2, 3], [7, 7]]
    engine = Engine(target, head, num_threads=2, linear="native")
    native = engine.generate(prompts, **kw)
    assert len(native_layer_runs) >= 2
    assert len({c.num_tokens for c in native.completions}) > 1  # rows finished at different rounds
    runs = len(native_layer_runs)
    python = Engine(target, head, num_threads=2, linear="native",
                    options=EngineOptions(native_layers=False)).generate(prompts, **kw)
    assert len(native_layer_runs) == runs
    for a, b in zip(native.completions, python.completions):
        assert a.completion_ids == b.completion_ids and a.kinds == b.kinds
        assert a.behaviour_logprobs == b.behaviour_logprobs and a.target_logprobs == b.target_logprobs


def test_native_layers_need_the_native_norm(native_layer_runs):
    target = tiny_target(seed=8)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(2))
    mask = torch.ones(5, 5, dtype=torch.bool).tril().expand(1, 1, 5, 5)
    torch_norms = EngineOptions(native_norm=False)  # the layer calls the norm kernel: torch's norms keep Python
    with torch.inference_mode(), native_linear.routed(target, options=torch_norms):
        _cached_forward(target, ids, mask, stack=_stack(torch_norms))
    assert not native_layer_runs
    with torch.inference_mode(), native_linear.routed(target):
        _cached_forward(target, ids, mask)
    assert len(native_layer_runs) == 2


def _prefill(target, ids, mask, cache_dtype=torch.float32, prepare=None, options=EngineOptions()):
    """A prefill of ``ids [B, T]`` into a fresh cache of ``cache_dtype`` (``prepare``: the
    ``RowKVCache.prepare`` arguments, default ``(T,)``) through the stack kernel under ``options``:
    its logits, or the exception it raised."""
    cfg = target.config
    b, t = ids.shape
    cache = RowKVCache(cfg.num_hidden_layers, b, cfg.num_key_value_heads, cfg.head_dim, 32, cache_dtype, "cpu")
    cache.prepare(*(prepare or (t,)))
    try:
        return target(ids, position_ids=torch.arange(t)[None].expand(b, t), attention_mask=mask, cache=cache,
                      stack=_stack(options)).logits
    except RuntimeError as e:
        return e


@pytest.mark.parametrize("shape", ["[1, 1, T, L]", "[B, 1, 1, L]", "[B, Hq, T, L]"])
def test_native_layers_take_a_broadcast_mask_as_its_expanded_copy(shape, native_layer_runs):
    """Two rows with a mask torch broadcasts: the layers' C++ calls read a size-1 batch or query
    dimension as its expanded copy (they read one row's mask past its end, and row 1's logits were
    off by 1.45); a per-head mask keeps the Python layers. Against torch's attention (the Python
    layers over the same mask) to float32 rounding."""
    target = tiny_target(seed=3)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    mask = {"[1, 1, T, L]": causal[None, None].clone(),
            "[B, 1, 1, L]": torch.tensor([[True] * 6, [False] + [True] * 5])[:, None, None].clone(),
            "[B, Hq, T, L]": causal.repeat(2, 4, 1, 1)}[shape]
    with torch.inference_mode(), native_linear.routed(target):
        native = _prefill(target, ids, mask)
        runs = len(native_layer_runs)
        full = _prefill(target, ids, mask.expand(2, -1, 6, 6).contiguous())
        python = _prefill(target, ids, mask, options=EngineOptions(native_layers=False))
    if shape == "[B, Hq, T, L]":
        assert runs == 0 and torch.equal(native, python)
        return
    assert runs == 1 and len(native_layer_runs) == 2
    assert torch.equal(native, full)
    torch.testing.assert_close(native, python, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", ["bf16 cache", "rows", "tokens"])
def test_native_layers_refuse_a_cache_they_cannot_write(case, native_layer_runs):
    """A bf16 cache under a float32 target, or one prepared for other rows or another token count
    than the forward's: the Python layers run (torch raises on the bf16 cache) where the C++ calls
    wrote float keys past the buffers (a heap-corruption abort) or at slots of other rows."""
    target = tiny_target(seed=3)
    ids = torch.randint(0, 64, (2, 6), generator=torch.Generator().manual_seed(1))
    dtype = torch.bfloat16 if case == "bf16 cache" else torch.float32
    prepare = {"bf16 cache": (6,), "rows": (6, slice(0, 1)), "tokens": (3,)}[case]
    length = 3 if case == "tokens" else 6
    mask = torch.ones(6, length, dtype=torch.bool).tril().expand(2, 1, 6, length)
    with torch.inference_mode(), native_linear.routed(target):
        native = _prefill(target, ids, mask, dtype, prepare)
        python = _prefill(target, ids, mask, dtype, prepare, EngineOptions(native_layers=False))
    assert not native_layer_runs
    if case == "bf16 cache":
        assert isinstance(native, RuntimeError) and str(native) == str(python) and "dtype" in str(native)
    else:
        assert torch.equal(native, python)


# -- every layer in one C++ call (hr_decoder_stack) --------------------------------------------
@pytest.mark.parametrize("with_head", [True, False], ids=["features", "plain"])
def test_one_stack_call_gives_the_bits_of_a_call_per_layer(with_head, monkeypatch):
    """A prefill in several chunks (each writing cache rows from an offset), then rounds of 1 and
    3 block tokens after rows of different lengths: logits, features and the cache's keys and
    values equal bit for bit whether the layers run from one ``hr_decoder_stack`` call or one
    ``hr_decoder_layer`` call each."""
    target = tiny_target(seed=9)
    head = copy_head(target, noise=0.3) if with_head else None
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16, 17, 18, 19]]
    stack_calls = []
    lib = native_lib._lib
    original = lib.hr_decoder_stack
    monkeypatch.setattr(lib, "hr_decoder_stack", lambda *a: stack_calls.append(a[4]) or original(*a))
    got, calls = {}, {}
    for on in (True, False):
        before = len(stack_calls)
        # chunks of 1-2 rows
        runner = ModelRunner(target, head, prefill_tokens=8, options=EngineOptions(layer_stack=on))
        outs = []
        with torch.inference_mode(), native_linear.routed(target, head):
            logits = runner.start(prompts, 24)
            runner.set_first_tokens(logits.argmax(-1))
            outs.append(logits)
            for t in (1, 3, 1):
                block = runner.pending[:, None].expand(-1, t).contiguous()
                logits, feats = runner.verify_forward(block, torch.arange(t)[None], None)
                counts = torch.tensor([1 + r % t for r in range(runner.batch)])
                runner.commit(counts, counts.tolist(), block, feats, None)
                outs += [logits, feats] if with_head else [logits]
        got[on] = (outs, runner.cache.keys + runner.cache.values, runner._waiting_feats if with_head else None)
        calls[on] = stack_calls[before:]
    assert len(calls[True]) >= 4 + 3 and set(calls[True]) == {target.config.num_hidden_layers} and not calls[False]
    (a_outs, a_kv, a_wait), (b_outs, b_kv, b_wait) = got[True], got[False]
    for a, b in zip(a_outs + a_kv, b_outs + b_kv):
        assert torch.equal(a, b)
    if with_head:
        assert torch.equal(a_wait, b_wait)
