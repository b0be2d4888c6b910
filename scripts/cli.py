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


def batch_sizes(text: str) -> str:
    """A comma list of positive batch sizes, kept as written."""
    try:
        sizes = [int(b) for b in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a comma list of integers, got {text!r}") from None
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"batch sizes must be >= 1, got {text!r}")
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
