"""The Markdown of the configuration reference: values and types as the tables show them, and the
tables themselves.

:func:`render_section` writes one section's table (key, type, default, allowed values, meaning),
then its nested sections; :func:`render_backends` the options each rollout backend accepts;
:func:`render_rules` the verification rules of the ``verifiers`` registry. A default is shown as
YAML reads it back (:func:`_yaml`); a field typed ``X`` or ``X | None`` with ``X`` a dataclass is
a section (:func:`section`).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
import json
import re
import types
import typing
from typing import Any

import yaml

from .allowed import class_checks, function_checks
from .fields import clauses, clean, docs, parse

NONE = "—"  # a cell with nothing to say (e.g. a field without a comment or docstring clause)
BACKEND_TITLE = "Backend options (`backend_options`)"
RULES_TITLE = "Verification rules (`verifier.name` and `verifier.params`)"


# ----------------------------------------------------------------------------- values and types
def _yaml(value: Any, flow: bool = False) -> str:
    """A default as YAML reads it back (``flow``: inside a ``[...]`` or ``{...}``)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return {True: ".nan"}.get(value != value) or (".inf" if value > 0 else "-.inf")
        text = repr(value)
        mantissa, e, exponent = text.partition("e")
        return f"{mantissa}.0e{exponent}" if e and "." not in mantissa else text  # 1e-06 would read as a string
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        plain = value and value.strip() == value and not (flow and re.search(r"[,\[\]{}]", value))
        return value if plain and yaml.safe_load(value) == value else json.dumps(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v, True) for v in value) + "]"
    if isinstance(value, dict):
        if any(dataclasses.is_dataclass(v) for v in value.values()):
            return "keys: " + ", ".join(map(str, value))
        return "{" + ", ".join(f"{_yaml(k, True)}: {_yaml(v, True)}" for k, v in value.items()) + "}"
    if dataclasses.is_dataclass(value):
        return "{" + ", ".join(f"{f.name}: {_yaml(getattr(value, f.name), True)}"
                               for f in dataclasses.fields(value)) + "}"
    return str(value)


def _type(tp: Any) -> str:
    if isinstance(tp, str):
        return tp
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def section(tp: Any) -> type | None:
    """The dataclass of a field typed ``X`` or ``X | None`` (a YAML section), as ``from_dict`` reads it."""
    if dataclasses.is_dataclass(tp):
        return tp
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return next((a for a in typing.get_args(tp) if dataclasses.is_dataclass(a)), None)
    return None


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") if text else NONE


def _code(value: Any) -> str:
    text = value if isinstance(value, str) else _yaml(value)
    return f"`{text}`" if "`" not in text else f"`` {text} ``"


