"""Fixtures shared by the rollout and training tests: a tiny random policy with the real
SmolLM2 tokenizer (read from the packaged GGUF, no model conversion) and a random EAGLE-3
head for it, built once per session."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch


def build_tiny_policy(out: Path, model_type: str = "llama", **overrides) -> Path:
    """A random 4-layer model of a transformers family (a Llama by default) with the real SmolLM2
    tokenizer, saved as a HF folder."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from rollout.models import embedded_gguf_path

    gguf = embedded_gguf_path()
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id, **overrides})
    model = AutoModelForCausalLM.from_config(cfg).eval()
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


@pytest.fixture
def own_tmp(tmp_path, monkeypatch) -> Path:
    """The temporary folder this process's mkdtemp uses (so no other process's folders count)."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder
