""".ci/check_words.sh, run in a scratch git repository: a tracked file that names a work session or
how the work was organised fails it (exit 1) and is named with its line; clean files, untracked
files and the script itself pass."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / ".ci" / "check_words.sh"

pytestmark = pytest.mark.skipif(shutil.which("git") is None or shutil.which("bash") is None,
                                reason="needs git and bash")


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".ci").mkdir()
    shutil.copy2(SCRIPT, tmp_path / ".ci" / "check_words.sh")
    subprocess.run(["git", "add", ".ci/check_words.sh"], cwd=tmp_path, check=True)  # holds every pattern
    return tmp_path


def add(repo: Path, name: str, text: str, track: bool = True) -> None:
    path = repo / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if track:
        subprocess.run(["git", "add", name], cwd=repo, check=True)


def check(repo: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(repo)}
    return subprocess.run(["bash", str(repo / ".ci" / "check_words.sh")], cwd=cwd or repo, env=env,
                          capture_output=True, text=True)


def test_the_script_is_executable():
    assert os.access(SCRIPT, os.X_OK)


# the words the check refuses, put together here so that this file does not hold them itself
PERIOD, SITTING, LENT = "sess" + "ion", "sit" + "ting", "le" + "nt"


def test_a_clean_tree_passes(repo):
    add(repo, "README.md", "# Notes\nMeasured on 2026-12-07 (docs/measurements/): 1.5x over plain decoding.\n"
        f"A {PERIOD}less design; the {PERIOD}s API; a {PERIOD} object; excellent {LENT}icular {SITTING}s.\n")
    result = check(repo)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_work_counter_fails_and_names_the_file_and_line(repo):
    add(repo, "README.md", "# Notes\n")
    add(repo, "docs/speed.md", f"# Speed\nmeasured in {PERIOD} 12\n")
    result = check(repo, cwd=repo / "docs")  # from a subfolder too
    assert result.returncode == 1
    assert f"docs/speed.md:2:measured in {PERIOD} 12" in result.stdout
    assert "README.md" not in result.stdout


@pytest.mark.parametrize("line", [
    f"{PERIOD.title()} 46 (2-core Xeon): tau +0.5",
    f"the same rewards as {PERIOD}s 13-24",
    f"one {SITTING}, load 1.8-2.5",
    f"not yet exercised on a GPU: no GPU was {LENT}",
    f"the GPU was {LENT} for an hour",
    f"machines were {LENT}",
    f"a GPU is {LENT}",
    f"it is not {LENT}",
])
def test_each_pattern_fails(repo, line):
    add(repo, "rollout/notes.py", f"x = 1  # {line}\n")
    result = check(repo)
    assert result.returncode == 1, line
    assert "rollout/notes.py:1:" in result.stdout


def test_untracked_files_and_the_check_itself_are_not_searched(repo):
    add(repo, "scratch.md", f"measured in {PERIOD} 12\n", track=False)
    add(repo, "tests/test_words_check.py", f"'measured in {PERIOD} 12'\n")  # the check's own test
    result = check(repo)
    assert result.returncode == 0, result.stdout + result.stderr
