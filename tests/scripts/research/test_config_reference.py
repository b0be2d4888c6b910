"""docs/configuration.md is what ``scripts.research.config_reference`` renders from the config
dataclasses, and its ``--check`` fails as soon as the two differ: a field added to a config
section, a value written into the file by hand."""

from __future__ import annotations

import dataclasses
import typing

import pytest
import yaml

from scripts.research import config_reference as ref
from scripts.research.config_reference.markdown import _default, _yaml, section
from trainers.tasks.rewards import RewardConfig


@pytest.fixture(scope="module")
def rendered() -> str:
    return ref.render()


def test_the_reference_is_what_the_dataclasses_render(rendered):
    assert ref.OUTPUT.read_text() == rendered, (
        f"{ref.OUTPUT} is out of date with the config dataclasses: run `{ref.COMMAND}`")


def test_check_passes_on_the_rendered_file_and_fails_on_a_hand_edit(rendered, tmp_path, capsys):
    path = tmp_path / "configuration.md"
    assert ref.main(["--output", str(path)]) == 0
    assert path.read_text() == rendered
    assert ref.main(["--check", "--output", str(path)]) == 0
    path.write_text(rendered.replace("| `run.steps` |", "| `run.stepz` |", 1))
    capsys.readouterr()
    assert ref.main(["--check", "--output", str(path)]) == 1
    report = capsys.readouterr().out
    assert "out of date" in report and "run.stepz" in report and ref.COMMAND in report


@dataclasses.dataclass(frozen=True)
class RewardWithPenalty(RewardConfig):
    length_penalty: float = 0.0  # subtracted per token past the length cap


def test_a_field_added_to_a_section_fails_the_check(monkeypatch, capsys):
    import trainers.grpo.config

    monkeypatch.setattr(trainers.grpo.config, "RewardConfig", RewardWithPenalty)  # TrainConfig.reward's type
    text = ref.render()
    assert "| `reward.length_penalty` | `float` | `0.0` | — | subtracted per token past the length cap |" in text
    capsys.readouterr()
    assert ref.main(["--check"]) == 1  # the committed docs/configuration.md lacks the new field
    assert "reward.length_penalty" in capsys.readouterr().out


def test_a_changed_allowed_set_fails_the_check(monkeypatch):
    import trainers.grpo.config

    monkeypatch.setattr(trainers.grpo.config, "DEVICES", ("cpu", "cuda", "auto", "mps"))  # RunConfig.device
    text = ref.render()
    assert "| `run.device` | `str` | `cpu` | `cpu`, `cuda`, `auto`, `mps` |" in text
    assert text != ref.OUTPUT.read_text()


def test_a_refusal_that_depends_on_another_field_is_not_an_allowed_set(rendered):
    # RolloutConfig refuses every verifier but typical / min_p only with truncation_sampling: true
    row = next(line for line in rendered.splitlines() if line.startswith("| `rollout.verifier.name` |"))
    assert "`mars`" in row and "`lossless`" in row


def _leaves(cls: type, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        sub = section(hints[f.name])
        if sub is not None:
            yield from _leaves(sub, f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", _default(f)


def test_every_default_reads_back_as_yaml():
    for kind in ref.kinds():
        for key, default in _leaves(kind.root):
            if default is dataclasses.MISSING or (isinstance(default, dict) and any(
                    dataclasses.is_dataclass(v) for v in default.values())):
                continue
            expected = list(default) if isinstance(default, tuple) else default
            assert yaml.safe_load(f"x: {_yaml(default)}")["x"] == expected, (kind.title, key)