def anchor(title: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", title.strip().lower())
    return "#" + text.replace(" ", "-")


# ----------------------------------------------------------------------------- rendering
@dataclasses.dataclass
class _Ancestor:
    cls: type
    path: str  # this class's YAML path ("" for the root)


def _allowed(ancestors: list[_Ancestor], cls: type, path: str, name: str) -> list | None:
    """Allowed values of field ``name`` of ``cls`` at ``path``: the outermost class whose validator
    names a fixed set for it (a file kind's own restriction before the section's general one)."""
    full = f"{path}.{name}" if path else name
    for anc in ancestors + [_Ancestor(cls, path)]:
        rel = full[len(anc.path) + 1:] if anc.path else full
        values = class_checks(anc.cls).allowed.get(rel)
        if values is not None:
            return values
    return None


def render_section(out: list[str], cls: type, path: str, ancestors: list[_Ancestor], moved: dict[str, str],
                   notes: list[str]) -> None:
    """The table of ``cls``'s plain fields at ``path``, then its sections (nested dataclasses and
    mappings of them) in field order."""
    summary, meanings, mentioned = docs(cls)
    checks = class_checks(cls)
    hints = typing.get_type_hints(cls)
    rows, sections = [], []
    for f in dataclasses.fields(cls):
        full = f"{path}.{f.name}" if path else f.name
        sub = section(hints[f.name])
        if sub is not None:
            sections.append((f, sub, False))
            continue
        if f.name in checks.mappings:
            sections.append((f, checks.mappings[f.name], True))
        meaning = meanings.get(f.name, "")
        if full in moved:
            meaning = f"Not read from this file: set `{moved[full]}` (the loader refuses this key). " + meaning
        allowed = _allowed(ancestors, cls, path, f.name)
        if f.name in checks.backend_options:
            cell = f"per backend: [backend options]({anchor(BACKEND_TITLE)})"
        elif f.name in checks.rule_params:
            cell = f"per rule: [verification rules]({anchor(RULES_TITLE)})"
        elif allowed is not None:
            cell = ", ".join(_code(v) for v in allowed)
        else:
            cell = ""
        default = _default(f)
        cells = [f"`{full}`", f"`{_type(f.type)}`", "" if default is dataclasses.MISSING else _code(default), cell,
                 meaning]
        rows.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    if path or rows:
        out += [f"### `{path}`" if path else "### Top level", "",
                f"`{cls.__module__}.{cls.__qualname__}`" + (f": {summary}." if summary else "."), ""]
        out += notes + ([""] if notes else [])
    if rows:
        out += ["| Key | Type | Default | Allowed | Meaning |", "|---|---|---|---|---|", *rows, ""]
    inner = ancestors + [_Ancestor(cls, path)]
    for f, sub, mapping in sections:
        full = f"{path}.{f.name}" if path else f.name
        if mapping:
            render_section(out, sub, f"{full}.<name>", [], moved,
                           [f"Each entry of `{full}` is one of these sections, under a name of your choice."])
            continue
        if full in moved:
            out += [f"### `{full}`", "", f"Not read from this file: set `{moved[full]}` (the loader refuses this "
                    "section).", ""]
            continue
        sub_notes = []
        if meanings.get(f.name) and f.name not in mentioned:
            sub_notes.append(f"In `{cls.__qualname__}`: {meanings[f.name]}.")
        default = _default(f)
        if default is None:
            sub_notes.append("Default: `null`.")
        elif dataclasses.is_dataclass(default):
            try:
                plain = sub()
            except Exception:  # a section without defaults for every field: nothing to compare
                plain = None
            if plain is not None and type(plain) is type(default) and default != plain:
                diff = {g.name: getattr(default, g.name) for g in dataclasses.fields(sub)
                        if getattr(default, g.name) != getattr(plain, g.name)}
                sub_notes.append("Left out entirely, this section is the defaults below except "
                                 + ", ".join(f"`{k}: {_yaml(v)}`" for k, v in diff.items())
                                 + "; a section that is given starts from the defaults below.")
        render_section(out, sub, full, inner, moved, sub_notes)



def _backend_sources() -> list[tuple[str, type, Any]]:
    """(name, backend class, its module) for each entry of ``rollout.backend.BACKENDS``."""
    from rollout.backend import BACKENDS

    out = []
    for name, where in BACKENDS.items():
        module_name, _, cls_name = where.partition(":")
        module = importlib.import_module(module_name)
        out.append((name, getattr(module, cls_name), module))
    return out


def _option_texts(cls: type, module) -> list[str]:
    """Paragraphs that may describe a backend's options: the comment blocks in its class, its
    docstring, its module's docstring."""
    parsed = parse(cls)
    blocks, current, last = [], [], None
    for row in sorted(parsed.comment_only):
        if last is not None and row != last + 1:
            blocks.append(" ".join(current))
            current = []
        current.append(parsed.comments[row])
        last = row
    if current:
        blocks.append(" ".join(current))
    docstrings = [ast.get_docstring(parsed.node) or "", inspect.getdoc(module) or ""]
    return blocks + [p for d in docstrings for p in inspect.cleandoc(d).split("\n\n") if p.strip()]


def _option_meanings(options: list[str], texts: list[str]) -> dict[str, str]:
    """Each option's description in the paragraph that names the most of them (as ````option````):
    the text from its name to the next option's."""
    best = max(texts, key=lambda t: sum(f"``{o}``" in t for o in options), default="")
    spots = sorted((best.find(f"``{o}``"), o) for o in options if f"``{o}``" in best)
    out = {}
    for i, (at, option) in enumerate(spots):
        end = spots[i + 1][0] if i + 1 < len(spots) else len(best)
        text = re.sub(r"\s+", " ", best[at + len(option) + 4:end]).strip().rstrip(",;.").strip()
        text = text.lstrip(":").strip()
        if text.startswith("(") and text.endswith(")") and _balanced(text[1:-1]):
            text = text[1:-1]
        out[option] = clean(text)
    return out


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            return False
    return depth == 0


def render_backends(out: list[str]) -> None:
    out += [f"## {BACKEND_TITLE}", "",
            "The `backend_options` of a rollout section are read by the backend that `backend` names "
            "(`rollout.backend.BACKENDS`); each backend's `check_options` refuses other keys before anything "
            "starts.", ""]
    for name, cls, module in _backend_sources():
        check = getattr(cls, "check_options", None) or getattr(module, "check_options")
        checks = function_checks(check, {"cls": cls})
        options = checks.allowed.get("backend_options") or []
        params = inspect.signature(cls.__init__).parameters
        mappings = [v for _, v in sorted(vars(module).items()) if isinstance(v, dict) and options
                    and set(options) <= set(v)]
        meanings = _option_meanings(options, _option_texts(cls, module))
        out += [f"### backend `{name}`", "",
                f"`{cls.__module__}.{cls.__qualname__}`; options checked by `{check.__module__}.{check.__qualname__}`.",
                "", "| Option | Default | Allowed | Meaning |", "|---|---|---|---|"]
        for option in options:
            if option in params and params[option].default is not inspect.Parameter.empty:
                default = _code(params[option].default)
            elif mappings:
                default = _code(mappings[0][option])
            else:
                default = NONE
            allowed = checks.allowed.get(f"backend_options.{option}")
            cell = ", ".join(_code(v) for v in allowed) if allowed is not None else ""
            cells = [f"`{option}`", default, cell, meanings.get(option, "")]
            out.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        out.append("")


def render_rules(out: list[str]) -> None:
    from verifiers import RULES

    out += [f"## {RULES_TITLE}", "",
            "A verifier section names a rule of the `verifiers` registry (`verifiers.RULES`) and gives its "
            "parameters in `params`; a parameter left out takes the default below, an unknown one is refused.", "",
            "| Rule (`name`) | Parameters (`params`) with defaults | Class | What it does |", "|---|---|---|---|"]
    for name, cls in RULES.items():
        if not cls.__module__.startswith("verifiers."):  # one a test or an experiment registered at run time
            continue
        params = ", ".join(f"`{f.name}: {_yaml(_default(f))}`" for f in dataclasses.fields(cls)) or "none"
        doc = ast.get_docstring(parse(cls).node) or ""
        first = doc.split("\n\n")[0]
        spans = clauses(first)
        what = clean(first[spans[0][0]:spans[0][1]]) if spans else ""
        out.append(f"| `{name}` | {params} | `{cls.__module__}.{cls.__qualname__}` | {_cell(what)} |")
    out.append("")
