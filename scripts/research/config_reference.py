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
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import functools
import importlib
import importlib.util
import inspect
import io
import json
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = ROOT / "docs" / "configuration.md"
COMMAND = "python -m scripts.research.config_reference"
TEST = "tests/scripts/research/test_config_reference.py"
NONE = "—"  # a cell with nothing to say (e.g. a field without a comment or docstring clause)
BACKEND_TITLE = "Backend options (`backend_options`)"
RULES_TITLE = "Verification rules (`verifier.name` and `verifier.params`)"


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


# ----------------------------------------------------------------------------- source reading
@dataclasses.dataclass(frozen=True)
class _Parsed:
    node: ast.AST  # the class or function definition
    comments: dict[int, str]  # line -> the comment's text on that line
    comment_only: frozenset[int]  # lines holding nothing but a comment


@functools.lru_cache(maxsize=None)
def _parse(obj) -> _Parsed:
    """The definition of class or function ``obj`` from its source, with its comments."""
    text = textwrap.dedent(inspect.getsource(obj))
    comments, only = {}, set()
    lines = text.splitlines()
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            row = tok.start[0]
            comments[row] = tok.string.lstrip("#").strip()
            if lines[row - 1].strip().startswith("#"):
                only.add(row)
    return _Parsed(ast.parse(text).body[0], comments, frozenset(only))


def _clean(text: str) -> str:
    """One line of Markdown from docstring text: RST roles as code spans, whitespace collapsed,
    trailing punctuation dropped."""
    text = re.sub(r":(?:func|class|data|mod|meth|attr|obj):`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"\s+", " ", text).strip().rstrip(".;,:").strip()


def _clauses(text: str) -> list[tuple[int, int]]:
    """Spans of ``text`` split after a '.' or ';' that ends a clause (followed by white space, outside
    brackets; 'e.g.' and the like do not end one) and at blank lines."""
    spans, start, depth = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth = max(depth - 1, 0)
        elif depth == 0 and ch in ".;" and (i + 1 == len(text) or text[i + 1].isspace()):
            if ch == "." and re.search(r"(?:\b(?:e\.g|i\.e|etc|cf|vs)|\.\.)$", text[:i]):
                continue
            spans.append((start, i + 1))
            start = i + 1
        elif text.startswith("\n\n", i) and depth == 0:
            spans.append((start, i))
            start = i
    spans.append((start, len(text)))
    return [(a, b) for a, b in spans if text[a:b].strip()]


def _one(names: list[str]) -> str:
    alternatives = "|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    return rf"(?:``)?(?:{alternatives})(?!\w)(?:``)?"


def _mentions(name: str) -> re.Pattern:
    """``name`` as a word of its own (not part of ``a.name`` or ``name.b``)."""
    return re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w|\.\w)")


def _parse_doc(doc: str, names: list[str]) -> tuple[str, dict[str, str], str]:
    """(summary, {field: meaning}, text) of a class docstring: the text before the first
    ``name: meaning`` label, the meaning of each labelled field (up to the next label, a blank line
    or a clause that starts with another field's name), and the whole text."""
    text = "\n".join(line.strip() for line in inspect.cleandoc(doc).splitlines())
    if not names:
        return _clean(text.split("\n\n")[0]), {}, text
    one = _one(names)
    label = re.compile(rf"(?:^|(?<=\n)|(?<=[.;] ))(?P<names>{one}(?:(?:,\s*|\s*/\s*|\s+and\s+){one})*):(?=\s)")
    matches = list(label.finditer(text))
    first = matches[0].start() if matches else len(text)
    summary = _clean(text[:first].split("\n\n")[0])
    starts = re.compile(rf"^\s*{one}")
    meanings: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        segment = text[m.end():end]
        cut = len(segment)
        for a, b in _clauses(segment):
            if a > 0 and (starts.match(segment[a:b]) or segment[a:b].startswith("\n\n")):
                cut = a
                break
        meaning = _clean(segment[:cut])
        for name in re.findall(r"\w+", m.group("names")):
            if name in names and name not in meanings:
                meanings[name] = meaning
    return summary, meanings, text


def _mentioned_in(text: str, name: str) -> str | None:
    """The first docstring clause that mentions ``name``."""
    pattern = _mentions(name)
    for a, b in _clauses(text):
        if pattern.search(text[a:b]):
            return _clean(text[a:b])
    return None


