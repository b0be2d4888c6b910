"""Procedural arithmetic word problems with exact answers.

Vocabulary (a **problem** is ``trainers.tasks.problems.Problem``):
- **template**: a story with named number slots and the arithmetic ``expression`` over
  those slots that answers it. Every generated problem keeps its filled-in expression, so
  tests (and users) can recompute the answer independently of the generator.
- **difficulty** 1..4: 1 = one small addition/subtraction (single-digit operands, so that
  SmolLM2-135M gets some right and GRPO has signal), 2 = two steps, 3 = a multiplication
  or three steps, 4 = mixed operations with larger numbers, division and decimals.
- **canonical key**: (template, numbers). Names and objects are decoration, not part of
  the key. A key's split is a fixed function of its hash, so the held-out split is
  disjoint from train by construction for every seed, and within one list no key repeats.

Simplifications: answers are never negative (every intermediate value is >= 0) and
integer unless the template is marked decimal; English only.
"""

from __future__ import annotations

import ast
import hashlib
import random
import re
from dataclasses import dataclass, field
from fractions import Fraction

from trainers.tasks.problems import ANSWER_INSTRUCTION, Problem, format_number

DIFFICULTIES = (1, 2, 3, 4)
SPLITS = ("train", "heldout")
HELDOUT_PER_MILLE = 200  # 20% of canonical keys belong to the held-out split
_MAX_STALE_DRAWS = 20_000

NAMES = ("Mia", "Leo", "Ava", "Noah", "Zoe", "Omar", "Lily", "Sam", "Nina", "Raj",
         "Emma", "Ben", "Sofia", "Ivan", "Kate", "Yuki", "Ana", "Tom", "Lena", "Max")
ITEMS = ("apples", "marbles", "stickers", "pencils", "books", "cards", "shells", "stamps",
         "coins", "toy cars", "oranges", "crayons", "beads", "rocks", "balloons", "buttons")


@dataclass(frozen=True)
class _Template:
    text: str  # slots: {name} {name2} {name3} {item} and number slots
    expression: str  # over the sampled and derived number slots
    ranges: dict[str, tuple[int, ...]]  # 2 values: (lo, hi) inclusive; 3 or more: choices
    derived: dict[str, str] = field(default_factory=dict)  # slot -> expression
    decimal: bool = False  # allow non-integer (finite decimal) values


def _t(text, expression, derived=None, decimal=False, **ranges):
    return _Template(text, expression, ranges, derived or {}, decimal)


_ADD1 = {"a": (2, 12), "b": (2, 9)}
_SUB1 = {"a": (5, 19), "b": (2, 9)}
_TWO = {"a": (6, 20), "b": (1, 10), "c": (1, 10)}

