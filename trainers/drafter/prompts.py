"""Drafter prompts from a JSONL file: what the target answers to make the drafter's data.

Vocabulary:
- **prompt file**: UTF-8 JSONL, one JSON object per non-blank line, either
  ``{"prompt": "text"}`` (one user message) or ``{"messages": [{"role": ..., "content": ...}, ...]}``
  (a conversation; roles ``system``, ``user``, ``assistant``, ``tool``). An optional
  ``"kind": "name"`` labels the record in the held-out report (default ``"file"``).
- **conversation**: the messages the target answers. Trailing ``assistant`` messages are
  dropped (the target writes its own answer: the drafter learns the target's responses), so a
  conversation must hold a non-assistant message; earlier assistant turns stay as context.
- **split**: a seeded share of the records (``heldout_fraction``, at least one when the share
  is positive) is held out for evaluation and the draft-temperature calibration.

A record that does not read raises :class:`PromptFileError`, whose message names the file and
the line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ROLES = ("system", "user", "assistant", "tool")
DEFAULT_KIND = "file"


class PromptFileError(ValueError):
    """A prompt file or one of its records is unusable; the message names the file and line."""


@dataclass(frozen=True)
class PromptRecord:
    """One record of a prompt file: the conversation the target answers, its label and its line."""

    messages: tuple[dict[str, str], ...]
    kind: str
    line: int


def read_prompt_file(path: str | Path) -> list[PromptRecord]:
    """Every record of the JSONL file at ``path`` (blank lines skipped), in file order."""
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"{path}: prompt file not found")
    records = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if line.strip():
                records.append(_record(path, line_no, line))
    if not records:
        raise PromptFileError(f"{path}: no records (need JSON objects with 'prompt' or 'messages', one per line)")
    return records


def _record(path: Path, line_no: int, line: str) -> PromptRecord:
    where = f"{path}:{line_no}"
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise PromptFileError(f"{where}: not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(obj, dict):
        raise PromptFileError(f"{where}: a record must be a JSON object, got {type(obj).__name__}")
    kind = obj.get("kind", DEFAULT_KIND)
    if not isinstance(kind, str) or not kind:
        raise PromptFileError(f"{where}: 'kind' must be a non-empty string, got {kind!r}")
    if ("prompt" in obj) == ("messages" in obj):
        raise PromptFileError(f"{where}: a record needs exactly one of 'prompt' (a string) or 'messages' "
                              f"(a list of {{'role', 'content'}}), got keys {sorted(obj)}")
    if "prompt" in obj:
        text = obj["prompt"]
        if not isinstance(text, str) or not text.strip():
            raise PromptFileError(f"{where}: 'prompt' must be a non-empty string, got {text!r}")
        return PromptRecord(({"role": "user", "content": text},), kind, line_no)
    return PromptRecord(_conversation(where, obj["messages"]), kind, line_no)


def _conversation(where: str, messages) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise PromptFileError(f"{where}: 'messages' must be a non-empty list, got {messages!r}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise PromptFileError(f"{where}: messages[{i}] must be an object with string 'role' and 'content', "
                                  f"got {m!r}")
        if m["role"] not in ROLES:
            raise PromptFileError(f"{where}: messages[{i}] has role {m['role']!r} (allowed: {', '.join(ROLES)})")
        out.append({"role": m["role"], "content": m["content"]})
    while out and out[-1]["role"] == "assistant":
        out.pop()
    if not out:
        raise PromptFileError(f"{where}: 'messages' holds only assistant messages: nothing for the target to answer")
    return tuple(out)


def split_records(records: list[PromptRecord], heldout_fraction: float, gen: torch.Generator,
                  source: str | Path = "the prompt file") -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, held-out): a random ``heldout_fraction`` of ``records`` (drawn with ``gen``; at least
    one record when the fraction is positive, at least one left to train on), each in file order;
    ``source`` names the file in the error."""
    n = len(records)
    held = 0 if heldout_fraction <= 0 else max(1, round(heldout_fraction * n))
    if held >= n:
        raise PromptFileError(f"{source}: {n} record(s) leave none to train on after holding out "
                              f"{held} (heldout_fraction {heldout_fraction}); add records or lower heldout_fraction")
    chosen = set(torch.randperm(n, generator=gen)[:held].tolist())
    return ([r for i, r in enumerate(records) if i not in chosen], [r for i, r in enumerate(records) if i in chosen])
