"""Fixtures for the training-loop tests: a config file and one local Ray for the module
(the tiny policy and head fixtures live in tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml


def dump_merged(path: Path, cfg: dict, sections: dict) -> Path:
    """Write ``cfg`` as YAML to ``path``, each of ``sections`` ({section: {field: value}}) merged
    over the section of that name."""
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    path.write_text(yaml.safe_dump(cfg))
    return path


def write_config(path: Path, policy: Path, head: Path | None, out_dir: Path, **sections) -> Path:
    cfg = {
        "run": {"out_dir": str(out_dir), "steps": 2, "seed": 3, "checkpoint_every": 1},
        "model": {"target": {"path": str(policy)}, "drafter": str(head) if head else None},
        "rollout": {"num_actors": 1, "threads_per_actor": 1,
                    "sampling": {"temperature": 1.0, "max_new_tokens": 12},
                    "spec": {"mode": "chain", "num_draft_tokens": 3},
                    "verifier": {"name": "mars", "params": {"theta": 0.5}}},
        "task": {"source": "arithmetic", "difficulty": 1, "prompts_per_step": 2},
        "grpo": {"group_size": 3},
        "correction": {"mode": "token_tis", "cap": 2.0},
        "optim": {"lr": 1e-3, "micro_batch": 4},
        "ray": {"num_cpus": 2},
    }
    return dump_merged(path, cfg, sections)


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def model_and_optimizer(seed: int = 0):
    """A tiny linear model and its AdamW optimizer after one step (a state with moments to save)."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return model, opt
