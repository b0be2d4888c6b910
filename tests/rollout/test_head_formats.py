"""The public EAGLE-3 head formats on a target other than SmolLM2 (a tiny Qwen2 loaded from its
folder): EAGLE's own checkpoint (``pytorch_model.bin`` or ``model.safetensors``, ``d2t``/``t2d``),
the ``speculators`` format and the project's own, each loaded into the engine, whose greedy
speculation (chain and tree) must equal plain greedy decoding while drafting over the head's
draft vocabulary mapped to the right target ids; heads that do not fit are refused naming the
file and the mismatch."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_engine_utils import PROMPTS, _ttt_loss, assert_speculative_greedy_equals_plain, single_thread  # noqa: F401

from rollout.eagle3 import Eagle3Config, Eagle3Head, HeadMismatchError, causal_mask, load_eagle3, save_eagle3
from rollout.engine.engine import Engine
from rollout.models import TargetConfig, load_target
from rollout.params import SamplingParams, SpecConfig
from tests.trainers.drafter.qwen_target import HIDDEN, LAYERS, VOCAB, save_tiny_qwen2
from verifiers import TokenKind

VD = 120  # draft vocabulary: a strict subset of the target's, so d2t is not the identity
CHAIN = SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy")
TREE = SpecConfig(mode="tree", depth=4, top_k=3, total_tokens=10)


def train_head(target, vd: int = VD, seed: int = 1, steps: int = 60, **variant) -> Eagle3Head:
    """A head shaped for ``target`` (``Eagle3Config.for_target``), its draft vocabulary the ``vd``
    most frequent tokens of sequences the target samples, trained for a few seconds with the
    training-time-test loss on them."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (3,), generator=gen).tolist() for _ in range(24)]
    res = Engine(target, num_threads=1).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=25), seed=seed)
    tokens = torch.tensor([c.prompt_ids + c.completion_ids for c in res.completions])  # [24, 28]
    counts = torch.bincount(tokens.flatten(), minlength=VOCAB).double() + torch.linspace(1e-3, 0, VOCAB, dtype=torch.float64)
    ids = counts.topk(vd).indices.sort().values
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target, vd, **variant), target.embed_tokens)
    head.set_draft_vocab(ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.model.lm_head.weight[ids])
        head.norm.weight.copy_(target.model.model.norm.weight)
        out = target(tokens, use_cache=False)
    feats, probs = out.features, torch.softmax(out.logits, -1)
    opt = torch.optim.Adam(head.parameters(), lr=5e-3)
    for _ in range(steps):
        opt.zero_grad()
        _ttt_loss(head, tokens, feats, probs, 3).backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory, single_thread):
    folder = save_tiny_qwen2(tmp_path_factory.mktemp("qwen2"), tokenizer=False)
    target, _ = load_target(TargetConfig(path=str(folder)))
    assert type(target.model).__name__ == "Qwen2ForCausalLM" and target.model.model.layers[0].self_attn.q_proj.bias is not None
    return target, train_head(target)


# ----------------------------------------------------------------------------- writers (the formats as published)


def write_eagle(head: Eagle3Head, folder, weights_file: str = "pytorch_model.bin", d2t=None) -> None:
    """EAGLE's own EAGLE-3 checkpoint: a flat Llama config with ``draft_vocab_size`` (no aux layer
    ids: the default ones), ``midlayer.*`` weights and the ``d2t`` / ``t2d`` buffers."""
    c = head.cfg
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_act": "silu",
              "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
              "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
              "head_dim": c.head_dim, "num_hidden_layers": 1, "rms_norm_eps": c.rms_norm_eps,
              "rope_theta": c.rope_theta, "max_position_embeddings": 2048, "vocab_size": c.vocab_size,
              "draft_vocab_size": c.draft_vocab_size, "tie_word_embeddings": False, "torch_dtype": "float32",
              "bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0, "use_cache": True}
    weights = {k: v.detach().clone() for k, v in head.state_dict().items()}
    if d2t is not None:
        weights["d2t"] = d2t
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[torch.arange(c.draft_vocab_size) + d2t] = True
        weights["t2d"] = t2d
    if weights_file == "pytorch_model.bin":
        torch.save(weights, folder / weights_file)
    else:
        save_file(weights, str(folder / weights_file))
    (folder / "config.json").write_text(json.dumps(config))


