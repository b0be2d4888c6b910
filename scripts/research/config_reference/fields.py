"""The meaning of each config field, read from the source of its dataclass.

A field's meaning is, in this order: the ``# comment`` after the field; else its ``name: meaning``
clause in the class docstring; else the comment lines right above the field; else the first
docstring clause that mentions it (shown as such); else nothing. A field inherited from a base
class is read from the class that declares it. :func:`parse` (a definition with its comments) and
the docstring splitting (:func:`clauses`, :func:`clean`) also serve the other modules.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import re
import textwrap
import tokenize


@dataclasses.dataclass(frozen=True)
class _Parsed:
    node: ast.AST  # the class or function definition
    comments: dict[int, str]  # line -> the comment's text on that line
    comment_only: frozenset[int]  # lines holding nothing but a comment


@functools.lru_cache(maxsize=None)
def parse(obj) -> _Parsed:
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


def clean(text: str) -> str:
    """One line of Markdown from docstring text: RST roles as code spans, whitespace collapsed,
    trailing punctuation dropped."""
    text = re.sub(r":(?:func|class|data|mod|meth|attr|obj):`~?([^`]+)`", r"`\1`", text)
    return re.sub(r"\s+", " ", text).strip().rstrip(".;,:").strip()


def clauses(text: str) -> list[tuple[int, int]]:
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
        return clean(text.split("\n\n")[0]), {}, text
    one = _one(names)
    label = re.compile(rf"(?:^|(?<=\n)|(?<=[.;] ))(?P<names>{one}(?:(?:,\s*|\s*/\s*|\s+and\s+){one})*):(?=\s)")
    matches = list(label.finditer(text))
    first = matches[0].start() if matches else len(text)
    summary = clean(text[:first].split("\n\n")[0])
    starts = re.compile(rf"^\s*{one}")
    meanings: dict[str, str] = {}
    for i, m in enumerate(matches):
        end = matches[i + 1].start() if i + 1 < len(matches) else len(text)
        segment = text[m.end():end]
        cut = len(segment)
        for a, b in clauses(segment):
            if a > 0 and (starts.match(segment[a:b]) or segment[a:b].startswith("\n\n")):
                cut = a
                break
        meaning = clean(segment[:cut])
        for name in re.findall(r"\w+", m.group("names")):
            if name in names and name not in meanings:
                meanings[name] = meaning
    return summary, meanings, text


def _mentioned_in(text: str, name: str) -> str | None:
    """The first docstring clause that mentions ``name``."""
    pattern = _mentions(name)
    for a, b in clauses(text):
        if pattern.search(text[a:b]):
            return clean(text[a:b])
    return None


@functools.lru_cache(maxsize=None)
def docs(cls: type) -> tuple[str, dict[str, str], frozenset[str]]:
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
        parsed = parse(klass)
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
                out[name] = clean(trailing)
            elif name in labelled:
                out[name] = labelled[name]
            elif above:
                out[name] = clean(above)
            elif text and (clause := _mentioned_in(text, name)):
                out[name] = f"(mentioned in the class docstring:) {clause}"
                mentioned.add(name)
    return summary, out, frozenset(mentioned)
