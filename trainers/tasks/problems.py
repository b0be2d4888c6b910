"""A task problem, its exact answer, and problems loaded from a JSONL file.

Vocabulary:
- **problem**: one prompt (the user message) with its exact answer, a difficulty level and
  the split it belongs to. ``answer`` is an integer or finite decimal string ("42", "12.5").
- **canonical answer**: the form :func:`normalize_answer` gives ('1,000' -> '1000',
  '12.50' -> '12.5'); generated problems (``trainers.tasks.arithmetic``) and rewards
  (``trainers.tasks.rewards``) use it too.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

ANSWER_INSTRUCTION = "End your reply with 'Answer: <number>'."


@dataclass(frozen=True)
class Problem:
    id: str
    prompt: str  # the user message, including the answer-format instruction
    answer: str  # exact integer or decimal string
    difficulty: int  # 1..4 for generated problems; 0 for loaded ones
    split: str
    expression: str = ""  # the filled-in arithmetic that answers it (generated problems)


def format_number(x: Fraction) -> str | None:
    """'42' or '12.5' for a finite decimal; None if x has no finite decimal expansion."""
    if x.denominator == 1:
        return str(x.numerator)
    den = x.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return None
    text = format(Decimal(x.numerator) / Decimal(x.denominator), "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def normalize_answer(text: str) -> str | None:
    """Canonical form of a numeric answer string ('1,000' -> '1000', '12.50' -> '12.5')."""
    text = text.strip().lstrip("$").strip()
    if not _NUMBER.fullmatch(text):
        return None
    value = Fraction(Decimal(text.replace(",", "")))
    return format_number(value) if value >= 0 else "-" + format_number(-value)


def _record_to_problem(record: object, where: str, index: int, split: str) -> Problem:
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "question" in record:
        prompt = f"{record['question']} {ANSWER_INSTRUCTION}"
    elif "prompt" in record:
        prompt = record["prompt"]
    else:
        raise ValueError(f"{where}: a record needs 'question' or 'prompt' (keys: {sorted(record)})")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"{where}: the prompt/question must be a non-empty string")
    if "answer" not in record:
        raise ValueError(f"{where}: missing 'answer'")
    raw = record["answer"]
    if isinstance(raw, bool) or not isinstance(raw, (str, int, float)):
        raise ValueError(f"{where}: 'answer' must be a string or a number, got {raw!r}")
    raw = str(raw)
    if "####" in raw:  # GSM8K: reasoning, then '#### <final answer>'
        raw = raw.rsplit("####", 1)[1]
    answer = normalize_answer(raw)
    if answer is None:
        raise ValueError(f"{where}: the answer {raw.strip()!r} is not a number")
    return Problem(id=str(record.get("id", f"{split}-{index}")), prompt=prompt, answer=answer,
                   difficulty=int(record.get("difficulty", 0)), split=split)


def load_jsonl(path: str | Path, split: str = "user") -> list[Problem]:
    """Problems from a JSONL file: GSM8K records {"question", "answer": "... #### 42"} or
    {"prompt", "answer"}. A question gets the answer-format instruction appended; a prompt
    is used verbatim. Blank lines are skipped; a bad record raises ValueError naming its line.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"problem file not found: {path}")
    problems = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{where}: invalid JSON ({err.msg})") from None
        problems.append(_record_to_problem(record, where, lineno, split))
    return problems
