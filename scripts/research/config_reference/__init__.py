"""The configuration reference, docs/configuration.md, generated from the config dataclasses.

    python -m scripts.research.config_reference           # (re)writes docs/configuration.md
    python -m scripts.research.config_reference --check   # exit 1 when the file differs from render()

Everything in the file is read from the code. Each kind of YAML file has a root dataclass (the one
its loader builds with ``rollout.config.from_dict``); a field typed as a dataclass is a YAML
section. Per field: its type and default; its allowed values, where its validator refuses it with
``ConfigError(<field>, ..., allowed=X)`` under a condition on that field alone (a refusal that
depends on another field is not a fixed set); its meaning, from a ``# comment`` after the field,
else a ``name: meaning`` clause of the class docstring, else a comment above the field, else the
docstring clause that mentions it (shown as such), else nothing. The backend options come from each
registered backend's ``check_options``, the verification rules from the ``verifiers`` registry.
tests/scripts/research/test_config_reference.py checks that the file matches :func:`render`.

The package, by what each module reads or writes:

- ``fields``: the meaning of each field, from its comment or its class docstring (:func:`docs`),
  and the parsed source (:func:`parse`) the other modules also read.
- ``allowed``: the allowed values and the other facts the validators state, by scanning their
  syntax trees (:func:`class_checks`, :func:`function_checks`), and the keys a loader refuses in
  favour of another section's (:func:`moved_keys`).
- ``markdown``: values and types as the tables show them, and the Markdown of a section, of the
  backend options and of the verification rules.
- this module: the kinds of config file (:func:`kinds`) and the files of each under configs/, the
  page put together (:func:`render`) and the command line (:func:`main`); ``__main__`` runs
  :func:`main`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

import yaml

from .allowed import class_checks, moved_keys
from .fields import docs, parse
from .markdown import BACKEND_TITLE, NONE, RULES_TITLE, anchor, render_backends, render_rules, render_section, section

__all__ = ["BACKEND_TITLE", "COMMAND", "NONE", "OUTPUT", "ROOT", "RULES_TITLE", "TEST", "Kind", "kinds", "main",
           "render"]

ROOT = Path(__file__).resolve().parents[3]
OUTPUT = ROOT / "docs" / "configuration.md"
COMMAND = "python -m scripts.research.config_reference"
TEST = "tests/scripts/research/test_config_reference.py"


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of config file: its root dataclass and what reads it.

    loader: the function that reads such a file, when there is one; it is scanned for keys it
    refuses in favour of another section's (``for key, where in (("drafter", "model.drafter"), ...)``)."""

    title: str
    root: type
    reader: str
    command: str
    loader: Any = None


def kinds() -> list[Kind]:
    """The config file kinds, in the order the reference lists them."""
    from trainers.drafter.train import DrafterConfig
    from trainers.drift.study import DriftConfig
    from trainers.grpo.config import TrainConfig, load_train_config
    from trainers.study.config import StudyConfig, load_study_config
    from trainers.trl.config import TRLConfig, load_trl_config

    def name(fn) -> str:
        return f"`{fn.__module__}.{fn.__qualname__}`"

    return [
        Kind("GRPO training run", TrainConfig, name(load_train_config), "python -m scripts.train --config FILE",
             load_train_config),
        Kind("TRL run", TRLConfig, name(load_trl_config), "python -m scripts.train_trl --config FILE",
             load_trl_config),
        Kind("Study", StudyConfig, name(load_study_config), "python -m scripts.study --config FILE", load_study_config),
        Kind("Drift diagnostics", DriftConfig, "`rollout.config.from_dict(DriftConfig, ...)` in `scripts/drift.py`",
             "python -m scripts.drift --config FILE"),
        Kind("Drafter training", DrafterConfig,
             "`rollout.config.from_dict(DrafterConfig, ...)` in `scripts/train_drafter.py`",
             "python -m scripts.train_drafter --config FILE"),
    ]


def _example_files(root: type) -> list[str]:
    """The files under configs/ whose keys (at every depth that is a section) ``root`` reads."""
    def fits(cls: type, data: Any) -> bool:
        if not isinstance(data, dict):
            return False
        hints = typing.get_type_hints(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        for key, value in data.items():
            if key not in names:
                return False
            sub = section(hints[key])
            if sub is not None and isinstance(value, dict) and not fits(sub, value):
                return False
        return True

    found = []
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        try:
            data = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue
        if data and fits(root, data):
            found.append(path.relative_to(ROOT).as_posix())
    return found


def render(kind_list: list[Kind] | None = None) -> str:
    """The Markdown of docs/configuration.md, from the dataclasses of ``kind_list`` (default :func:`kinds`)."""
    for cached in (parse, docs, class_checks):  # read the code as it is now (a test may have patched it)
        cached.cache_clear()
    kind_list = kinds() if kind_list is None else kind_list
    out = [f"<!-- Generated by `{COMMAND}` from the config dataclasses; checked by {TEST}. "
           "Do not edit by hand: change the dataclasses (fields, docstrings, # comments) and rerun it. -->",
           "# Configuration reference", "",
           f"_Generated by `{COMMAND}` from the config dataclasses and checked by `{TEST}`._", "",
           "Each config file is a YAML mapping read by `rollout.config.from_dict`: a key that is not a field is "
           "refused (the error lists the allowed keys), a section (a field typed as a dataclass) is a mapping "
           "built into that dataclass, and a key left out takes the default listed here. Every value is "
           "validated before anything expensive starts; an error names the dotted key, as in the tables. "
           "*Allowed* lists the values a validator accepts where it names a fixed set for that key alone; "
           "*Meaning* is the field's comment or docstring clause in the code.", "",
           "## Contents", ""]
    for kind in kind_list:
        out.append(f"- [{kind.title}]({anchor(kind.title)}): " + (
            ", ".join(f"`{p}`" for p in _example_files(kind.root)) or "no file under configs/"))
    out += [f"- [Backend options]({anchor(BACKEND_TITLE)})", f"- [Verification rules]({anchor(RULES_TITLE)})", ""]
    for kind in kind_list:
        files = _example_files(kind.root)
        out += [f"## {kind.title}", "",
                f"Root: `{kind.root.__module__}.{kind.root.__qualname__}`, read by {kind.reader} "
                f"(`{kind.command}`). Files of this kind: "
                + (", ".join(f"`{p}`" for p in files) or "none under configs/") + ".", ""]
        render_section(out, kind.root, "", [], moved_keys(kind.loader), [])
    render_backends(out)
    render_rules(out)
    while out[-1] == "":
        out.pop()
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the file differs from what the code renders")
    ap.add_argument("--output", type=Path, default=OUTPUT, help="the reference file (default: docs/configuration.md)")
    args = ap.parse_args(argv)
    text = render()
    if not args.check:
        args.output.write_text(text)
        print(f"wrote {args.output}")
        return 0
    current = args.output.read_text() if args.output.is_file() else ""
    if current == text:
        print(f"{args.output}: up to date")
        return 0
    diff = list(difflib.unified_diff(current.splitlines(), text.splitlines(), str(args.output), "render()",
                                     lineterm="", n=0))
    removed = sum(1 for line in diff if line.startswith("-") and not line.startswith("---"))
    added = sum(1 for line in diff if line.startswith("+") and not line.startswith("+++"))
    print(f"{args.output} is out of date: {removed} line(s) differ from the code, {added} line(s) would replace "
          f"them. Run `{COMMAND}` to rewrite it.")
    print("\n".join(diff[:60]) + ("\n..." if len(diff) > 60 else ""))
    return 1
