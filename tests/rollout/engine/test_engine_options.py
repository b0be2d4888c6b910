"""rollout.options.EngineOptions: the engine's A/B options, passed explicitly
(``Engine(options=...)``) instead of module-global switches. What must hold: every option is on by
default; a value that is not a bool is refused, naming the field; an engine with any one option off
gives the tokens and log-probs of the default engine (the same bits, or where the option swaps a
kernel for torch's arithmetic the same to float32 rounding); and the engine's options reach every
entry point that reads them (the ``routed`` block, the stack loop, the C++ layers and draft calls,
the runner's prefill), and change what runs there (checked where the native kernels run: an
AVX-512 CPU)."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch

from rollout.config import ConfigError
from rollout.engine import timing
from rollout.engine.backend import HFBackend
from rollout.engine.engine import Engine
from rollout.engine.runner import ModelRunner
from rollout.kernels import fused_layers, native_draft, native_layers, native_lib, native_linear, native_ops
from rollout.options import EngineOptions
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from tests.models import copy_head, tiny_target

FIELDS = ["fused", "fused_stack", "native_norm", "compact_panels", "amx", "native_layers", "layer_stack",
          "native_draft", "draft_chains", "share_prompts"]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [1, 2, 3]]  # a repeated prompt: share_prompts has work to do
# options whose slower path computes with torch's kernels (attention, norms) or other tiles: the
# same tokens, log-probs to float32 rounding; every other option gives the same bits. (Where the
# linear layers run on torch's GEMM, which is not batch-invariant, a prefill over other rows may
# move the last bits: share_prompts too.)
ROUNDING = {"fused": 1e-5, "native_norm": 1e-5, "amx": 1e-4} | ({} if native_linear.available() else
                                                                {"share_prompts": 1e-5})
# where the native kernels run: what each option off stops (counts of :func:`_traced_run`; the
# C++ layers need the stack loop and the native norms, the one-call stack the C++ layers, the C++
# draft calls the fused forwards and the native norms)
STOPS = {"fused": ("stack", "layers", "layer_stack", "norm", "draft_step", "draft_chain"),
         "fused_stack": ("stack", "layers", "layer_stack"),
         "native_norm": ("norm", "layers", "layer_stack", "draft_step", "draft_chain"),
         "native_layers": ("layers", "layer_stack"), "layer_stack": ("layer_stack",),
         "native_draft": ("draft_step", "draft_chain"), "draft_chains": ("draft_chain",)}
# the entry points that take the options (each records the options it was handed; None: not handed any)
ENTRIES = {"routed": (native_linear, "routed"), "stack_forward": (fused_layers, "stack_forward"),
           "layers": (native_layers, "run"), "draft_step": (native_draft, "step"),
           "draft_chain": (native_draft, "chain")}


def test_every_option_is_on_by_default():
    assert [f.name for f in dataclasses.fields(EngineOptions)] == FIELDS
    options = EngineOptions()
    assert all(getattr(options, name) is True for name in FIELDS)
    assert options.off() == () and options.describe() == ""


@pytest.mark.parametrize("name", FIELDS)
@pytest.mark.parametrize("bad", [0, 1, "false", None])
def test_a_value_that_is_not_a_bool_is_refused_naming_the_field(name, bad):
    with pytest.raises(ConfigError, match=rf"'options\.{name}': must be true or false, got {bad!r}") as err:
        EngineOptions(**{name: bad})
    assert err.value.field == f"options.{name}"


def test_options_name_what_is_off_and_are_values():
    """``off``/``describe`` (a benchmark row's label) name the options off, in field order; the
    options are frozen, equal and hashed by value (the benchmarks keep an engine per options)."""
    options = EngineOptions(amx=False, fused=False)
    assert options.off() == ("fused", "amx") and options.describe() == "fused off, amx off"
    assert options == EngineOptions(fused=False, amx=False) != EngineOptions(fused=False)
    assert hash(options) == hash(EngineOptions(fused=False, amx=False))
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.fused = True


@pytest.fixture(scope="module")
def models():
    """A tiny target and a head whose weights are bf16 values (packed as compact panels, or AMX
    tiles where the CPU has them, unless the options say otherwise)."""
    target = tiny_target()
    head = copy_head(target, noise=0.3)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(p.bfloat16().float())
    return target, head


def _traced_run(target, head, options: EngineOptions, monkeypatch) -> tuple:
    """One chain call of an engine built with ``options``; returns its result and what ran: the
    options each entry point of :data:`ENTRIES` was handed, the runner's options and prefilled
    rows, counts of what the native kernels ran (the stack loop, the C++ layers, the one-call
    stack, the norm kernel, C++ draft steps and chains) and the dtype of the head's lm_head panels."""
    handed: dict[str, list] = {key: [] for key in ENTRIES}
    counts = dict.fromkeys(("stack", "layers", "layer_stack", "norm", "draft_step", "draft_chain"), 0)
    runners: list[tuple] = []

    def entry(key, owner, name):
        original = getattr(owner, name)
        signature = inspect.signature(original)

        def spy(*args, **kwargs):
            handed[key].append(signature.bind(*args, **kwargs).arguments.get("options"))
            out = original(*args, **kwargs)
            if key in ("draft_step", "draft_chain") and out is not None:
                counts[key] += 1
            return out

        monkeypatch.setattr(owner, name, spy)

    def count(key, owner, name):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            counts[key] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counted)

    for key, (owner, name) in ENTRIES.items():
        entry(key, owner, name)
    count("stack", fused_layers, "_run_stack")
    count("layers", native_layers, "_run")
    count("norm", native_ops, "rms_norm")
    if native_lib._lib is not None:
        count("layer_stack", native_lib._lib, "hr_decoder_stack")
    start = ModelRunner.start

    def started(self, prompts, capacity):
        out = start(self, prompts, capacity)
        runners.append((self.options, self.prefilled_rows))
        return out

    monkeypatch.setattr(ModelRunner, "start", started)
    engine = Engine(target, head, num_threads=2, options=options)
    result = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=16),
                             SpecConfig(mode="chain", num_draft_tokens=3),
                             VerifierConfig(name="mars", params={"theta": 0.9}), seed=4)
    panels = native_linear.panels_of(head.lm_head)
    monkeypatch.undo()
    return result, handed, runners, counts, None if panels is None else panels.dtype


@pytest.fixture(scope="module")
def default_run(models):
    with pytest.MonkeyPatch.context() as mp:
        return _traced_run(*models, EngineOptions(), mp)


@pytest.mark.parametrize("name", FIELDS)
def test_an_option_off_reaches_the_code_and_changes_no_output(models, default_run, name, monkeypatch):
    target, head = models
    options = EngineOptions(**{name: False})
    result, handed, runners, counts, panels = _traced_run(target, head, options, monkeypatch)
    base, base_handed, base_runners, base_counts, base_panels = default_run

    # the engine's options, handed to every entry point that ran (the same object, not a default)
    for key in ("routed", "stack_forward", "draft_step", "draft_chain"):
        assert handed[key], key
    for key, seen in handed.items():
        assert all(o is options for o in seen), (key, seen)
    assert runners and all(o is options for o, _ in runners)
    assert all(o == EngineOptions() for seen in base_handed.values() for o in seen)

    # what the option turns off does not run (where the native kernels run)
    rows = [r for _, r in runners]
    assert [r for _, r in base_runners] == [3] and rows == ([len(PROMPTS)] if name == "share_prompts" else [3])
    if native_linear.available():
        assert base_counts["stack"] and base_counts["layers"] and base_counts["layer_stack"] and base_counts["norm"]
        assert base_counts["draft_step"] and base_counts["draft_chain"]
        for key, n in counts.items():
            assert (n == 0) if key in STOPS.get(name, ()) else n > 0, (key, n)
        tiles = torch.int16 if native_linear.amx_available() else torch.bfloat16
        assert base_panels == tiles
        assert panels == {"compact_panels": torch.float32, "amx": torch.bfloat16}.get(name, tiles)

    # the same tokens and log-probs
    assert result.timings.draft_forwards == base.timings.draft_forwards > 0
    for a, b in zip(result.completions, base.completions):
        assert a.completion_ids == b.completion_ids and a.kinds == b.kinds and a.step_emitted == b.step_emitted
        if name in ROUNDING:
            for x, y in ((a.behaviour_logprobs, b.behaviour_logprobs), (a.target_logprobs, b.target_logprobs)):
                torch.testing.assert_close(torch.tensor(x), torch.tensor(y), rtol=0, atol=ROUNDING[name])
        else:
            assert a.behaviour_logprobs == b.behaviour_logprobs and a.target_logprobs == b.target_logprobs


def test_step_costs_run_under_the_engines_options(models, monkeypatch):
    """``rollout.engine.timing.step_costs`` times the steps the way the engine runs them: its runner
    and kernels get the engine's options (no one-call chain with ``draft_chains`` off)."""
    target, head = models
    options = EngineOptions(draft_chains=False)
    handed = []
    for owner, name in (ENTRIES["stack_forward"], ENTRIES["draft_step"], ENTRIES["draft_chain"]):
        original = getattr(owner, name)
        signature = inspect.signature(original)
        monkeypatch.setattr(owner, name, lambda *a, _o=original, _s=signature, **kw: handed.append(
            _s.bind(*a, **kw).arguments.get("options")) or _o(*a, **kw))
    engine = Engine(target, head, num_threads=2, options=options)
    costs = timing.step_costs(engine, PROMPTS[:2], [1, 4], 1, chains=(3,))
    assert set(costs) == {1, 4, "draft"}
    assert handed and all(o is options for o in handed)


def test_the_hf_backend_hands_its_options_to_the_engine(models):
    target, _ = models
    assert HFBackend(target, None, num_threads=2).engine.options == EngineOptions()
    options = EngineOptions(share_prompts=False)
    assert HFBackend(target, None, num_threads=2, options=options).engine.options is options
    with pytest.raises(TypeError, match="options must be an EngineOptions"):
        Engine(target, options={"fused": False})


def test_the_packing_key_holds_the_packing_options():
    """A buffer packed under other packing options is packed again (``native_linear._source``, the
    key ``routed`` keeps a buffer by): ``compact_panels`` and ``amx`` are in it, the others not."""
    w = torch.randn(32, 16)
    key = native_linear._source([w], EngineOptions())
    assert native_linear._source([w]) == key == native_linear._source([w], EngineOptions(fused=False))
    assert native_linear._source([w], EngineOptions(compact_panels=False)) != key
    assert native_linear._source([w], EngineOptions(amx=False)) != key
