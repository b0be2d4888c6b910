"""Fixtures for the training-loop tests: a tiny random policy with the real SmolLM2
tokenizer (read from the packaged GGUF, no model conversion), a random EAGLE-3 head for
it, a config file, and one local Ray for the module."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml


def build_tiny_policy(out: Path) -> Path:
    """A random 4-layer Llama with the real SmolLM2 tokenizer, saved as a HF folder."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from rollout.models import embedded_gguf_path

    gguf = embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      tie_word_embeddings=True, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def build_tiny_head(policy_dir: Path, out: Path) -> Path:
    """A random EAGLE-3 head for the tiny policy whose lm_head is the target's."""
    from rollout.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
    from rollout.models import TargetConfig, load_target

    target, _ = load_target(TargetConfig(path=str(policy_dir)))
    torch.manual_seed(1)
    cfg = Eagle3Config.for_target(target)
    head = Eagle3Head(cfg, target.embed_tokens)
    with torch.no_grad():  # share the target's output embedding: a drafter that sometimes agrees
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight)
    save_eagle3(head, out)
    return out


@pytest.fixture(scope="session")
def tiny_policy_dir(tmp_path_factory) -> Path:
    return build_tiny_policy(tmp_path_factory.mktemp("tiny_policy"))


@pytest.fixture(scope="session")
def tiny_head_dir(tiny_policy_dir, tmp_path_factory) -> Path:
    return build_tiny_head(tiny_policy_dir, tmp_path_factory.mktemp("tiny_head"))


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
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture(scope="module")
def local_ray():
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()