TEMPLATES: dict[int, tuple[_Template, ...]] = {
    1: (
        _t("{name} has {a} {item}. {name2} gives {name} {b} more. How many {item} does {name} have now?", "a + b", **_ADD1),
        _t("There are {a} {item} in a box. {name} puts in {b} more. How many {item} are in the box now?", "a + b", **_ADD1),
        _t("{name} picked {a} {item} in the morning and {b} {item} in the afternoon. How many {item} did {name} pick in total?", "a + b", **_ADD1),
        _t("A shelf holds {a} red {item} and {b} blue {item}. How many {item} are on the shelf?", "a + b", **_ADD1),
        _t("{name} scored {a} points in the first game and {b} points in the second game. How many points did {name} score altogether?", "a + b", **_ADD1),
        _t("{name} is {a} years old. How old will {name} be in {b} years?", "a + b", **_ADD1),
        _t("{name} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {name} read in the two days?", "a + b", **_ADD1),
        _t("{name} saw {a} birds in a tree, and then {b} more birds landed there. How many birds are in the tree now?", "a + b", **_ADD1),
        _t("{name} has {a} {item} in one pocket and {b} {item} in another pocket. How many {item} does {name} have?", "a + b", **_ADD1),
        _t("{name} had {a} dollars and spent {b} dollars on a snack. How many dollars does {name} have left?", "a - b", **_SUB1),
        _t("{name} had {a} {item}. {name} gave {b} of them to {name2}. How many {item} does {name} have left?", "a - b", **_SUB1),
        _t("There were {a} {item} on the table. {name} took {b} away. How many {item} are still on the table?", "a - b", **_SUB1),
        _t("{name} has {a} {item} and {name2} has {b} {item}. How many more {item} does {name} have than {name2}?", "a - b", **_SUB1),
        _t("A bag had {a} {item}. Then {b} of them fell out. How many {item} are in the bag now?", "a - b", **_SUB1),
        _t("{name} needs {a} {item} for a project and already has {b}. How many more {item} does {name} need?", "a - b", **_SUB1),
    ),
    2: (
        _t("{name} had {a} {item}. {name} bought {b} more and then gave {c} to {name2}. How many {item} does {name} have now?", "a + b - c", **_TWO),
        _t("A bus had {a} passengers. At the first stop {b} people got off and {c} people got on. How many passengers are on the bus now?", "a - b + c", **_TWO),
        _t("{name} has {a} {item}, {name2} has {b} {item}, and {name3} has {c} {item}. How many {item} do they have together?", "a + b + c", **_TWO),
        _t("{name} baked {a} cookies. {name} ate {b} and {name2} ate {c}. How many cookies are left?", "a - b - c", **_TWO),
        _t("{name} has {a} {item}. {name2} has {b} more {item} than {name}. How many {item} do they have in total?", "a + (a + b)", a=(3, 15), b=(1, 9)),
        _t("A farmer collected {a} eggs on Monday and {b} eggs on Tuesday. Then {c} eggs broke. How many unbroken eggs does the farmer have?", "a + b - c", **_TWO),
        _t("{name} saved {a} dollars, earned {b} dollars more, then spent {c} dollars on a gift. How many dollars does {name} have now?", "a + b - c", **_TWO),
        _t("There are {a} {item} in one basket and {b} fewer in a second basket. How many {item} are in both baskets?", "a + (a - b)", a=(5, 15), b=(1, 9)),
    ),
    3: (
        _t("{name} buys {a} packs of {item}. Each pack has {b} {item}. How many {item} does {name} buy?", "a * b", a=(2, 9), b=(2, 9)),
        _t("A classroom has {a} rows of desks with {b} desks in each row. How many desks are there?", "a * b", a=(2, 9), b=(2, 9)),
        _t("{name} earns {a} dollars per hour and works {b} hours, then spends {c} dollars. How many dollars does {name} have left?", "a * b - c", a=(3, 12), b=(2, 8), c=(1, 20)),
        _t("{name} has {a} boxes with {b} {item} in each box, plus {c} loose {item}. How many {item} does {name} have?", "a * b + c", a=(2, 9), b=(2, 9), c=(1, 9)),
        _t("{name} had {a} {item}, got {b} more, gave away {c}, and then found {d}. How many {item} does {name} have now?", "a + b - c + d", a=(5, 20), b=(1, 10), c=(1, 10), d=(1, 10)),
        _t("A store had {a} {item}. It sold {b} in the morning and {c} in the afternoon, then received {d} more. How many {item} does the store have now?", "a - b - c + d", a=(15, 40), b=(1, 10), c=(1, 10), d=(1, 15)),
        _t("Each of {a} friends brings {b} {item} to a party, and {name} brings {c} extra. How many {item} are at the party?", "a * b + c", a=(2, 9), b=(2, 6), c=(1, 9)),
        _t("{name} runs {a} kilometers each day for {b} days, and then {c} kilometers on the last day. How many kilometers does {name} run in total?", "a * b + c", a=(2, 9), b=(2, 7), c=(1, 9)),
        _t("A baker makes {a} trays of muffins with {b} muffins on each tray. Then {c} muffins are sold. How many muffins are left?", "a * b - c", a=(2, 9), b=(3, 9), c=(1, 15)),
    ),
    4: (
        _t("{name} buys {a} {item} at {b} dollars each and pays with a {c}-dollar bill. How much change does {name} get?", "c - a * b", a=(3, 12), b=(4, 15), c=(50, 100, 200)),
        _t("A school has {n} students split equally into {b} classes. Each class then gets {c} new students. How many students are in each class now?", "n / b + c", derived={"n": "b * k"}, b=(3, 12), k=(15, 40), c=(2, 9)),
        _t("A factory makes {a} {item} per day, but {c} of them each day are defective and thrown away. How many good {item} does it make in {b} days?", "(a - c) * b", a=(50, 300), b=(3, 14), c=(2, 40)),
        _t("{name} has {n} dollars, spends a quarter of it on books and {b} dollars on lunch. How many dollars does {name} have left?", "n - n / 4 - b", derived={"n": "4 * k"}, k=(20, 90), b=(5, 40)),
        _t("Tickets cost {p} dollars for adults and {q} dollars for children. A group of {a} adults and {b} children buys tickets. What is the total cost in dollars?", "a * p + b * q", p=(8, 30), q=(3, 15), a=(2, 15), b=(2, 20)),
        _t("{name} drives at {a} kilometers per hour for {b} hours, then at {c} kilometers per hour for {d} hours. How many kilometers does {name} drive in total?", "a * b + c * d", a=(40, 120), b=(2, 6), c=(30, 90), d=(1, 5)),
        _t("A notebook costs {p} dollars and a pen costs {q} dollars. {name} buys {a} notebooks and {b} pens. How many dollars does {name} spend?", "a * p + b * q", derived={"p": "h / 2", "q": "g / 4"}, decimal=True, h=(3, 15), g=(3, 11), a=(2, 12), b=(2, 12)),
        _t("{name} has {a} {item} and buys {b} packs of {c}. {name} splits all of them equally into {d} bags. How many {item} are in each bag?", "(a + b * c) / d", a=(10, 90), b=(2, 9), c=(6, 24), d=(2, 8)),
    ),
}

