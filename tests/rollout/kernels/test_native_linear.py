"""rollout.kernels.native_linear: the decoding linear kernel against torch's GEMM, the routing switch,
and the engine's outputs with the kernel against the torch path."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rollout.backend import WorkerSpec
from rollout.config import ConfigError
from rollout.engine.backend import HFBackend
from rollout.engine.engine import Engine
from rollout.kernels import native_lib, native_linear, weight_check
from rollout.models import TargetConfig
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from tests.models import copy_head, tiny_target
from verifiers import cbuild

needs_kernel = pytest.mark.skipif(not native_linear.available(),
                                  reason="the native linear kernel needs an AVX-512 CPU and a C++ compiler")


@needs_kernel
@pytest.mark.parametrize("n,k", [(49152, 576), (37, 17), (5, 3), (33, 1536), (64, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_kernel_matches_torch(n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    # every row count of the register groups (12 rows with a pair of panels, 16 alone), their
    # tails, and row blocks (256 rows per pass over the weights) with their tails
    for m in [*range(1, 41), 63, 64, 255, 256, 257, 600]:
        x = torch.randn(m, k, generator=g)
        out = native_linear.linear(x, w, b)
        torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4 * k ** 0.5)


@needs_kernel
def test_register_tiles_keep_their_operands_in_registers():
    """Regression: GCC 12 allocated the 7-row tile's registers badly and kept its two panel rows
    on the stack, reloading them for every FMA; that tile ran at half speed (7 rows cost more
    than 8; ``python -m scripts.research.profile_step --rows 16`` shows it). No tile's FMA reads the stack."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump (binutils) is not installed")
    lib = cbuild.library_path("linear", native_linear.SOURCES)
    asm = subprocess.run([objdump, "-d", "--no-show-raw-insn", "-C", str(lib)], capture_output=True, text=True,
                         check=True).stdout
    functions = re.split(r"\n(?=[0-9a-f]+ <)", asm)
    tiles = [f for f in functions if re.search(r"::tile(_one_region)?<", f.split("\n", 1)[0])]
    assert len(tiles) == 3 * (16 + 12), len(tiles)  # fp32, bf16 and int8 panels: 1-16 rows alone, 1-12 with a unit
    stack_fma = re.compile(r"vfmadd\w*\s+-?(0x[0-9a-f]+)?\(%rsp\)")
    assert [f.split("\n", 1)[0] for f in tiles if stack_fma.search(f)] == []


@needs_kernel
def test_kernel_is_batch_invariant_and_keeps_shapes():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 100, generator=g)
    x = torch.randn(2, 4, 100, generator=g)  # 8 rows: one kernel call
    out = native_linear.linear(x, w)
    assert out.shape == (2, 4, 300)
    for i in range(2):
        for j in range(4):  # each row alone gives the same bits as in the batch of 8
            assert torch.equal(native_linear.linear(x[i, j], w), out[i, j])
    many = torch.randn(300, 100, generator=g)  # row groups, a second row block, a lone tail panel
    out = native_linear.linear(many, w)
    for i in range(0, 300, 7):
        assert torch.equal(native_linear.linear(many[i:i + 1], w), out[i:i + 1])
        assert torch.equal(native_linear.linear(many[i:i + 13], w), out[i:i + 13])
    # a non-contiguous input is read correctly
    xt = torch.randn(100, 3, generator=g).t()
    torch.testing.assert_close(native_linear.linear(xt, w), F.linear(xt, w), rtol=1e-5, atol=1e-3)


@needs_kernel
def test_kernel_differs_from_torch_only_in_rounding_not_in_bits_everywhere():
    """Guards that the kernel really runs (not a silent fallback): its sums run in another order
    than torch's GEMM, so on a wide layer some outputs differ in their last bits."""
    g = torch.Generator().manual_seed(1)
    w, x = torch.randn(4096, 576, generator=g), torch.randn(1, 576, generator=g)
    assert not torch.equal(native_linear.linear(x, w), F.linear(x, w))


def test_fallback_to_torch():
    """More rows than the kernel takes, other dtypes and autograd go to torch's GEMM, bit for bit."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(50, 40, generator=g)
    x = torch.randn(max(1, native_linear.max_rows()) + 1, 40, generator=g)
    assert torch.equal(native_linear.linear(x, w), F.linear(x, w))
    xd, wd = x[:1].double(), w.double()
    assert torch.equal(native_linear.linear(xd, wd), F.linear(xd, wd))
    wg = w.clone().requires_grad_(True)
    out = native_linear.linear(x[:1], wg)
    out.sum().backward()
    assert wg.grad is not None and torch.equal(wg.grad, x[:1].expand(50, 40))


@needs_kernel
def test_a_bias_of_another_shape_goes_to_torch():
    """A bias that is not ``[N]`` goes to ``F.linear``, which broadcasts it or raises (the kernel read
    N floats from it: heap bytes past a short bias)."""
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(40, 8, generator=g), torch.randn(2, 8, generator=g)
    for bias in (torch.randn(1, generator=g), torch.randn(1, 40, generator=g)):
        assert torch.equal(native_linear.linear(x, w, bias), F.linear(x, w, bias))
    with pytest.raises(RuntimeError, match="must match"):
        native_linear.linear(x, w, torch.randn(3, generator=g))


@needs_kernel
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors")  # (nn.Linear(64, 0)'s init)
def test_a_weight_of_no_rows_goes_to_torch():
    """A weight with no output rows (``nn.Linear(in, 0)``) is not packed (the bf16 pack looked at its
    first row: a segmentation fault); its calls are F.linear's, in a call and inside ``routed``."""
    x = torch.randn(2, 64)
    assert native_linear.linear(x, torch.empty(0, 64)).shape == (2, 0)
    assert native_lib._lib.hr_linear_pack16(torch.empty(0, 64).data_ptr(), None, 0, 64) == 1
    model = nn.ModuleList([nn.Linear(64, 0), nn.Linear(64, 16)])
    with torch.no_grad(), native_linear.routed(model):
        out = [m(x) for m in model]
    assert out[0].shape == (2, 0) and native_linear.panels_of(model[0]) is None
    torch.testing.assert_close(out[1], model[1](x), rtol=1e-5, atol=1e-5)



