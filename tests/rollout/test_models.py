"""Target loading and EAGLE-3 feature capture (tiny random Llama; the embedded model is slow-marked)."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from rollout.config import ConfigError
from rollout.models import TargetConfig, TargetModel, default_aux_layer_ids, load_embedded_target, load_target


def tiny_llama(layers: int = 6, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def test_features_equal_output_hidden_states():
    model = tiny_llama(6)
    target = TargetModel(model)
    assert target.aux_layer_ids == (2, 3, 3)
    ids = torch.randint(0, 300, (2, 11), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = target(ids, use_cache=False)
        ref = model(input_ids=ids, output_hidden_states=True)
    assert out.logits.shape == (2, 11, 300) and out.logits.dtype == torch.float32
    assert out.features.shape == (2, 11, 3 * 64)
    expected = torch.cat([ref.hidden_states[i] for i in target.aux_layer_ids], dim=-1)
    torch.testing.assert_close(out.features, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)


def test_custom_layers_and_cache_continuation():
    model = tiny_llama(6)
    target = TargetModel(model, aux_layer_ids=(1, 4, 5))
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = target(ids, use_cache=False)
        cache = DynamicCache(config=model.config)
        a = target(ids[:, :7], cache=cache)
        b = target(ids[:, 7:], cache=a.cache, position_ids=torch.arange(7, 12)[None])
        ref = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(full.features[..., 64:128], ref.hidden_states[4], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([a.features, b.features], 1), full.features, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full.logits, rtol=1e-5, atol=1e-5)


def test_four_d_bool_mask_is_passed_through():
    """A 4D mask that hides one earlier token changes only the positions after it."""
    target = TargetModel(tiny_llama(4))
    ids = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    mask = torch.tril(torch.ones(6, 6, dtype=torch.bool))[None, None].clone()
    mask[..., 4:, 2] = False
    with torch.no_grad():
        plain = target(ids, use_cache=False)
        masked = target(ids, attention_mask=mask, use_cache=False)
    torch.testing.assert_close(masked.logits[:, :4], plain.logits[:, :4])
    assert not torch.allclose(masked.logits[:, 4:], plain.logits[:, 4:])


def test_bad_layer_ids_and_config_fields():
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        TargetModel(tiny_llama(4), aux_layer_ids=(1, 2, 4))
    with pytest.raises(ConfigError, match="dtype"):
        TargetConfig(dtype="float8")
    with pytest.raises(ConfigError, match="path"):
        TargetConfig(path="/nonexistent/model.gguf")
    with pytest.raises(ConfigError, match="path"):
        TargetConfig(path="/nonexistent-folder")
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        TargetConfig(aux_layer_ids=(1, 2))
    assert TargetConfig(aux_layer_ids=[1, 2, 3]).aux_layer_ids == (1, 2, 3)
    assert default_aux_layer_ids(30) == (2, 15, 27)


def test_load_from_hf_folder(tmp_path):
    model = tiny_llama(4)
    model.save_pretrained(tmp_path)
    target, tok = load_target(TargetConfig(path=str(tmp_path), aux_layer_ids=(0, 1, 3)))
    assert tok is None and target.aux_layer_ids == (0, 1, 3) and not target.training
    ids = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(target(ids).logits, model(input_ids=ids).logits.float())


@pytest.mark.slow
def test_embedded_target_loads_and_chats(tmp_path):
    target, tok = load_embedded_target()
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.aux_layer_ids == (2, 15, 27)
    assert tok.eos_token_id == 2 and tok.chat_template
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                  return_dict=True, return_tensors="pt")
    with torch.no_grad():
        out = target(enc["input_ids"])
    assert out.features.shape == (1, enc["input_ids"].shape[1], 3 * 576)
    assert torch.isfinite(out.logits).all()
