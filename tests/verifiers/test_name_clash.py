"""Another distribution that installs a package under one of our import names (the RL library
``verifiers``, or ``rollout``, ``scripts``) is refused at import with its name, version and the fix;
without one nothing is raised. The clashing distributions are real ``.dist-info`` folders on
``sys.path``, found by ``importlib.metadata`` as pip's would be."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import verifiers
from verifiers import name_clash
from verifiers.name_clash import NameClashError, check_import_names

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def chain_backend():
    """No chain backend to run these on (the conftest's runs each verifier test on both)."""
    yield None


def fake_dist(site: Path, name: str, version: str = "0.1", top_level: str | None = None,
              record: str | None = None) -> Path:
    """A ``<name>-<version>.dist-info`` folder in ``site`` (METADATA, and top_level.txt / RECORD)."""
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if top_level is not None:
        (info / "top_level.txt").write_text(top_level)
    if record is not None:
        (info / "RECORD").write_text(record)
    return site


def test_nothing_is_raised_without_a_namesake():
    check_import_names()
    assert all(name_clash.clashing_distribution(n) is None for n in name_clash.NAMES)


def test_the_verifiers_library_is_refused_with_its_name_version_and_the_fix(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(fake_dist(tmp_path, "verifiers", "0.1.3", top_level="verifiers\n")))
    with pytest.raises(NameClashError) as err:
        check_import_names()
    text = str(err.value)
    assert "the 'verifiers' distribution 0.1.3 is installed in this environment" in text
    assert "shares the import name 'verifiers' with honest-rollouts" in text
    assert "its own virtual environment (python -m venv .venv && .venv/bin/pip install -e .)" in text
    assert "uninstall 'verifiers'" in text and str(tmp_path) in text
    assert isinstance(err.value, ImportError)


def test_a_wheel_without_top_level_txt_is_read_from_its_record(tmp_path, monkeypatch):
    # hatchling / uv wheels (the verifiers library's) record files but write no top_level.txt
    site = fake_dist(tmp_path, "verifiers", record="verifiers/__init__.py,,\nverifiers-0.1.dist-info/METADATA,,\n")
    monkeypatch.syspath_prepend(str(site))
    with pytest.raises(NameClashError, match="'verifiers' distribution 0.1"):
        check_import_names()


@pytest.mark.parametrize("name", ["rollout", "scripts"])
def test_rollout_and_scripts_namesakes_are_refused(tmp_path, monkeypatch, name):
    monkeypatch.syspath_prepend(str(fake_dist(tmp_path, name, "2.0", top_level=f"{name}\n")))
    with pytest.raises(NameClashError, match=f"'{name}' distribution 2.0 .* import name '{name}'"):
        check_import_names()


def test_a_namesake_that_installs_no_such_package_is_not_a_clash(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(fake_dist(tmp_path, "rollout", top_level="rollout_tools\n")))
    check_import_names()


def test_importing_our_verifiers_beside_the_library_fails(tmp_path):
    """The check runs when ``verifiers`` (ours) is imported, before anything else in it."""
    site = fake_dist(tmp_path, "verifiers", "0.1.3", top_level="verifiers\n")
    code = "import verifiers, sys; sys.stdout.write(verifiers.__file__)"
    env = {**os.environ, "PYTHONPATH": str(site)}
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "NameClashError" in result.stderr and "the 'verifiers' distribution 0.1.3" in result.stderr
    clean = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert clean.returncode == 0, clean.stderr
    assert Path(clean.stdout).resolve() == Path(verifiers.__file__).resolve()


#: the statement rollout/__init__.py ends with: this file run by its path, without importing the
#: verifiers package (torch, or the other library where that one shadows ours)
ROLLOUT_LINE = """__import__("runpy").run_path(f"{__path__[0]}/../verifiers/name_clash.py",
                             run_name="verifiers.name_clash")["check_import_names"]()"""


def test_rollouts_line_passes_without_a_namesake_and_imports_neither_verifiers_nor_torch(tmp_path):
    code = (f"import sys, rollout\n__path__ = rollout.__path__\n{ROLLOUT_LINE}\n"
            "print(sorted(m for m in ('verifiers', 'torch') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_rollouts_line_refuses_where_the_library_shadows_our_verifiers(tmp_path):
    """Where the library's ``verifiers`` comes first on sys.path our ``verifiers/__init__.py`` never
    runs; rollout's line still finds our check and refuses, without importing either package."""
    site = fake_dist(tmp_path / "site", "verifiers", "0.1.3", record="verifiers/__init__.py,,\n")
    (site / "verifiers").mkdir()
    (site / "verifiers" / "__init__.py").write_text("THEIRS = True\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}  # theirs first, then ours
    shadowed = subprocess.run([sys.executable, "-c", "import verifiers; print(verifiers.THEIRS)"], cwd=tmp_path,
                              env=env, capture_output=True, text=True)
    assert shadowed.stdout.strip() == "True", shadowed.stderr  # the library's package, not ours
    code = f"import sys, rollout\n__path__ = rollout.__path__\n{ROLLOUT_LINE}\n"
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode != 0
    assert "verifiers.name_clash.NameClashError: the 'verifiers' distribution 0.1.3" in result.stderr
