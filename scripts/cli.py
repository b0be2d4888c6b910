"""Argument types the command-line scripts share: bad values are refused by argparse, naming
the flag, before any model loads."""

from __future__ import annotations

import argparse
from pathlib import Path


def head_folder(text: str) -> str:
    """An EAGLE-3 head folder (one with a ``config.json``)."""
    if not (Path(text) / "config.json").is_file():
        raise argparse.ArgumentTypeError(f"no EAGLE-3 head (config.json) at {text!r}")
    return text


def checkpoint_folder(text: str) -> str:
    """A training checkpoint folder (``runs/NAME/checkpoints/step_N``: ``state.json`` and
    ``policy.safetensors``)."""
    missing = [f for f in ("state.json", "policy.safetensors") if not (Path(text) / f).is_file()]
    if missing:
        raise argparse.ArgumentTypeError(f"no training checkpoint at {text!r} (no {' or '.join(missing)}; "
                                         "expected a folder like runs/NAME/checkpoints/step_000004)")
    return text


def positive_ints(text: str, what: str = "values") -> list[int]:
    """A comma list of integers >= 1 (``what`` names them in the refusal)."""
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what} must be >= 1, got {text!r}")
    return values


def batch_sizes(text: str) -> str:
    """A comma list of positive batch sizes, kept as written."""
    positive_ints(text, "batch sizes")
    return text


def positive_int(text: str) -> int:
    """An integer >= 1 (thread counts, step numbers)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value