_OPS = {ast.Add: lambda x, y: x + y, ast.Sub: lambda x, y: x - y,
        ast.Mult: lambda x, y: x * y, ast.Div: lambda x, y: x / y}


def evaluate(expression: str, values: dict[str, Fraction] | None = None) -> Fraction:
    """Exact value of an arithmetic expression (+ - * / parentheses, numbers, named slots).

    Raises ValueError if any intermediate value is negative (the stories cannot say so).
    """
    values = values or {}

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return Fraction(str(node.value))
        if isinstance(node, ast.Name) and node.id in values:
            return values[node.id]
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            right = ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError(f"division by zero in {expression!r}")
            out = _OPS[type(node.op)](ev(node.left), right)
            if out < 0:
                raise ValueError(f"negative intermediate value in {expression!r}")
            return out
        raise ValueError(f"unsupported element {ast.dump(node)} in {expression!r}")

    return ev(ast.parse(expression, mode="eval"))


def _sample(rng: random.Random, tpl: _Template) -> dict[str, Fraction] | None:
    """Draw the number slots; None if a constraint (integer, non-negative) fails."""
    vals = {}
    for name, spec in tpl.ranges.items():
        v = rng.randint(spec[0], spec[1]) if len(spec) == 2 else rng.choice(spec)
        vals[name] = Fraction(v)
    try:
        for name, expr in tpl.derived.items():
            vals[name] = evaluate(expr, vals)
        result = evaluate(tpl.expression, vals)
    except ValueError:
        return None
    if result <= 0 or format_number(result) is None:
        return None
    if not tpl.decimal and any(v.denominator != 1 for v in (*vals.values(), result)):
        return None
    return vals


def _key_digest(difficulty: int, index: int, vals: dict[str, Fraction], sampled: dict) -> str:
    key = f"{difficulty}|{index}|" + ",".join(f"{k}={vals[k]}" for k in sorted(sampled))
    return hashlib.sha256(key.encode()).hexdigest()


def split_of(digest: str) -> str:
    """The split a canonical key belongs to (fixed by its hash, independent of any seed)."""
    return "heldout" if int(digest[:8], 16) % 1000 < HELDOUT_PER_MILLE else "train"


def _fill(expression: str, vals: dict[str, Fraction]) -> str:
    return re.sub(r"[A-Za-z_]\w*", lambda m: format_number(vals[m.group(0)]), expression)


def _render(rng: random.Random, tpl: _Template, vals: dict[str, Fraction]) -> str:
    name, name2, name3 = rng.sample(NAMES, 3)
    slots = {k: format_number(v) for k, v in vals.items()}
    return tpl.text.format(name=name, name2=name2, name3=name3, item=rng.choice(ITEMS), **slots)


def make_problems(n: int, difficulty: int, split: str = "train", seed: int = 0) -> list[Problem]:
    """``n`` distinct problems of one difficulty from one split, deterministic given ``seed``.

    Train and held-out never share a canonical key, whatever the seeds. Raises ValueError
    when the level's key space cannot supply ``n`` distinct problems for the split.
    """
    if difficulty not in DIFFICULTIES:
        raise ValueError(f"difficulty must be one of {DIFFICULTIES}, got {difficulty!r}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    rng = random.Random(f"arith:{seed}:{difficulty}:{split}")
    templates = TEMPLATES[difficulty]
    seen: set[str] = set()
    out: list[Problem] = []
    stale = 0  # draws since the last new problem; the key space is exhausted when it grows
    while len(out) < n:
        stale += 1
        if stale > _MAX_STALE_DRAWS:
            raise ValueError(f"difficulty {difficulty}: could not draw {n} distinct {split} "
                             f"problems (got {len(out)}); ask for fewer")
        index = rng.randrange(len(templates))
        tpl = templates[index]
        vals = _sample(rng, tpl)
        if vals is None:
            continue
        digest = _key_digest(difficulty, index, vals, tpl.ranges)
        if digest in seen or split_of(digest) != split:
            continue
        seen.add(digest)
        stale = 0
        question = _render(rng, tpl, vals)
        out.append(Problem(
            id=f"d{difficulty}-t{index:02d}-{digest[:12]}",
            prompt=f"{question} {ANSWER_INSTRUCTION}",
            answer=format_number(evaluate(tpl.expression, vals)),
            difficulty=difficulty,
            split=split,
            expression=_fill(tpl.expression, vals),
        ))
    return out