def write_speculators(head: Eagle3Head, target, folder, layer_type: str = "llama", nbr: bool | None = False) -> None:
    """The speculators format: the layer config nested, ``layers.0.*`` weights, the verifier's
    embedding stored too; ``nbr`` None leaves ``norm_before_residual`` out of the config."""
    c = head.cfg
    folder.mkdir(parents=True, exist_ok=True)
    layer = {"model_type": layer_type, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
             "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
             "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
             "max_position_embeddings": 4096, "rope_theta": c.rope_theta, "hidden_act": "silu",
             "attention_bias": c.attention_bias, "num_hidden_layers": 1}
    config = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
              "speculators_version": "0.1.0", "draft_vocab_size": c.draft_vocab_size,
              "target_hidden_size": c.target_hidden_size, "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
              "embed_requires_grad": False, "transformer_layer_config": layer,
              "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                     "verifier": {"name_or_path": "tiny-qwen2", "architectures": ["Qwen2ForCausalLM"]}}}
    if nbr is not None:
        config["norm_before_residual"] = nbr
    weights = {k.replace("midlayer.", "layers.0."): v.detach().clone() for k, v in head.state_dict().items()}
    weights["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    save_file(weights, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))


# ----------------------------------------------------------------------------- loading and drafting


def _accepted(res) -> int:
    return sum(k == TokenKind.ACCEPTED for c in res.completions for k in c.kinds)


@pytest.mark.parametrize("fmt", ["eagle-bin", "eagle-safetensors", "speculators", "own"])
def test_each_format_drafts_losslessly_over_the_mapped_vocabulary(qwen, tmp_path, fmt):
    target, head = qwen
    folder = tmp_path / fmt
    if fmt.startswith("eagle"):
        write_eagle(head, folder, "pytorch_model.bin" if fmt == "eagle-bin" else "model.safetensors")
    elif fmt == "speculators":
        write_speculators(head, target, folder)
    else:
        save_eagle3(head, folder)
    loaded = load_eagle3(folder, target)
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert torch.equal(loaded.target_ids, head.target_ids) and not torch.equal(loaded.target_ids, torch.arange(VD))
    assert loaded.cfg.aux_layer_ids == (2, LAYERS // 2, LAYERS - 3) == target.aux_layer_ids
    assert (loaded.cfg.hidden_size, loaded.cfg.vocab_size, loaded.cfg.rope_theta) == (HIDDEN, VOCAB, 1e6)
    engine = Engine(target, loaded, num_threads=1)
    reference = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=0, max_new_tokens=40)
    for spec in (CHAIN, TREE):
        res = assert_speculative_greedy_equals_plain(engine, spec)
        assert res.tau > 1.2
        ref = reference.generate(PROMPTS, sampling, spec)
        assert [c.kinds for c in res.completions] == [c.kinds for c in ref.completions]
    res = engine.generate(PROMPTS, sampling, CHAIN, debug=True)
    drafted = torch.cat([d.candidates for d in res.debug if d.candidates is not None])
    drafted = drafted[drafted >= 0]
    assert len(drafted) > 20 and bool(loaded.t2d[drafted].all())  # drafts are target ids of the draft vocabulary


def test_a_wrong_d2t_drafts_the_wrong_tokens(qwen, tmp_path):
    """The same weights with the draft ids mapped to another (valid) set of target ids: still
    lossless, but the drafts are rarely accepted, so the map is what the engine drafts with."""
    target, head = qwen
    gen = torch.Generator().manual_seed(7)
    other = torch.randperm(VOCAB, generator=gen)[:VD].sort().values
    assert not torch.equal(other, head.target_ids)
    write_eagle(head, tmp_path / "right", "model.safetensors")
    write_eagle(head, tmp_path / "wrong", "model.safetensors", d2t=other - torch.arange(VD))
    right, wrong = load_eagle3(tmp_path / "right", target), load_eagle3(tmp_path / "wrong", target)
    assert torch.equal(wrong.target_ids, other)
    sampling = SamplingParams(temperature=0, max_new_tokens=40)
    plain = Engine(target, num_threads=1).generate(PROMPTS, sampling)
    accepted = {}
    for name, h in (("right", right), ("wrong", wrong)):
        res = Engine(target, h, num_threads=1).generate(PROMPTS, sampling, CHAIN)
        assert [c.completion_ids for c in res.completions] == [c.completion_ids for c in plain.completions]
        accepted[name] = _accepted(res)
    assert accepted["right"] > 30 and accepted["wrong"] < accepted["right"] / 3, accepted


def test_d2t_and_t2d_that_disagree_are_refused(qwen, tmp_path):
    target, head = qwen
    save_eagle3(head, tmp_path)
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["t2d"] = torch.roll(weights["t2d"], 1)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadMismatchError, match="t2d disagrees with d2t") as err:
        load_eagle3(tmp_path, target)
    assert str(tmp_path) in str(err.value)
    weights["t2d"] = torch.ones(VOCAB + 5, dtype=torch.bool)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadMismatchError, match="t2d has shape"):
        load_eagle3(tmp_path, target)
    weights["d2t"] = weights["d2t"] + 500
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadMismatchError, match="outside the target vocabulary"):
        load_eagle3(tmp_path, target)


