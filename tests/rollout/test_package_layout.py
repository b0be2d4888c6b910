"""The packages depend in one direction: the interface at the top of ``rollout`` imports none of
the engines, the kernels import nothing of the engine (it passes them its options), and the
target model gets its kernels passed in."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROLLOUT = Path(__file__).resolve().parents[2] / "rollout"
INTERFACE = ["backend", "outputs", "params", "config", "models", "architectures", "eagle3", "eagle3_head",
             "eagle3_io", "chat", "options"]


def imported(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function, as dotted names
    (``from rollout import x`` counts as ``rollout.x``)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return names


def reaching(path: Path, *packages: str) -> list[str]:
    return sorted(n for n in imported(path) if any(n == p or n.startswith(p + ".") for p in packages))


@pytest.mark.parametrize("module", INTERFACE)
def test_the_interface_imports_no_engine(module):
    assert reaching(ROLLOUT / f"{module}.py", "rollout.engine", "rollout.kernels", "rollout.ray", "rollout.vllm") == []


@pytest.mark.parametrize("path", sorted((ROLLOUT / "kernels").glob("*.py")), ids=lambda p: p.name)
def test_the_kernels_import_nothing_of_the_engine(path):
    assert reaching(path, "rollout.engine", "rollout.ray", "rollout.vllm") == []


@pytest.mark.parametrize("path", sorted((ROLLOUT / "engine").glob("*.py")), ids=lambda p: p.name)
def test_the_engine_imports_no_actor_and_no_vllm(path):
    assert reaching(path, "rollout.ray", "rollout.vllm") == []


def test_the_helper_sees_every_kind_of_import(tmp_path):
    """The check itself: each import form is seen (else the tests above could not fail)."""
    src = tmp_path / "m.py"
    src.write_text("import rollout.engine.runner\nfrom rollout import kernels\n"
                   "def f():\n    from rollout.engine.tree import walk\n")
    assert reaching(src, "rollout.engine") == ["rollout.engine.runner", "rollout.engine.tree", "rollout.engine.tree.walk"]
    assert reaching(src, "rollout.kernels") == ["rollout.kernels"]
