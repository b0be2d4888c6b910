"""The vllm backend's checks and output decoding, without vLLM: refusals name the setting,
the head folder prepared for vLLM carries our draft temperature and is removed once the engine
is built, and vLLM's flat log-prob channel decodes into behaviour / target log-probs, kinds,
relaxed flags and rounds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from rollout.config import ConfigError
from rollout.params import SpecConfig
from rollout.vllm.backend import DEFAULTS, VLLMBackend, decode_completion, speculative_config
from rollout.vllm.head import check_head, prepare_head, prepared_head
from rollout.vllm.verify import configure, encode_rank

import torch

HEAD = Path(__file__).resolve().parents[3] / "rollout" / "heads" / "smollm2-135m-eagle3"
TARGET_CFG = {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30}


def _head_copy(tmp_path: Path, **changes) -> Path:
    out = tmp_path / "head"
    shutil.copytree(HEAD, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg.update(changes)
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_tree_mode_is_refused_naming_spec_mode():
    with pytest.raises(ConfigError, match=r"spec\.mode.*no tree"):
        speculative_config(SpecConfig(mode="tree"), str(HEAD))


def test_chain_maps_to_eagle3_with_the_draft_method():
    cfg = speculative_config(SpecConfig(mode="chain", num_draft_tokens=4, draft_sampling="greedy"), "/h")
    assert cfg == {"method": "eagle3", "model": "/h", "num_speculative_tokens": 4, "draft_sample_method": "greedy"}
    assert speculative_config(SpecConfig(mode="chain"), "/h")["draft_sample_method"] == "probabilistic"
    assert speculative_config(SpecConfig(mode="off"), None) is None
    with pytest.raises(ConfigError, match="drafter_path"):
        speculative_config(SpecConfig(mode="chain"), None)


def test_max_batch_becomes_vllms_batch_size_schedule():
    """K drafts up to max_batch running requests, none above; no schedule when it never bites."""
    cfg = speculative_config(SpecConfig(mode="chain", num_draft_tokens=3, max_batch=4), "/h", max_num_seqs=64)
    assert cfg["num_speculative_tokens_per_batch_size"] == [(1, 4, 3), (5, 64, 0)]
    assert "num_speculative_tokens_per_batch_size" not in speculative_config(
        SpecConfig(mode="chain", max_batch=64), "/h", max_num_seqs=64)
    with pytest.raises(ConfigError, match=r"spec\.max_batch.*'auto'.*integer"):
        speculative_config(SpecConfig(mode="chain", max_batch="auto"), "/h")


@pytest.mark.parametrize("change,match", [({"vocab_size": 32000}, "vocab_size 32000"),
                                          ({"target_hidden_size": 768}, "target_hidden_size 768"),
                                          ({"eagle_aux_hidden_state_layer_ids": [2, 15, 40],
                                            "eagle_config": {}}, r"\[2, 15, 40\]")])
def test_head_for_another_target_is_refused(tmp_path, change, match):
    head = _head_copy(tmp_path, **change)
    with pytest.raises(ConfigError, match="drafter_path") as err:
        check_head(head, TARGET_CFG)
    assert "another target" in str(err.value) and err.match(match)


def test_aux_layers_must_agree_with_the_head():
    assert check_head(HEAD, TARGET_CFG, (2, 15, 27))["vocab_size"] == 49152
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        check_head(HEAD, TARGET_CFG, (3, 15, 27))


def test_prepare_head_carries_our_draft_temperature(tmp_path):
    cfg = check_head(HEAD, TARGET_CFG)
    out = Path(prepare_head(HEAD, cfg, tmp_path))
    new = json.loads((out / "config.json").read_text())
    assert new["logit_scale"] == cfg["draft_logit_scale"] != 1.0  # vLLM reads logit_scale
    assert (out / "model.safetensors").resolve() == (HEAD / "model.safetensors").resolve()
    plain = _head_copy(tmp_path, draft_logit_scale=None)
    assert prepare_head(plain, check_head(plain, TARGET_CFG)) == str(plain)


def test_the_prepared_head_is_removed_after_the_block(tmp_path, own_tmp):
    cfg = check_head(HEAD, TARGET_CFG)
    with prepared_head(HEAD, cfg) as folder:
        assert Path(folder).parent == own_tmp
        assert json.loads((Path(folder) / "config.json").read_text())["logit_scale"] == cfg["draft_logit_scale"]
        assert (Path(folder) / "model.safetensors").resolve() == (HEAD / "model.safetensors").resolve()
    assert list(own_tmp.iterdir()) == []
    with pytest.raises(RuntimeError, match="engine failed"):
        with prepared_head(HEAD, cfg):
            raise RuntimeError("engine failed")
    assert list(own_tmp.iterdir()) == []
    plain = _head_copy(tmp_path, draft_logit_scale=None)
    with prepared_head(plain, check_head(plain, TARGET_CFG)) as folder:
        assert folder == str(plain)
    assert (plain / "model.safetensors").is_file()  # the head's own folder is not removed


@pytest.mark.parametrize("fails", [False, True])
def test_the_backend_holds_the_prepared_head_only_while_the_engine_is_built(tmp_path, own_tmp, monkeypatch, fails):
    """vLLM reads the draft folder while the engine is built (its config, then the weights
    through the links), not after: the folder is there for ``_build`` and gone once it returns
    or fails, so no folder of links outlives an actor's copy of a shipped head."""
    target_dir = tmp_path / "target"
    target_dir.mkdir()
    (target_dir / "config.json").write_text(json.dumps(TARGET_CFG))
    target = SimpleNamespace(path=str(target_dir), aux_layer_ids=(2, 15, 27), dtype="float32")
    head = _head_copy(tmp_path)
    seen = {}

    def build(self, target, spec_cfg, seed, threads, device):
        folder = Path(spec_cfg["model"])
        seen["config"] = json.loads((folder / "config.json").read_text())
        seen["weights"] = (folder / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
        if fails:
            raise RuntimeError("engine failed")
        return "engine"

    monkeypatch.setattr(VLLMBackend, "_build", build)
    if fails:
        with pytest.raises(RuntimeError, match="engine failed"):
            VLLMBackend(target, str(head), SpecConfig(mode="chain"))
    else:
        assert VLLMBackend(target, str(head), SpecConfig(mode="chain")).llm == "engine"
    assert seen["config"]["logit_scale"] == 1.2 and seen["weights"]
    assert list(own_tmp.iterdir()) == []


def test_unknown_rule_and_options_are_refused():
    with pytest.raises(ConfigError, match=r"'name'.*unknown verification rule 'nope'"):
        configure({"name": "nope"})
    with pytest.raises(ConfigError, match=r"'params\.theta'.*must be in \[0, 1\], got 3.0"):
        configure({"name": "mars", "params": {"theta": 3.0}})
    with pytest.raises(ConfigError, match="backend_options"):
        VLLMBackend(None, None, SpecConfig(mode="off"), options={"kv_cache_bytes": 1})
    assert "kv_cache_memory_bytes" in DEFAULTS


def _flat(tokens, behaviour, target, kinds, relaxed):
    """A vLLM FlatLogprobs with 2 columns per position; kind None = vLLM's plain sampler."""
    lp = SimpleNamespace(token_ids=[], logprobs=[], ranks=[], start_indices=[], end_indices=[])
    for t, b, g, k, r in zip(tokens, behaviour, target, kinds, relaxed):
        lp.start_indices.append(len(lp.token_ids))
        rank = 3 if k is None else int(encode_rank(torch.tensor(k), torch.tensor(r)))
        lp.token_ids += [t, t if k is not None else 99]
        lp.logprobs += [b, g]
        lp.ranks += [rank, 1]
        lp.end_indices.append(len(lp.token_ids))
    return SimpleNamespace(token_ids=tokens, logprobs=lp, finish_reason="stop")


def test_decode_completion_reads_the_log_prob_channel():
    out = _flat([5, 6, 7, 8, 9], [-1.0, -0.5, -0.2, -2.0, -0.1], [-9.0, -0.7, -0.3, -2.5, -0.1],
                [None, 0, 0, 1, 2], [False, True, False, False, False])
    c = decode_completion([1, 2], out)
    assert c.completion_ids == [5, 6, 7, 8, 9]
    assert c.behaviour_logprobs == [-1.0, -0.5, -0.2, -2.0, -0.1]
    assert c.target_logprobs == [-1.0, -0.7, -0.3, -2.5, -0.1]  # plain sampler: target = column 0
    assert c.kinds == [2, 0, 0, 1, 2] and c.relaxed == [False, True, False, False, False]
    assert c.step_emitted == [1, 3, 1] and c.finish_reason == "stop"


def test_decode_completion_at_t0_records_the_plain_samplers_tokens_as_certain():
    """At T = 0 vLLM's plain sampler emits the argmax (P = p = one-hot: log-prob 0) but reports
    log softmax of the raw logits; our verifier's tokens keep what it wrote (0 at T = 0)."""
    out = _flat([5, 6, 7], [-0.5, -0.25, 0.0], [-9.0, -0.25, 0.0], [None, 0, None], [False, False, False])
    c = decode_completion([1], out, greedy=True)
    assert c.behaviour_logprobs == [0.0, -0.25, 0.0] and c.target_logprobs == [0.0, -0.25, 0.0]
    assert decode_completion([1], out).behaviour_logprobs == [-0.5, -0.25, 0.0]  # T > 0: as vLLM reports


def test_decode_completion_refuses_a_missing_channel():
    out = SimpleNamespace(token_ids=[1, 2], logprobs=None, finish_reason="length")
    with pytest.raises(RuntimeError, match="log-prob positions"):
        decode_completion([0], out)


def test_set_weights_refuses_a_partial_state_dict_and_none(tiny_policy_dir):
    """vLLM's reload only logs a weight it did not get and keeps serving the old one (a tied
    lm_head keeps its old packed copy on the CPU): a dict without every checkpoint weight, or
    without lm_head.weight where the embedding is tied, is refused before anything is sent."""
    import json

    from transformers import AutoModelForCausalLM

    from rollout.vllm.weights import expected_weight_names

    calls = []
    be = VLLMBackend.__new__(VLLMBackend)
    be._version = 0
    be.weight_names = expected_weight_names(tiny_policy_dir, {**json.loads((tiny_policy_dir / "config.json")
                                                                           .read_text()), "tie_word_embeddings": True})
    be.llm = SimpleNamespace(collective_rpc=lambda fn, args: calls.append(args[0]), reset_prefix_cache=lambda: None)
    full = AutoModelForCausalLM.from_pretrained(str(tiny_policy_dir)).state_dict()
    assert "lm_head.weight" in full
    assert be.set_weights(full, 3) == 3 and set(calls[0]) == set(full)
    for drop in ("lm_head.weight", "model.layers.0.self_attn.k_proj.weight"):
        with pytest.raises(ValueError, match=f"lacks 1 of the target's weights \\({drop}\\)"):
            be.set_weights({k: v for k, v in full.items() if k != drop}, 4)
    with pytest.raises(ValueError, match="needs its state dict"):
        be.set_weights(None, 5)
    assert len(calls) == 1 and be.version == 3