# ----------------------------------------------------------------------------- heads that do not fit


def _smollm_sized(tmp_path):
    """A tiny Llama with another vocabulary, hidden size and depth than the Qwen2 target."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollout.models import TargetModel

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB + 40, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS - 3,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    return TargetModel(LlamaForCausalLM(cfg).eval())


@pytest.mark.parametrize("fmt", ["eagle", "speculators"])
def test_heads_for_another_target_are_refused_naming_file_and_field(qwen, tmp_path, fmt):
    target, head = qwen
    folder = tmp_path / fmt
    (write_eagle(head, folder, "model.safetensors") if fmt == "eagle" else write_speculators(head, target, folder))
    other = _smollm_sized(tmp_path)
    with pytest.raises(HeadMismatchError, match="hidden size mismatch") as err:
        load_eagle3(folder, other)
    assert str(folder) in str(err.value)
    with pytest.raises(HeadMismatchError, match="layer ids mismatch"):
        target.set_aux_layer_ids((1, 3, 6))
        try:
            load_eagle3(folder, target)
        finally:
            target.set_aux_layer_ids((2, 4, 5))
    config = json.loads((folder / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    layer["vocab_size"] = VOCAB + 1
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadMismatchError, match="vocabulary mismatch"):
        load_eagle3(folder, target)
    layer["vocab_size"], layer["hidden_act"] = VOCAB, "gelu"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadMismatchError, match="hidden_act 'gelu'"):
        load_eagle3(folder, target)
    layer["hidden_act"], layer["rope_scaling"] = "silu", {"rope_type": "yarn", "factor": 4.0}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadMismatchError, match="rope_scaling.*yarn") as err:
        load_eagle3(folder, target)
    assert str(folder) in str(err.value)


def test_a_speculators_embedding_of_another_shape_is_refused(qwen, tmp_path):
    target, head = qwen
    write_speculators(head, target, tmp_path)
    from safetensors.torch import load_file

    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["embed_tokens.weight"] = torch.zeros(VOCAB + 8, HIDDEN)
    save_file(weights, str(tmp_path / "model.safetensors"))
    with pytest.raises(HeadMismatchError, match=r"embed_tokens.weight is \(168, 96\)"):
        load_eagle3(tmp_path, target)


# ----------------------------------------------------------------------------- layer variants


def _random_variant(target, **variant) -> Eagle3Head:
    head = Eagle3Head(Eagle3Config.for_target(target, VD, **variant), target.embed_tokens)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    head.set_draft_vocab(torch.randperm(VOCAB, generator=g)[:VD].sort().values)
    return head.eval()


def _draft(head, target, t: int = 7):
    g = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, VOCAB, (2, t), generator=g)
    feats = torch.randn(2, t, 3 * HIDDEN, generator=g)
    with torch.no_grad():
        return head(tokens, feats, torch.arange(t).expand(2, t), causal_mask(2, t)).logits


def test_a_qwen3_layer_speculators_head_with_biases_and_qk_norms_loads_and_drafts(qwen, tmp_path):
    """A speculators head whose layer is a Qwen3 one (q/k norms) with attention biases, and the
    speculators reading of an absent ``norm_before_residual`` (true, as vLLM reads it): each
    variant weight and flag changes the draft, the round trip is exact and the engine stays lossless."""
    target, _ = qwen
    head = _random_variant(target, attention_bias=True, qk_norm=True, norm_before_residual=True)
    names = set(head.state_dict())
    assert {"midlayer.self_attn.q_norm.weight", "midlayer.self_attn.k_norm.weight",
            "midlayer.self_attn.q_proj.bias", "midlayer.self_attn.o_proj.bias"} <= names
    write_speculators(head, target, tmp_path, layer_type="qwen3", nbr=None)
    loaded = load_eagle3(tmp_path, target)
    c = loaded.cfg
    assert (c.attention_bias, c.qk_norm, c.norm_before_residual) == (True, True, True)
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    base = _draft(loaded, target)
    assert torch.equal(base, _draft(head, target))
    for name in ("q_norm.weight", "k_norm.weight", "q_proj.bias", "o_proj.bias"):
        changed = load_eagle3(tmp_path, target)
        with torch.no_grad():
            changed.midlayer.self_attn.get_parameter(name).mul_(1.5)
        assert not torch.allclose(_draft(changed, target), base), name
    changed = load_eagle3(tmp_path, target)
    changed.midlayer.norm_before_residual = False
    assert not torch.allclose(_draft(changed, target), base)
    sampling = SamplingParams(temperature=0, max_new_tokens=20)
    plain = Engine(target, num_threads=1).generate(PROMPTS, sampling)
    for spec in (CHAIN, TREE):
        res = Engine(target, loaded, num_threads=1).generate(PROMPTS, sampling, spec)
        assert [c.completion_ids for c in res.completions] == [c.completion_ids for c in plain.completions]


def test_the_variant_layer_with_every_variant_off_is_the_eagle_layer(qwen):
    from rollout.eagle3_head import DraftLayer, VariantDraftLayer

    target, _ = qwen
    head = _random_variant(target)
    assert type(head.midlayer) is DraftLayer
    variant = _random_variant(target, norm_before_residual=True)
    assert type(variant.midlayer) is VariantDraftLayer
    variant.load_state_dict(head.state_dict())
    variant.midlayer.norm_before_residual = False
    assert torch.equal(_draft(variant, target), _draft(head, target))


def test_llama3_rope_scaling_is_read_and_used(qwen, tmp_path):
    target, head = qwen
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
    write_eagle(head, tmp_path, "model.safetensors")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "rope_scaling": scaling}))
    scaled = load_eagle3(tmp_path, target)
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](LlamaConfig(hidden_size=HIDDEN, num_attention_heads=6, head_dim=16,
                                                       rope_parameters={**scaling, "rope_theta": 1e6}))
    torch.testing.assert_close(scaled.rotary.inv_freq, ref.float())
    assert not torch.allclose(scaled.rotary.inv_freq, head.rotary.inv_freq)
    save_eagle3(scaled, tmp_path / "again")
    assert load_eagle3(tmp_path / "again", target).cfg.rope_scaling == scaling
