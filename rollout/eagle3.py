"""The EAGLE-3 draft head's public names: the model (``rollout.eagle3_head``), its
checkpoint formats (``rollout.eagle3_io``) and the head shipped for the embedded target."""

from __future__ import annotations

from pathlib import Path

from rollout.eagle3_head import DraftOutput, Eagle3Config, Eagle3Head, causal_mask
from rollout.eagle3_io import HeadMismatchError, load_eagle3, read_eagle3_config, save_eagle3

__all__ = ["DraftOutput", "Eagle3Config", "Eagle3Head", "HeadMismatchError", "causal_mask", "default_head_path",
           "load_eagle3", "read_eagle3_config", "save_eagle3"]


def default_head_path() -> Path:
    """The shipped head for the embedded SmolLM2-135M-Instruct."""
    return Path(__file__).resolve().parent / "heads" / "smollm2-135m-eagle3"
