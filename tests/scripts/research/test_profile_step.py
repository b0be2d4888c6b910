"""scripts/research/profile_step.py on the tiny random policy (the figures come from running it on the
embedded model)."""

from __future__ import annotations

import pytest
import torch


def test_profile_reports_costs_floor_and_op_shares(tiny_policy_dir, monkeypatch):
    from rollout.engine.engine import Engine
    from rollout.models import TargetConfig, load_target
    from scripts.research.profile_step import categorise, measure

    target, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    res = measure(target, [1, 20, 300, 7], reps=3, bandwidth=10.0)
    native = measure(target, [1, 20, 300, 7], reps=3, bandwidth=10.0, linear="auto")
    assert native["ops"].get("matmul", 0) > 0 and native["forward_ms"] > 0
    built = []
    init = Engine.__init__
    monkeypatch.setattr(Engine, "__init__",
                        lambda self, *a, **kw: built.append(kw.get("options")) or init(self, *a, **kw))
    unfused = measure(target, [1, 20, 300, 7], reps=3, bandwidth=10.0, linear="auto", fused=False)
    assert unfused["forward_ms"] > 0
    own_stack = measure(target, [1, 20, 300, 7], reps=3, bandwidth=10.0, linear="auto", stack=False)
    assert own_stack["forward_ms"] > 0
    assert [o.off() for o in built] == [("fused",), ("fused_stack",)]  # each measured engine with its option off
    weights = sum(p.numel() * 4 for p in target.parameters())
    assert res["floor_ms"] == pytest.approx(weights / 10e9 * 1000)
    assert res["engine_ms"] > 0 and res["forward_ms"] > 0 and res["lm_head_ms"] > 0
    assert sum(res["ops"].values()) == pytest.approx(100, abs=0.5)
    assert res["ops"].get("matmul", 0) > 0 and res["ops"].get("attention", 0) > 0
    assert categorise("aten::mm") == "matmul" and categorise("aten::_scaled_dot_product_flash_attention_for_cpu") \
        == "attention" and categorise("aten::pow") == "elementwise/norm/rope" and categorise("aten::cat") \
        == "copies/views" and categorise("aten::foo") == "other"
    assert torch.get_num_threads() >= 1


def test_slow_rows_flags_a_row_count_dearer_than_the_next():
    from scripts.research.profile_step import slow_rows

    assert slow_rows([10, 11, 12, 25, 14, 15]) == [4]  # 4 rows at 25 us, 5 rows at 14
    assert slow_rows([10, 12, 11, 13]) == []  # within the slack (noise)
    assert slow_rows([10, 12, 11, 13], slack=1.05) == [2]


def test_linear_rows_times_every_layer_shape(tiny_policy_dir):
    from rollout.kernels import native_linear
    from rollout.models import TargetConfig, load_target
    from scripts.research.profile_step import linear_rows

    if not native_linear.available():
        pytest.skip("the native linear kernel needs an AVX-512 CPU and a C++ compiler")
    target, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    shapes = {f"{n}x{k}" for n, k in (m.weight.shape for m in target.modules() if isinstance(m, torch.nn.Linear))}
    rows = linear_rows(target, 3, reps=1)
    assert set(rows) == shapes and all(len(t) == 3 and min(t) > 0 for t in rows.values())


def test_streamed_rows_and_block_costs(tiny_policy_dir):
    from rollout.kernels import native_linear
    from rollout.models import TargetConfig, load_target
    from scripts.research.profile_step import block_costs, streamed_rows

    target, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    blocks = block_costs(target, [1, 20, 300, 7], 3, reps=2)
    assert len(blocks) == 3 and min(blocks) > 0
    if not native_linear.available():
        pytest.skip("the native linear kernel needs an AVX-512 CPU and a C++ compiler")
    streamed = streamed_rows(target, 3, reps=1)
    assert len(streamed) == 3 and min(streamed) > 0
