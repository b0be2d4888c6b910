"""Decoding-time linear layers on the CPU: streaming packed weights (``csrc/linear.cpp``).

At small batch a decoding step of a small target is a chain of matrix-vector products, and its
cost is reading the fp32 weights once. torch's GEMM reaches about 12 GB/s there on this
project's 2-core CPU (about 45 ms of a 55-60 ms SmolLM2-135M step goes to the linear layers).
The kernel here reads each weight once, as sequential panels of 16 output columns, for all
input rows at once; at more rows (verify blocks over a batch, prefill) its register tiles keep
ahead of torch's GEMM too. Every linear layer of SmolLM2-135M together, distinct weights,
fp32, 2 threads, ``MKL_CBWR=AVX2`` (ms):

    input rows      1     8    16    32    64   256   2048
    torch GEMM     45    42    54    75   120   398   3031
    this kernel    19    20    29    47    88   346   2783

(``scripts/research/profile_step.py`` measures the step both ways; the floor at this machine's
bandwidth is about 16-18 ms.)

- Used for forwards of fp32 on the CPU without autograd (up to :func:`max_rows` input rows,
  batch x block tokens, per call); anything else goes to ``torch.nn.functional.linear``.
- Memory and time: each routed weight has a packed copy of its size (38 ms to pack SmolLM2-135M
  and its head on 2 threads, streaming stores), checked at the start of every ``Engine.generate``
  call and packed again unless it still holds the weight as it is (:mod:`rollout.kernels.weight_check`:
  the same tensor and version counter, and the same bytes by a 64-bit digest, every weight's read
  in one pass: 22-24 ms for SmolLM2-135M and its head on a 2-core Xeon, the rate of a plain sum),
  so a call always sees the weights as they are. ``Engine(linear="torch")`` avoids the copy.
- Outputs differ from torch's only by float32 rounding (the order of each dot product's
  sum): the engine's tests check the logits against the torch path and that the emitted
  tokens are the same. Each output's sum runs in a fixed order whatever the number of rows
  in the call or the thread count (deterministic, batch-invariant).
- **Compact panels**: a weight whose every value is a bfloat16 (an EAGLE-3 head trained and
  stored in bf16, upcast to fp32 on load; the shipped head is) is packed as bf16, half the
  bytes to stream. The kernel widens each value back to the same float before the same sums, so
  the outputs are the same bits as with fp32 panels (tests); the pack itself checks every value
  and falls back to fp32 panels for any other weight (a dense fp32 weight is refused on its
  first row, so the check costs the target nothing). A batch-1 draft step reads half the
  bytes; ``EngineOptions(compact_panels=False)`` packs everything as fp32 (A/B measurements,
  ``scripts/bench_rollout.py --fp32-head``).
- **Int8 panels**: a weight registered with per-row scales (:func:`register_int8`, done by
  ``rollout.kernels.quantize.quantize_int8_``, which rounds the EAGLE-3 head to integers times a scale
  per output row when the hf backend is asked to: ``drafter_weights: int8``) is packed as the
  integers and the scales, a quarter of fp32's bytes. The kernel multiplies each integer, as a
  float, by its row's scale, which is the product the weight holds, before the same sums: the
  same bits as fp32 panels of that weight (tests). The pack checks every value against that
  product and falls back to bf16 or fp32 panels where a value is not one (a weight changed
  since it was quantized), so what a forward computes is always the weight as it is.
- **AMX tiles** (``csrc/amx.cpp``): on a CPU with AMX-BF16 (Intel Sapphire Rapids and later),
  bf16-valued weights are packed as the 16 x 32 bf16 tiles of Intel's tile unit instead, when
  their shape allows (output sizes multiples of 16, input size a multiple of 32). Each input row
  is split exactly into three bf16 parts, so every product is exact and only the fp32 sums
  round, in a fixed, batch-invariant order: the outputs are within float32 rounding of the
  compact panels', not their bits. From about 12 rows on, where the compact panels are bound by
  FMAs, the tiles are faster (the rollout copy rounded to bf16 at batch 8 and up, its verify
  blocks, prefill); at 1-8 rows both stream the same bytes. ``EngineOptions(amx=False)`` (or
  ``HONEST_ROLLOUTS_AMX=0``) keeps the compact panels; :func:`amx_available` says whether the
  tiles can run here (the CPU, the build and the OS's grant of the tile state).
- The same library (:mod:`rollout.kernels.native_lib` lists its files, loads it and declares its
  functions) holds the decoding attention and RMS norm (:mod:`rollout.kernels.native_ops`) that
  ``rollout.kernels.fused_layers`` runs; :func:`available` is the library's.
- Needs AVX-512 (x86); elsewhere :func:`available` is False and the torch path runs.
- ``HONEST_ROLLOUTS_NATIVE`` (as for the fused verifier): ``0`` never uses it, ``1`` raises
  when it cannot be built.

:func:`routed` is the switch: inside it, the ``nn.Linear`` layers of a module run here. The
engine's options (``rollout.options.EngineOptions``: ``fused``, ``native_norm``,
``compact_panels``, ``amx``) are its and the packing's arguments, not module state.
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from rollout.kernels import fused_layers, native_lib, native_ops, weight_check
from rollout.kernels.native_lib import available
from rollout.options import EngineOptions

SOURCES = native_lib.SOURCES  # the library's files (its build key)
MODES = ("auto", "native", "torch")  # the engine's ``linear`` option
DEFAULTS = EngineOptions()

_buffers = WeakIdKeyDictionary()  # weight -> its packed copy's buffer (see ``routed``)
_merged_buffers = WeakIdKeyDictionary()  # fused module -> its merged layers' packed buffer (likewise)
_int8_scales = WeakIdKeyDictionary()  # weight -> its rows' scales (``register_int8``)
epoch = 0  # counts ``routed`` entries: what was derived from the packed buffers is stale when it moves


@functools.lru_cache(maxsize=1)
def max_rows() -> int:
    """The most input rows one kernel call takes (larger calls go to torch)."""
    lib = native_lib.load()
    return int(lib.hr_linear_max_rows()) if lib is not None else 0


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether bf16-valued weights can run on AMX tiles here: the library is available and built
    for an AMX-BF16 CPU, the OS granted this process the tile state, and ``HONEST_ROLLOUTS_AMX``
    is not ``0`` (``1``: raise where the tiles cannot run)."""
    mode = os.environ.get("HONEST_ROLLOUTS_AMX", "auto")
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"HONEST_ROLLOUTS_AMX must be one of auto, 0, 1; got {mode!r}")
    if mode == "0":
        return False
    ok = available() and bool(native_lib._lib.hr_amx_built()) and bool(native_lib._lib.hr_amx_enable())
    if mode == "1" and not ok:
        raise RuntimeError("HONEST_ROLLOUTS_AMX=1 but AMX tiles cannot run here: they need the native library, a CPU "
                           "with AMX-BF16 (amx_bf16 in /proc/cpuinfo) and the OS's grant of the tile state")
    return ok


def _packable(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and weight.numel() > 0)  # (an empty weight: nothing to pack, F.linear)


def _fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (_packable(weight) and x.device.type == "cpu" and x.dtype == torch.float32
            and x.shape[-1] == weight.shape[1]
            and (bias is None or (bias.dtype == torch.float32 and bias.device.type == "cpu"
                                  and bias.shape == (weight.shape[0],) and bias.is_contiguous()))
            and 0 < x.numel() // max(1, weight.shape[1]) <= max_rows()
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def _buffer(out: torch.Tensor | None, size: int, dtype: torch.dtype) -> torch.Tensor:
    return out if out is not None and out.numel() == size and out.dtype == dtype else torch.empty(size, dtype=dtype)


def pack(weight: torch.Tensor, out: torch.Tensor | None = None, options: EngineOptions = DEFAULTS) -> torch.Tensor:
    """The packed copy of ``weight [N, K]`` (written into ``out`` when it has the right size and
    dtype), as :func:`pack_merged` chooses under ``options``: int8 panels, AMX tiles, bf16 panels
    or fp32 panels (the module docstring)."""
    return pack_merged([weight], out, options)


def register_int8(weight: torch.Tensor, scales: torch.Tensor) -> None:
    """Declare ``weight [N, K]`` to hold, in row n, ``scales[n]`` times integers in [-127, 127]
    (each value the float32 product): ``pack`` then makes int8 panels of it, as long as that
    still holds of every value (it checks)."""
    if scales.dtype != torch.float32 or scales.shape != (weight.shape[0],):
        raise ValueError(f"register_int8: scales must be float32 of shape ({weight.shape[0]},), got "
                         f"{str(scales.dtype)} {tuple(scales.shape)}")
    _int8_scales[weight] = scales.detach().contiguous().cpu()


def int8_scales(weight: torch.Tensor) -> torch.Tensor | None:
    """The scales :func:`register_int8` gave ``weight`` (None: none)."""
    return _int8_scales.get(weight)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through the kernel when it fits (see the module docstring).
    ``packed``: ``pack(weight)``, made by the caller while the weight is unchanged (else packed here;
    a caller with panels, ``routed``, has checked :func:`available`, so the hot path does not)."""
    if not (available() if packed is None else native_lib._lib is not None) or not _fits(x, weight, bias):
        return F.linear(x, weight, bias)
    return _kernel(x, weight, bias, pack(weight) if packed is None else packed)


def _kernel(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, panels: torch.Tensor):
    if torch.autograd._profiler_enabled():  # name the call in profiles (scripts/research/profile_step.py)
        with torch.profiler.record_function("hr_linear"):
            return _run(x, weight, bias, panels)
    return _run(x, weight, bias, panels)


def _run(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, panels: torch.Tensor,
         shape: tuple[int, int] | None = None):
    n, k = weight.shape if shape is None else shape
    xs = x.contiguous()
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib = native_lib._lib
    call = {torch.bfloat16: lib.hr_linear16, torch.int8: lib.hr_linear8,
            torch.int16: lib.hr_linear_amx}.get(panels.dtype, lib.hr_linear)
    status = call(panels.data_ptr(), 0 if bias is None else bias.data_ptr(), xs.data_ptr(), out.data_ptr(), n, k,
                  xs.numel() // k)
    if status != 0:  # 1, 2: cannot happen after _fits and the pack; 3: out of memory. Never return Y then
        raise RuntimeError(f"the linear kernel ({call.__name__}) refused {xs.numel() // k} rows: status {status}"
                           + (" (could not allocate the split input rows)" if status == 3 else ""))
    return out


def pack_merged(weights: list[torch.Tensor], out: torch.Tensor | None = None,
                options: EngineOptions = DEFAULTS) -> torch.Tensor:
    """The packed copy of ``torch.cat(weights)`` (each ``[N_i, K]``, every ``N_i`` but the last a
    multiple of the panel width 16), packed from the weights in place (no concatenated copy): int8
    panels when ``options.compact_panels`` and every weight is registered (:func:`register_int8`)
    and still holds its integers times its scales, else (every value of every weight a bfloat16)
    AMX tiles (dtype int16) when ``options.amx``, :func:`amx_available` and the shapes allow, else
    bf16 panels, else fp32 (every weight fp32 with ``compact_panels`` off)."""
    compact, amx = options.compact_panels, options.amx
    lib = native_lib.required()
    if not all(_packable(w) for w in weights) or len({w.shape[1] for w in weights}) != 1:
        got = [(tuple(w.shape), str(w.dtype), w.device.type, w.is_contiguous()) for w in weights]
        raise ValueError("pack needs non-empty contiguous 2-D float32 CPU weights of one input size; got (shape, "
                         f"dtype, device, contiguous) {got}")
    k = weights[0].shape[1]
    sizes = [lib.hr_linear_packed_size(w.shape[0], k) for w in weights]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    scales = [_int8_scales.get(w) for w in weights]
    if compact and None not in scales:
        sizes8 = [lib.hr_linear_packed_size8(w.shape[0], k) for w in weights]
        starts8 = [sum(sizes8[:i]) for i in range(len(sizes8))]
        buf = _buffer(out, sum(sizes8), torch.int8)
        if all(lib.hr_linear_pack8(w.data_ptr(), sc.data_ptr(), buf[s:].data_ptr(), w.shape[0], k) == 0
               for w, sc, s in zip(weights, scales, starts8)):
            return buf
    if (compact and amx and amx_available()
            and all(lib.hr_linear_pack_amx(w.data_ptr(), None, w.shape[0], k) == 0 for w in weights)):
        buf = _buffer(out, sum(sizes), torch.int16)  # the tiles take the panels' size (every N_i a multiple of 16)
        if all(lib.hr_linear_pack_amx(w.data_ptr(), buf[s:].data_ptr(), w.shape[0], k) == 0
               for w, s in zip(weights, starts)):
            return buf
    if compact and all(lib.hr_linear_pack16(w.data_ptr(), None, w.shape[0], k) == 0 for w in weights):
        buf = _buffer(out, sum(sizes), torch.bfloat16)
        if all(lib.hr_linear_pack16(w.data_ptr(), buf[s:].data_ptr(), w.shape[0], k) == 0
               for w, s in zip(weights, starts)):
            return buf
    buf = _buffer(out, sum(sizes), torch.float32)
    for w, s in zip(weights, starts):
        lib.hr_linear_pack(w.data_ptr(), buf[s:].data_ptr(), w.shape[0], k)
    return buf


def _source(weights: list[torch.Tensor], options: EngineOptions = DEFAULTS) -> tuple:
    """What a buffer is packed from, short of the bytes: each weight's address, shape, version
    counter and int8 scales, and the packing options (``compact_panels`` and ``amx``: a buffer
    packed under other options is packed again)."""
    return (options.compact_panels, options.amx,
            *((w.data_ptr(), tuple(w.shape), w._version, id(_int8_scales.get(w))) for w in weights))


def _refill_all(jobs: list[tuple], options: EngineOptions = DEFAULTS) -> list[torch.Tensor]:
    """Each ``(owner, table, weights)`` job's packed buffer, kept where it still holds the weights
    as they are and was packed under the same ``options``, else packed again
    (``rollout.kernels.weight_check.refill_all``)."""
    return weight_check.refill_all(jobs, functools.partial(pack_merged, options=options),
                                   functools.partial(_source, options=options))


def _mergeable(layers: list[nn.Linear]) -> bool:
    """Whether one kernel call can stand for these layers' calls (none has hooks to run)."""
    k = layers[0].in_features
    return (all(_packable(m.weight) and m.in_features == k and m.bias is None
                and not (m._forward_hooks or m._forward_pre_hooks) for m in layers)
            and all(m.out_features % 16 == 0 for m in layers[:-1]))


def _merged(layers: list[nn.Linear], panels: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``torch.cat([layer(x) for layer in layers], -1)``: one kernel call when it fits."""
    n, k = sum(m.out_features for m in layers), layers[0].in_features
    if _fits(x, layers[0].weight, None):
        if torch.autograd._profiler_enabled():
            with torch.profiler.record_function("hr_linear"):
                return _run(x, None, None, panels, (n, k))
        return _run(x, None, None, panels, (n, k))
    return torch.cat([F.linear(x, m.weight) for m in layers], dim=-1)


@contextlib.contextmanager
def routed(*modules: nn.Module | None, options: EngineOptions = DEFAULTS):
    """Inside the block, every ``nn.Linear`` of ``modules`` (None entries skipped) computes through
    :func:`linear` (the kernel when a call fits, else torch), and Llama-style norms, attention
    and MLPs run the leaner forwards of :mod:`rollout.kernels.fused_layers` (q/k/v and gate/up from one
    kernel call each; norms and attention through :mod:`rollout.kernels.native_ops`; a
    decoder stack of such layers as one loop, ``fused_layers.stack_forward``). On entry each
    weight's packed copy (bf16-valued ones as compact panels, see the module docstring) is
    packed again unless it still holds the weight as it is (``rollout.kernels.weight_check``: same
    tensor and version, same bytes by digest), so the block sees the weights as they are then, however
    they were changed before; they must not change inside the block. The modules are restored
    on exit.

    options: the engine's (``rollout.options.EngineOptions``): ``fused`` off keeps every
    module's own forward (the linear layers still on the kernel), ``native_norm`` off computes the
    fused norms with torch's ``rms_norm``, ``compact_panels`` and ``amx`` choose the packing
    (:func:`pack_merged`)."""
    global epoch
    epoch += 1
    fused_layers.new_block()
    mods = [m for mod in modules if mod is not None for m in mod.modules()]
    use = any(isinstance(m, nn.Linear) for m in mods) and available()
    patched: list[nn.Module] = []
    covered: set[int] = set()  # linear layers computed inside a merged call
    merged: list[tuple[nn.Module, list[nn.Linear]]] = []  # fused modules and the layers each merges
    seen: set[int] = set()
    norm_kernel = native_ops.rms_norm if options.native_norm else None
    for mod in mods if use and options.fused else ():
        if "forward" in mod.__dict__ or id(mod) in seen:
            continue
        seen.add(id(mod))
        forward = fused_layers.norm_forward(mod, norm_kernel)
        group = fused_layers.merged_groups(mod) if forward is None else None
        if group is not None and _mergeable(group) and not any(id(m) in covered for m in group):
            merged.append((mod, group))
            covered.update(id(m) for m in group)
        elif forward is not None:
            mod.forward = forward
            patched.append(mod)
    layers = [m for m in mods if isinstance(m, nn.Linear) and "forward" not in m.__dict__ and id(m) not in covered]
    singles = {id(m.weight): m.weight for m in layers if use and _packable(m.weight)}  # a tied weight once
    jobs = [(mod, _merged_buffers, [m.weight for m in group]) for mod, group in merged]
    jobs += [(w, _buffers, [w]) for w in singles.values()]
    buffers = _refill_all(jobs, options)  # packed again where the weights changed; the digests in one call
    for (mod, group), panels in zip(merged, buffers):
        mod.forward = fused_layers.fused_forward(mod, functools.partial(_merged, group, panels), native_ops.attend)
        patched.append(mod)
    single_panels = dict(zip(singles, buffers[len(merged):]))
    for layer in layers:
        layer.forward = functools.partial(_forward, layer, single_panels.get(id(layer.weight)))
    try:
        yield
    finally:
        for mod in (*layers, *patched):
            mod.__dict__.pop("forward", None)


def release(*modules: nn.Module) -> int:
    """Drop the packed copies :func:`routed` keeps for ``modules``' weights (their bytes again,
    in fp32: a second copy of a model), for a caller that routes a model now and then and would
    rather pack it again than hold it; returns the buffers dropped. The next ``routed`` packs them."""
    dropped = 0
    for mod in (m for module in modules for m in module.modules()):
        for table, owner in ((_merged_buffers, mod), (_buffers, getattr(mod, "weight", None))):
            if isinstance(owner, (nn.Module, torch.Tensor)) and owner in table:
                del table[owner]
                weight_check.stamps.pop(owner, None)
                dropped += 1
    return dropped


def panels_of(module: nn.Module) -> torch.Tensor | None:
    """The packed panels ``routed`` made for a fused module's merged layers, or for a linear
    layer's weight (None: none this block)."""
    if isinstance(module, nn.Linear):
        return _buffers.get(module.weight)
    return _merged_buffers.get(module)


def compact_bits(panels: list[torch.Tensor]) -> int:
    """The C++ layer calls' ``compact`` argument: bit i set where ``panels[i]`` holds bf16
    (compact) panels, bit 8 + i where it holds int8 panels, bit 16 + i where it holds AMX tiles;
    none: fp32."""
    shift = {torch.bfloat16: 0, torch.int8: 8, torch.int16: 16}
    return sum(1 << (shift[p.dtype] + i) for i, p in enumerate(panels) if p.dtype in shift)


def _forward(layer: nn.Linear, panels: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    if panels is None:
        return F.linear(x, layer.weight, layer.bias)
    return linear(x, layer.weight, layer.bias, panels)


def resolve(mode: str) -> bool:
    """Whether an engine built with ``linear=mode`` uses the kernel: ``auto`` when available,
    ``native`` required (raises when unavailable), ``torch`` never."""
    if mode not in MODES:
        raise ValueError(f"linear must be one of {', '.join(MODES)}; got {mode!r}")
    if mode == "torch":
        return False
    if mode == "native" and not available():
        raise RuntimeError("linear='native' but the native linear kernel is unavailable here "
                           "(needs an AVX-512 x86 CPU and a C++ compiler; HONEST_ROLLOUTS_NATIVE must not be 0)")
    return available()
