"""Every console command in pyproject.toml names a user entry point's ``main`` (scripts/, not
scripts/research/), and every user entry point has its command."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENTRY_POINTS = {"train", "train_trl", "drift", "study", "train_drafter", "measure_acceptance", "compare_runs",
                "check_model", "bench_rollout", "bench_vllm"}


def commands() -> dict[str, str]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_each_command_runs_a_user_entry_points_main():
    for name, target in commands().items():
        module, func = target.split(":")
        assert module.startswith("scripts.") and not module.startswith("scripts.research."), name
        assert name == "honest-" + module.removeprefix("scripts.").replace("_", "-")
        assert callable(getattr(importlib.import_module(module), func)), target


def test_every_user_entry_point_has_a_command():
    assert {t.split(":")[0].removeprefix("scripts.") for t in commands().values()} == ENTRY_POINTS
