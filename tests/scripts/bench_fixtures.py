"""Shared by the rollout benchmark's tests (``test_bench_rollout*.py``; no test functions here):
the ``tiny`` engine over the session's tiny random policy and head, and the drafting a chain's
bound counts. A test module imports ``tiny`` to use it as its own module-scoped fixture."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny(tiny_policy_dir, tiny_head_dir):
    from rollout.eagle3 import load_eagle3
    from rollout.engine.engine import Engine
    from rollout.models import TargetConfig, load_target

    target, tok = load_target(TargetConfig(path=str(tiny_policy_dir)))
    head = load_eagle3(tiny_head_dir, target)
    return target, tok, Engine(target, head, num_threads=1)


def drafting(costs: dict, k: int) -> float:
    """A chain round's drafting in the bound: the root step and the one-call chain where that
    call runs here (``T_draft + T_chain(K)``), else K draft steps."""
    from rollout.kernels import native_linear

    if native_linear.available():
        return costs["draft"] + costs[f"chain{k}"]
    assert f"chain{k}" not in costs
    return k * costs["draft"]
