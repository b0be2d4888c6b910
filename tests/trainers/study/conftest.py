"""A tiny study for the study tests: the tiny policy and head, two settings, short runs."""

from __future__ import annotations

from pathlib import Path

from tests.trainers.conftest import dump_merged


def write_study(path: Path, policy: Path, head: Path | None, out_dir: Path, settings: dict | None = None,
                **sections) -> Path:
    """A study YAML over the tiny policy: 2 steps (a checkpoint each), evaluations every step on
    2 + 2 held-out problems at T = 0 and 1; ``settings`` (default: lossless and overshoot with
    token TIS) and ``sections`` ({"study": {...}, "eval": {...}, "train": {...}}) are merged in."""
    cfg = {
        "study": {"out_dir": str(out_dir), "seeds": [0], "reference": "lossless", "bootstrap_draws": 200},
        "eval": {"every": 1, "difficulties": [1, 2], "problems_per_difficulty": 2, "temperatures": [0.0, 1.0],
                 "max_new_tokens": 8, "seed": 1, "batch_size": 4},
        "settings": settings or {
            "lossless": {"verifier": {"name": "lossless"}, "correction": {"mode": "none"}},
            "overshoot_tis": {"verifier": {"name": "overshoot", "params": {"lenience": 0.3}},
                              "correction": {"mode": "token_tis", "cap": 2.0}},
        },
        "train": {
            "run": {"steps": 2, "checkpoint_every": 1, "keep_checkpoints": None},
            "model": {"target": {"path": str(policy)}, "drafter": str(head) if head else None},
            "rollout": {"num_actors": 1, "threads_per_actor": 1, "sampling": {"temperature": 1.0, "max_new_tokens": 8},
                        "spec": {"mode": "chain", "num_draft_tokens": 3} if head else {"mode": "off"}},
            "task": {"source": "arithmetic", "difficulty": 1, "prompts_per_step": 2},
            "grpo": {"group_size": 2},
            "optim": {"lr": 1e-3, "micro_batch": 4},
            "ray": {"num_cpus": 2},
        },
    }
    return dump_merged(path, cfg, sections)
