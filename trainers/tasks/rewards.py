"""Rewards: parse the final answer of a completion and compare it with the exact answer.

Vocabulary:
- **final answer**: the number a completion commits to. Markers are tried in order of
  preference, the last occurrence of each winning: "Answer: N" (also "answer is N"),
  "#### N" (GSM8K), "\\boxed{N}"; without any marker, the last number in the text.
- **exact-match reward**: 1.0 when the final answer equals the reference numerically
  ("12.50" == "12.5", "1,000" == "1000"), else 0.0.
- **format bonus** (optional, default 0): added when the completion uses an explicit
  marker, so that a model can be nudged towards a parseable answer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from rollout.config import ConfigError
from trainers.tasks.problems import normalize_answer

# A number: optional sign (not when glued to a preceding word, digit or ')', so "5-3"
# reads as 5 and 3), thousands groups "1,234" or plain digits, optional decimals.
_NUM = r"(?:(?<![\w)])[-+])?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?"
_NUMBER = re.compile(_NUM)
_MARKERS = (
    re.compile(r"answer\s*(?:is|:|=)?\s*[:=]?\s*\**\s*\$?\s*(" + _NUM + ")", re.IGNORECASE),
    re.compile(r"####\s*\$?\s*(" + _NUM + ")"),
    re.compile(r"\\boxed\{\s*\$?\s*(" + _NUM + r")\s*\}"),
)


def _last(pattern: re.Pattern, text: str) -> str | None:
    matches = list(pattern.finditer(text))
    if not matches:
        return None
    return matches[-1].group(1) if pattern.groups else matches[-1].group(0)


def find_marked_answer(text: str) -> str | None:
    """The raw number after the preferred explicit marker, or None if none is present."""
    for pattern in _MARKERS:
        found = _last(pattern, text)
        if found is not None:
            return found
    return None


def parse_final_answer(text: str) -> str | None:
    """The completion's final answer in canonical form ('-3', '1000', '12.5'), or None."""
    raw = find_marked_answer(text)
    if raw is None:
        raw = _last(_NUMBER, text)
    return None if raw is None else normalize_answer(raw)


def _same_number(a: str, b: str) -> bool:
    try:
        return Decimal(a) == Decimal(b)
    except InvalidOperation:
        return False


def exact_match_reward(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer equals ``answer`` numerically, else 0.0."""
    reference = normalize_answer(answer)
    if reference is None:
        raise ValueError(f"reference answer {answer!r} is not a number")
    parsed = parse_final_answer(completion)
    return 1.0 if parsed is not None and _same_number(parsed, reference) else 0.0


@dataclass(frozen=True)
class RewardConfig:
    format_bonus: float = 0.0  # added when an explicit answer marker is present; in [0, 1)

    def __post_init__(self):
        if not isinstance(self.format_bonus, (int, float)) or not 0.0 <= self.format_bonus < 1.0:
            raise ConfigError("format_bonus", f"must be in [0, 1), got {self.format_bonus!r}")


def answer_reward(completion: str, answer: str, cfg: RewardConfig = RewardConfig()) -> float:
    """Exact-match reward plus ``cfg.format_bonus`` when the answer is explicitly marked."""
    reward = exact_match_reward(completion, answer)
    if cfg.format_bonus and find_marked_answer(completion) is not None:
        reward += cfg.format_bonus
    return reward
