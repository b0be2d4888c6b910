"""The allowed values of config fields, found by scanning the validators' source.

A field's allowed values are those of a refusal ``ConfigError(<field>, ..., allowed=X)`` in a
method of its dataclass under conditions that read that field alone (a refusal that depends on
another field is not a fixed set), where ``X`` evaluates without running anything: a constant, a
module-level name, an attribute of one, ``a + b`` or ``sorted/list/tuple(x)``. The same scan finds
the sections that are mappings of a dataclass (``from_dict(X, ..., f"key.{name}")``), the fields
holding a rule's parameters (``get_rule(..., **self.x)``) and those checked per backend
(``check_backend_options(..., self.x)``), and :func:`moved_keys` reads the keys a loader refuses
in favour of another section's.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import sys
from typing import Any

from .fields import parse


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
def class_checks(cls: type) -> _Checks:
    """The refusals, mapping sections and per-backend options in the methods of dataclass ``cls``."""
    checks = _Checks()
    parsed = parse(cls)
    module = sys.modules[cls.__module__]
    for fn in parsed.node.body:
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            _scan(fn, _namespace(fn, module, {"cls": cls}), checks)
    return checks


def function_checks(fn, extra: dict[str, Any], follow: bool = True) -> _Checks:
    """The refusals in function ``fn`` and, with ``follow``, in the module-level functions it calls."""
    checks = _Checks()
    node = parse(fn).node
    module = sys.modules[fn.__module__]
    ns = _namespace(node, module, extra)
    _scan(node, ns, checks)
    if follow:
        for call in ast.walk(node):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)):
                continue
            callee = ns.get(call.func.id)
            if inspect.isfunction(callee) and callee is not fn:
                for field, values in function_checks(callee, {}, follow=False).allowed.items():
                    checks.add(field, values, False)
    return checks


def moved_keys(loader) -> dict[str, str]:
    """Keys a loader refuses in favour of another (``{"rollout.drafter": "model.drafter"}``): a
    ``for key, where in (("drafter", "model.drafter"), ...)`` loop that raises
    ``ConfigError(f"rollout.{key}", ...)``."""
    if loader is None:
        return {}
    out = {}
    for node in ast.walk(parse(loader).node):
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