@needs_kernel
def test_a_call_of_exactly_max_rows_rows_runs_on_the_kernel(monkeypatch):
    """``max_rows`` is the most rows the kernel takes, and it takes them: a call of exactly that
    many rows runs there (each row's bits those of a one-row call: batch-invariant), one row more
    goes to torch (``test_fallback_to_torch``)."""
    rows = native_linear.max_rows()
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(16, 16, generator=g), torch.randn(rows, 16, generator=g)
    runs = []
    real = native_linear._run
    monkeypatch.setattr(native_linear, "_run", lambda *a, **kw: runs.append(a[0].shape[0]) or real(*a, **kw))
    panels = native_linear.pack(w)
    out = native_linear.linear(x, w, None, panels)
    assert runs == [rows]
    for i in (0, rows // 2, rows - 1):
        assert torch.equal(out[i:i + 1], native_linear.linear(x[i:i + 1], w, None, panels))
    native_linear.linear(torch.cat([x, x[:1]]), w, None, panels)
    assert runs == [rows] + [1] * 3  # the call of rows + 1 rows went to torch


@needs_kernel
def test_layers_merge_into_one_call_only_when_every_part_but_the_last_is_whole_panels():
    """``_mergeable``: one packed buffer stands for several layers only where the offsets of the
    parts after the first fall on panel boundaries (every part's rows but the last's a multiple of
    16, as ``pack_merged`` lays them out); the last part may end in a partial panel. Merged, the
    call gives the concatenated outputs."""
    g = torch.Generator().manual_seed(6)

    def layers(*outs: int) -> list[nn.Linear]:
        out = [nn.Linear(40, n, bias=False) for n in outs]
        for m in out:
            m.weight.data = torch.randn(m.out_features, 40, generator=g)
        return out

    assert not native_linear._mergeable(layers(24, 16))  # the second part would start mid-panel
    assert not native_linear._mergeable(layers(16, 8, 16))
    group = layers(32, 16, 24)
    assert native_linear._mergeable(group)
    x = torch.randn(3, 40, generator=g)
    panels = native_linear.pack_merged([m.weight for m in group])
    with torch.no_grad():
        got = native_linear._merged(group, panels, x)
        torch.testing.assert_close(got, torch.cat([m(x) for m in group], -1), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_routed_switches_and_restores():
    layer = nn.Sequential(nn.Linear(40, 30), nn.ReLU(), nn.Linear(30, 20, bias=False))
    calls = []
    original = native_linear.linear

    def spy(x, weight, bias=None, packed=None):
        calls.append(tuple(weight.shape))
        return original(x, weight, bias, packed)

    native_linear.linear = spy
    try:
        x = torch.randn(1, 40)
        with torch.no_grad():
            expected = layer(x)
            with native_linear.routed(layer, None):
                got = layer(x)
            after = layer(x)
    finally:
        native_linear.linear = original
    assert calls == [(30, 40), (20, 30)]  # both layers went through the switch, once
    assert "forward" not in layer[0].__dict__ and "forward" not in layer[2].__dict__
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(after, expected)


def test_resolve_names_the_modes():
    with pytest.raises(ValueError, match="linear must be one of auto, native, torch; got 'fast'"):
        native_linear.resolve("fast")
    assert native_linear.resolve("torch") is False
    assert native_linear.resolve("auto") == native_linear.available()


def test_hf_backend_refuses_a_bad_linear_option():
    spec = WorkerSpec(target=TargetConfig(), drafter_path=None, sampling=SamplingParams(), spec=SpecConfig(),
                      verifier=VerifierConfig(), backend_options={"linear": "fast"})
    with pytest.raises(ConfigError, match=r"backend_options\.linear.*'fast'.*auto.*native.*torch"):
        HFBackend.from_spec(spec)
    spec = WorkerSpec(target=TargetConfig(), drafter_path=None, sampling=SamplingParams(), spec=SpecConfig(),
                      verifier=VerifierConfig(), backend_options={"linaer": "torch"})
    with pytest.raises(ConfigError, match=r"unknown hf option\(s\) \['linaer'\]"):
        HFBackend.from_spec(spec)


@needs_kernel
@pytest.mark.parametrize("mode,temperature", [("off", 1.0), ("chain", 1.0), ("chain", 0.0), ("tree", 1.0)])
def test_engine_outputs_match_the_torch_path(mode, temperature):
    """Same tokens, kinds and acceptance; log-probs equal to float32 rounding; the kernel ran."""
    target = tiny_target()
    head = copy_head(target, noise=0.3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
    spec = SpecConfig(mode=mode, num_draft_tokens=3) if mode != "tree" else SpecConfig(mode="tree")
    kw = dict(sampling=SamplingParams(temperature=temperature, max_new_tokens=40), spec=spec,
              verifier=VerifierConfig(name="mars", params={"theta": 0.9}), seed=5)
    ref = Engine(target, head, num_threads=2, linear="torch").generate(prompts, **kw)
    fast_engine = Engine(target, head, num_threads=2, linear="native")
    assert fast_engine.use_native_linear
    fast = fast_engine.generate(prompts, **kw)
    for a, b in zip(ref.completions, fast.completions):
        assert a.completion_ids == b.completion_ids
        assert a.kinds == b.kinds and a.step_emitted == b.step_emitted
        torch.testing.assert_close(torch.tensor(b.behaviour_logprobs), torch.tensor(a.behaviour_logprobs),
                                   rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(b.target_logprobs), torch.tensor(a.target_logprobs),
                                   rtol=0, atol=1e-4)


@needs_kernel
def test_engine_logits_match_the_torch_path():
    """The logits the verifier saw (debug records), kernel against torch, at batch 1 and 2."""
    target = tiny_target()
    for prompts in ([[1, 2, 3]], [[1, 2, 3], [7, 8]]):
        kw = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=12), spec=SpecConfig(mode="off"),
                  verifier=VerifierConfig(), seed=1, debug=True)
        ref = Engine(target, None, num_threads=2, linear="torch").generate(prompts, **kw)
        fast = Engine(target, None, num_threads=2, linear="native").generate(prompts, **kw)
        assert [c.completion_ids for c in ref.completions] == [c.completion_ids for c in fast.completions]
        assert len(ref.debug) == len(fast.debug) == 12 * len(prompts)
        for a, b in zip(ref.debug, fast.debug):
            assert (a.row, a.index, a.token) == (b.row, b.index, b.token)
            torch.testing.assert_close(b.target_logits, a.target_logits, rtol=1e-5, atol=1e-4)


@needs_kernel
def test_step_costs_time_the_engines_linear_layers():
    """The bench's bound divides by step costs measured on the same linear layers as the engine's."""
    from rollout.engine.timing import step_costs

    target = tiny_target()
    seen = []
    original = native_linear.linear

    def spy(x, weight, bias=None, packed=None):
        seen.append(x.numel() // weight.shape[1])
        return original(x, weight, bias, packed)

    native_linear.linear = spy
    try:
        for mode, expect in (("torch", False), ("native", True)):
            seen.clear()
            step_costs(Engine(target, copy_head(target), num_threads=2, linear=mode), [[1, 2, 3]], [1, 4], 1)
            assert bool(seen) is expect
    finally:
        native_linear.linear = original


@needs_kernel
def test_every_routed_block_sees_the_weights_as_they_are():
    """Weights changed between blocks reach the kernel however they were changed: in place (an
    optimizer step), through ``.data`` (which leaves the version counter alone, as the TRL
    trainer's step does), or by swapping the tensor; tied weights are packed once per block."""
    g = torch.Generator().manual_seed(3)
    net = nn.Sequential(nn.Linear(48, 40, bias=False), nn.Linear(40, 48, bias=False))
    x = torch.randn(2, 48, generator=g)
    changes = [lambda: net[0].weight.add_(1.0), lambda: net[0].weight.data.mul_(-0.5),
               lambda: setattr(net[0].weight, "data", torch.randn(40, 48, generator=g))]
    with torch.no_grad():
        for change in [lambda: None, *changes]:
            change()
            with native_linear.routed(net):
                got = net(x)
            torch.testing.assert_close(got, F.linear(F.linear(x, net[0].weight), net[1].weight),
                                       rtol=1e-5, atol=1e-4)
        tied = nn.Sequential(nn.Linear(48, 48, bias=False), nn.Linear(48, 48, bias=False))
        tied[1].weight = tied[0].weight
        before = weight_check.repacks
        with native_linear.routed(tied):
            got = tied(x)
        assert weight_check.repacks - before == 1
        torch.testing.assert_close(got, F.linear(F.linear(x, tied[0].weight), tied[0].weight), rtol=1e-5, atol=1e-4)


@needs_kernel
@pytest.mark.parametrize("n,k", [(16, 16), (32, 48), (48, 35), (17, 16), (5, 3), (64, 576)])
def test_pack_layout(n, k):
    """Panel p holds output columns 16p..16p+15 as K rows of 16, zero past N (the 16 x 16
    register transpose and the scalar edges agree with that layout exactly). fp32 panels (small
    integers are bfloat16 values, which compact panels would hold in the same layout:
    tests/rollout/kernels/test_native_linear_compact.py)."""
    fp32 = EngineOptions(compact_panels=False)
    w = torch.arange(n * k, dtype=torch.float32).reshape(n, k)
    padded = torch.zeros((n + 15) // 16 * 16, k)
    padded[:n] = w
    expected = padded.reshape(-1, 16, k).transpose(1, 2)
    assert torch.equal(native_linear.pack(w, options=fp32).reshape(-1, k, 16), expected)
    # into a buffer off the 64-byte alignment the streaming stores need: plain stores, same layout
    size = expected.numel()
    unaligned = torch.full((size + 1,), -1.0)[1:]
    assert unaligned.data_ptr() % 64 != 0
    assert native_linear.pack(w, unaligned, fp32) is unaligned
    assert torch.equal(unaligned.reshape(-1, k, 16), expected)


def test_native_off_means_torch_everywhere(monkeypatch):
    """``HONEST_ROLLOUTS_NATIVE=0``: not available, ``native`` refused, every path on torch's GEMM."""
    monkeypatch.setenv("HONEST_ROLLOUTS_NATIVE", "0")
    assert not native_linear.available() and native_linear.resolve("auto") is False
    with pytest.raises(RuntimeError, match="HONEST_ROLLOUTS_NATIVE must not be 0"):
        native_linear.resolve("native")
    g = torch.Generator().manual_seed(4)
    layer = nn.Linear(40, 30, bias=False)
    x = torch.randn(1, 40, generator=g)
    with torch.no_grad():
        assert torch.equal(native_linear.linear(x, layer.weight), F.linear(x, layer.weight))
        with native_linear.routed(layer):
            assert torch.equal(layer(x), F.linear(x, layer.weight))
    with pytest.raises(RuntimeError, match="native linear kernel is not available here"):
        native_linear.pack(layer.weight)  # a direct call says why, not an AttributeError of a missing library
    with pytest.raises(RuntimeError, match="not available here"):
        weight_check.digest(layer.weight.detach())


@needs_kernel
def test_pack_loads_the_library_and_checks_its_weights(monkeypatch):
    """``pack`` as a process's first call into the library loads it (it once raised an
    AttributeError on the unloaded library), and names what it cannot pack."""
    monkeypatch.setattr(native_lib, "_lib", None)
    monkeypatch.setattr(native_lib, "_tried", False)
    w = torch.randn(32, 24)
    assert native_linear.pack(w).numel() == native_lib._lib.hr_linear_packed_size(32, 24)
    for bad in (w.double(), w.t(), torch.randn(24), [w, torch.randn(16, 8)], torch.empty(0, 24)):
        with pytest.raises(ValueError, match="contiguous 2-D float32 CPU weights of one input size"):
            native_linear.pack_merged(bad if isinstance(bad, list) else [bad])