@functools.lru_cache(maxsize=None)
def _docs(cls: type) -> tuple[str, dict[str, str], frozenset[str]]:
    """(summary, {field: meaning}, fields whose meaning is only a docstring clause that mentions them)
    of dataclass ``cls``, each field's meaning from the class that declares it (see the module
    docstring for the order of the sources)."""
    names = [f.name for f in dataclasses.fields(cls)]
    out: dict[str, str] = {}
    mentioned: set[str] = set()
    summary = ""
    for klass in cls.__mro__:
        own = [n for n in klass.__dict__.get("__annotations__", {}) if n in names and n not in out]
        if not own and klass is not cls:
            continue
        parsed = _parse(klass)
        doc = ast.get_docstring(parsed.node) or ""
        head, labelled, text = _parse_doc(doc, names) if doc else ("", {}, "")
        if klass is cls:
            summary = head
        fields_at = {s.target.id: s for s in parsed.node.body
                     if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}
        for name in own:
            stmt = fields_at.get(name)
            trailing = above = None
            if stmt is not None:
                trailing = next((parsed.comments[r] for r in range(stmt.lineno, stmt.end_lineno + 1)
                                 if r in parsed.comments and r not in parsed.comment_only), None)
                rows, row = [], stmt.lineno - 1
                while row in parsed.comment_only:
                    rows.insert(0, parsed.comments[row])
                    row -= 1
                above = " ".join(rows) or None
            if trailing:
                out[name] = _clean(trailing)
            elif name in labelled:
                out[name] = labelled[name]
            elif above:
                out[name] = _clean(above)
            elif text and (clause := _mentioned_in(text, name)):
                out[name] = f"(mentioned in the class docstring:) {clause}"
                mentioned.add(name)
    return summary, out, frozenset(mentioned)


# ----------------------------------------------------------------------------- validators
class _Unknown(Exception):
    """An expression the reference does not evaluate (it depends on runtime values)."""


_CALLS = {"sorted": sorted, "list": list, "tuple": tuple}


def _evaluate(node: ast.AST, ns: dict[str, Any]) -> Any:
    """A constant, a module-level name, an attribute of one, ``a + b`` or ``sorted/list/tuple(x)``."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return [_evaluate(e, ns) for e in node.elts]
    if isinstance(node, ast.Name):
        if node.id not in ns:
            raise _Unknown(node.id)
        return ns[node.id]
    if isinstance(node, ast.Attribute):
        try:
            return getattr(_evaluate(node.value, ns), node.attr)
        except AttributeError:
            raise _Unknown(node.attr) from None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _evaluate(node.left, ns) + _evaluate(node.right, ns)
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS
            and len(node.args) == 1 and not node.keywords):
        return _CALLS[node.func.id](_evaluate(node.args[0], ns))
    raise _Unknown(type(node).__name__)


def _self_path(node: ast.AST) -> str | None:
    """``a.b`` for the expression ``self.a.b``."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    return ".".join(parts) if isinstance(node, ast.Name) and node.id == "self" and parts else None


def _self_paths(node: ast.AST) -> set[str]:
    """The longest ``self.x.y`` paths an expression reads."""
    paths = {p for n in ast.walk(node) if (p := _self_path(n))}
    return {p for p in paths if not any(q.startswith(p + ".") for q in paths)}


