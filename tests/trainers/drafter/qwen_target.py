"""A tiny random Qwen2 target (attention biases, untied lm_head, a vocabulary and hidden size
unlike SmolLM2's) saved as a Hugging Face folder with a word-level tokenizer and a chat
template, for the tests of heads and drafter training on targets other than the embedded one.
Its layers after the first are damped and its lm_head scaled, so its next-token laws are
peaked enough for a head trained for seconds to be accepted often (no test functions here)."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB, HIDDEN, LAYERS = 160, 96, 8
SPECIAL = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> {% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def words() -> list[str]:
    """The tokenizer's ordinary words: roles, letters, digits, some punctuation and fillers."""
    base = ["system", "user", "assistant", "tool"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    base += [str(d) for d in range(10)] + list("+-*/=?.,!")
    return base + [f"w{i}" for i in range(VOCAB - len(SPECIAL) - len(base))]


def save_tiny_qwen2(folder: Path, seed: int = 0, tokenizer: bool = True) -> Path:
    """Write the target (and, with ``tokenizer``, its tokenizer) into ``folder``; returns it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=192,
                               num_hidden_layers=LAYERS, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=512, tie_word_embeddings=False, rope_theta=1e6,
                               bos_token_id=2, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(3.0)
        for layer in model.model.layers[1:]:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
    model.save_pretrained(folder)
    if tokenizer:
        word_tokenizer().save_pretrained(folder)
    return folder


def word_tokenizer():
    """A whitespace word-level tokenizer over :func:`words` with the special tokens and chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + words())}
    assert len(vocab) == VOCAB
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", eos_token="<|endoftext|>",
                                  bos_token="<|im_start|>", pad_token="<unk>",
                                  additional_special_tokens=["<|im_end|>"])
    tok.chat_template = CHAT_TEMPLATE
    return tok