def _callee(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        node = node.func
        return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return None


def _namespace(fn_node: ast.AST, module, extra: dict[str, Any]) -> dict[str, Any]:
    """The names a function sees: its module's, ``extra`` and its own ``import`` statements."""
    ns = {**vars(module), **extra}
    for node in ast.walk(fn_node):
        if isinstance(node, ast.ImportFrom) and node.module:
            base = node.module if not node.level else importlib.util.resolve_name(
                "." * node.level + node.module, module.__package__)
            for alias in node.names:
                try:
                    ns[alias.asname or alias.name] = getattr(importlib.import_module(base), alias.name)
                except (ImportError, AttributeError):
                    pass
    return ns


@dataclasses.dataclass
class _Checks:
    """What a class's methods say about its fields (paths relative to the class)."""

    allowed: dict[str, list] = dataclasses.field(default_factory=dict)
    literal: set[str] = dataclasses.field(default_factory=set)  # allowed values written out in the check
    mappings: dict[str, type] = dataclasses.field(default_factory=dict)  # key -> dataclass of its entries
    rule_params: set[str] = dataclasses.field(default_factory=set)  # fields holding a rule's parameters
    backend_options: set[str] = dataclasses.field(default_factory=set)  # fields checked per backend

    def add(self, field: str, values: list, literal: bool) -> None:
        """The first refusal of a field sets its allowed values; one that reads a named set (a tuple,
        a registry) replaces one written out as a literal."""
        if field not in self.allowed or (field in self.literal and not literal):
            self.allowed[field] = values
            self.literal.discard(field)
            if literal:
                self.literal.add(field)


def _scan(node: ast.AST, ns: dict[str, Any], checks: _Checks, conditions: tuple = ()) -> None:
    if isinstance(node, ast.If):
        _scan(node.test, ns, checks, conditions)
        for child in node.body + node.orelse:
            _scan(child, ns, checks, conditions + (node.test,))
        return
    if isinstance(node, ast.Raise) and _callee(node.exc) == "ConfigError":
        call = node.exc
        first = call.args[0] if call.args else None
        allowed = {k.arg: k.value for k in call.keywords}.get("allowed") or (
            call.args[2] if len(call.args) > 2 else None)
        if isinstance(first, ast.Constant) and isinstance(first.value, str) and allowed is not None:
            field = first.value
            if all(p == field for test in conditions for p in _self_paths(test)):
                try:
                    values = list(_evaluate(allowed, ns))
                except (_Unknown, TypeError):
                    values = None
                if values is not None:
                    checks.add(field, values, isinstance(allowed, (ast.Tuple, ast.List, ast.Constant)))
    name = _callee(node)
    if name == "from_dict" and len(node.args) >= 3 and isinstance(node.args[2], ast.JoinedStr):
        parts = node.args[2].values
        if (len(parts) == 2 and isinstance(parts[0], ast.Constant) and str(parts[0].value).endswith(".")
                and isinstance(parts[1], ast.FormattedValue)):
            try:
                target = _evaluate(node.args[0], ns)
            except _Unknown:
                target = None
            if dataclasses.is_dataclass(target):
                checks.mappings[parts[0].value[:-1]] = target
    elif name == "get_rule":
        checks.rule_params.update(p for k in node.keywords if k.arg is None and (p := _self_path(k.value)))
    elif name == "check_backend_options" and len(node.args) >= 2 and (p := _self_path(node.args[1])):
        checks.backend_options.add(p)
    for child in ast.iter_child_nodes(node):
        _scan(child, ns, checks, conditions)


@functools.lru_cache(maxsize=None)
def _checks(cls: type) -> _Checks:
    """The refusals, mapping sections and per-backend options in the methods of dataclass ``cls``."""
    checks = _Checks()
    parsed = _parse(cls)
    module = sys.modules[cls.__module__]
    for fn in parsed.node.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _scan(fn, _namespace(fn, module, {"cls": cls}), checks)
    return checks


def _function_checks(fn, extra: dict[str, Any], follow: bool = True) -> _Checks:
    """The refusals in function ``fn`` and, with ``follow``, in the module-level functions it calls."""
    checks = _Checks()
    node = _parse(fn).node
    module = sys.modules[fn.__module__]
    ns = _namespace(node, module, extra)
    _scan(node, ns, checks)
    if follow:
        for call in ast.walk(node):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                continue
            callee = ns.get(call.func.id)
            if inspect.isfunction(callee) and callee is not fn:
                for field, values in _function_checks(callee, {}, follow=False).allowed.items():
                    checks.add(field, values, False)
    return checks


def _moved_keys(loader) -> dict[str, str]:
    """Keys a loader refuses in favour of another (``{"rollout.drafter": "model.drafter"}``): a
    ``for key, where in (("drafter", "model.drafter"), ...)`` loop that raises
    ``ConfigError(f"rollout.{key}", ...)``."""
    if loader is None:
        return {}
    out = {}
    for node in ast.walk(_parse(loader).node):
        if not (isinstance(node, ast.For) and isinstance(node.target, ast.Tuple) and len(node.target.elts) == 2
                and isinstance(node.iter, (ast.Tuple, ast.List))):
            continue
        key_name = node.target.elts[0]
        pairs = [[e.value for e in t.elts] for t in node.iter.elts
                 if isinstance(t, ast.Tuple) and len(t.elts) == 2 and all(
                     isinstance(e, ast.Constant) and isinstance(e.value, str) for e in t.elts)]
        if not isinstance(key_name, ast.Name) or len(pairs) != len(node.iter.elts):
            continue
        for raise_ in (n for n in ast.walk(node) if isinstance(n, ast.Raise) and _callee(n.exc) == "ConfigError"):
            first = raise_.exc.args[0] if raise_.exc.args else None
            if (isinstance(first, ast.JoinedStr) and len(first.values) == 2
                    and isinstance(first.values[0], ast.Constant) and isinstance(first.values[1], ast.FormattedValue)
                    and isinstance(first.values[1].value, ast.Name) and first.values[1].value.id == key_name.id):
                out.update({f"{first.values[0].value}{key}": where for key, where in pairs})
    return out


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


def _section(tp: Any) -> type | None:
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


def _anchor(title: str) -> str:
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
        values = _checks(anc.cls).allowed.get(rel)
        if values is not None:
            return values
    return None


def _render_section(out: list[str], cls: type, path: str, ancestors: list[_Ancestor], moved: dict[str, str],
                    notes: list[str]) -> None:
    """The table of ``cls``'s plain fields at ``path``, then its sections (nested dataclasses and
    mappings of them) in field order."""
    summary, meanings, mentioned = _docs(cls)
    checks = _checks(cls)
    hints = typing.get_type_hints(cls)
    rows, sections = [], []
    for f in dataclasses.fields(cls):
        full = f"{path}.{f.name}" if path else f.name
        sub = _section(hints[f.name])
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
            cell = f"per backend: [backend options]({_anchor(BACKEND_TITLE)})"
        elif f.name in checks.rule_params:
            cell = f"per rule: [verification rules]({_anchor(RULES_TITLE)})"
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
            _render_section(out, sub, f"{full}.<name>", [], moved,
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
        _render_section(out, sub, full, inner, moved, sub_notes)


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
            sub = _section(hints[key])
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
    parsed = _parse(cls)
    blocks, current, last = [], [], None
    for row in sorted(parsed.comment_only):
        if last is not None and row != last + 1:
            blocks.append(" ".join(current))
            current = []
        current.append(parsed.comments[row])
        last = row
    if current:
        blocks.append(" ".join(current))
    docs = [ast.get_docstring(parsed.node) or "", inspect.getdoc(module) or ""]
    return blocks + [p for d in docs for p in inspect.cleandoc(d).split("\n\n") if p.strip()]


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
        out[option] = _clean(text)
    return out


def _balanced(text: str) -> bool:
    depth = 0
    for ch in text:
        depth += (ch == "(") - (ch == ")")
        if depth < 0:
            return False
    return depth == 0


def _render_backends(out: list[str]) -> None:
    out += [f"## {BACKEND_TITLE}", "",
            "The `backend_options` of a rollout section are read by the backend that `backend` names "
            "(`rollout.backend.BACKENDS`); each backend's `check_options` refuses other keys before anything "
            "starts.", ""]
    for name, cls, module in _backend_sources():
        check = getattr(cls, "check_options", None) or getattr(module, "check_options")
        checks = _function_checks(check, {"cls": cls})
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


def _render_rules(out: list[str]) -> None:
    from verifiers import RULES

    out += [f"## {RULES_TITLE}", "",
            "A verifier section names a rule of the `verifiers` registry (`verifiers.RULES`) and gives its "
            "parameters in `params`; a parameter left out takes the default below, an unknown one is refused.", "",
            "| Rule (`name`) | Parameters (`params`) with defaults | Class | What it does |", "|---|---|---|---|"]
    for name, cls in RULES.items():
        if not cls.__module__.startswith("verifiers."):  # one a test or an experiment registered at run time
            continue
        params = ", ".join(f"`{f.name}: {_yaml(_default(f))}`" for f in dataclasses.fields(cls)) or "none"
        doc = ast.get_docstring(_parse(cls).node) or ""
        first = doc.split("\n\n")[0]
        spans = _clauses(first)
        what = _clean(first[spans[0][0]:spans[0][1]]) if spans else ""
        out.append(f"| `{name}` | {params} | `{cls.__module__}.{cls.__qualname__}` | {_cell(what)} |")
    out.append("")


def render(kind_list: list[Kind] | None = None) -> str:
    """The Markdown of docs/configuration.md, from the dataclasses of ``kind_list`` (default :func:`kinds`)."""
    for cached in (_parse, _docs, _checks):  # read the code as it is now (a test may have patched it)
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
        out.append(f"- [{kind.title}]({_anchor(kind.title)}): " + (
            ", ".join(f"`{p}`" for p in _example_files(kind.root)) or "no file under configs/"))
    out += [f"- [Backend options]({_anchor(BACKEND_TITLE)})", f"- [Verification rules]({_anchor(RULES_TITLE)})", ""]
    for kind in kind_list:
        files = _example_files(kind.root)
        out += [f"## {kind.title}", "",
                f"Root: `{kind.root.__module__}.{kind.root.__qualname__}`, read by {kind.reader} "
                f"(`{kind.command}`). Files of this kind: "
                + (", ".join(f"`{p}`" for p in files) or "none under configs/") + ".", ""]
        _render_section(out, kind.root, "", [], _moved_keys(kind.loader), [])
    _render_backends(out)
    _render_rules(out)
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


if __name__ == "__main__":
    sys.exit(main())
