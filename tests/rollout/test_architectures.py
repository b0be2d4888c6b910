"""The architecture matrix: every family the hf engine accepts is reproduced exactly, every other
one is refused when the engine is built.

Each row builds a tiny random model of a transformers family from its config (no download) with
the settings that make the family differ from Llama turned up until they bite (small soft-caps,
short sliding windows, logit scales far from 1), and a draft head that copies the target's
lm_head so drafts are accepted. For each accepted family:

- greedy speculation (a chain and a tree) emits greedy decoding's tokens, and greedy decoding
  emits a cache-free forward's argmax at every step;
- lossless behaviour log-probs equal a cache-free forward's log-softmax at every emitted token
  (fp32, within 1e-4), on a sampled chain and a sampled tree;
- a lossy rule's (MARS) behaviour log-probs equal its closed form evaluated at the cache-free
  forward's logits and the drafts.

A new family joins by adding one line to :data:`MATRIX` and one to
``rollout.architectures.FAMILIES``."""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import single_thread, train_head  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM

from rollout.architectures import FAMILIES, UnsupportedModelError
from rollout.eagle3 import Eagle3Config, Eagle3Head
from rollout.engine import Engine
from rollout.models import TargetModel
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from verifiers import TokenKind, induced_candidates, induced_chain

VOCAB, HIDDEN = 96, 64
BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
WINDOW = 8  # shorter than the prompts plus completions below, so windows bite
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)

# (model_type, config overrides, what the row exercises)
MATRIX = [
    ("llama", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False), "GQA, Llama-3 rope scaling, untied"),
    ("mistral", dict(sliding_window=WINDOW), "sliding window on every layer"),
    ("mistral", dict(sliding_window=None, tie_word_embeddings=True), "no window: the fused CPU stack, tied"),
    ("ministral", dict(sliding_window=WINDOW), "alternating sliding/full layers"),
    ("mixtral", dict(sliding_window=WINDOW, num_local_experts=4, num_experts_per_tok=2), "MoE, sliding window"),
    ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2, tie_word_embeddings=True),
     "attention biases, windows on some layers, tied"),
    ("qwen3", dict(), "q/k norms"),
    ("qwen3_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32), "MoE, q/k norms"),
    ("gemma", dict(), "scaled embeddings, (1 + w) norms, GeLU MLP, tied"),
    ("gemma2", dict(sliding_window=WINDOW, attn_logit_softcapping=0.05, final_logit_softcapping=2.0,
                    query_pre_attn_scalar=24), "attention and logit soft-capping, alternating windows"),
    ("gemma3_text", dict(sliding_window=WINDOW, final_logit_softcapping=2.0), "q/k norms, windows, local rope"),
    ("phi", dict(), "LayerNorm, parallel attention/MLP, partial rotary, biases"),
    ("phi3", dict(sliding_window=None), "fused qkv and gate/up projections"),
    ("olmo", dict(), "non-parametric LayerNorm"),
    ("olmo2", dict(), "post-norms, q/k norms"),
    ("granite", dict(logits_scaling=4.0, embedding_multiplier=2.0, residual_multiplier=0.5,
                     attention_multiplier=0.3), "logit, embedding, residual and attention multipliers"),
    ("cohere", dict(logit_scale=0.25, use_qk_norm=False), "scaled logits, LayerNorm, parallel block"),
    ("cohere2", dict(sliding_window=WINDOW, logit_scale=0.25), "scaled logits, alternating windows"),
    ("stablelm", dict(), "LayerNorm, partial rotary"),
    ("starcoder2", dict(sliding_window=WINDOW), "LayerNorm, biases, GeLU MLP, window"),
    ("smollm3", dict(), "layers without rope"),
    ("helium", dict(), "Llama-like with its own norm"),
    ("glm", dict(), "partial interleaved rotary, fused gate/up"),
    ("exaone4", dict(sliding_window=WINDOW), "q/k norms, post-norms, windows"),
]
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], list(range(20, 40)), [3]]
NEW = 32
SPECS = {
    "chain": SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy"),
    "tree": SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8),
}
SAMPLED = {
    "chain": SpecConfig(mode="chain", num_draft_tokens=3),
    "tree": SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8, tree_candidates="sampled"),
}


def tiny_model(model_type: str, overrides: dict, seed: int = 0):
    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # peaked logits; the layers after the first damped: early features nearly predict the logits
        model.get_output_embeddings().weight.mul_(3.0)
        for layer in model.base_model.layers[1:]:
            for module in layer.modules():
                if isinstance(module, torch.nn.Linear) and module.out_features == HIDDEN:
                    module.weight.mul_(0.1)
            for name, param in layer.named_parameters():
                if name.endswith("experts.down_proj"):  # MoE experts: [E, H, I] outputs
                    param.mul_(0.1)
    return model


def copy_head(target: TargetModel, seed: int = 1) -> Eagle3Head:
    """A head that reads the layer-2 input through an identity fc, a near-silent decoder layer
    and the target's own lm_head: its drafts are often the target's choices. Where they are not
    (a greedy probe accepts few), it is trained for a few seconds on the target's own samples
    (``test_engine_utils.train_head``)."""
    torch.manual_seed(seed)
    h = target.hidden_size
    cfg = Eagle3Config(hidden_size=h, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, vocab_size=target.vocab_size, draft_vocab_size=target.vocab_size,
                       target_hidden_size=h, aux_layer_ids=target.aux_layer_ids)
    head = Eagle3Head(cfg, target.embed_tokens).eval()
    which = list(target.aux_layer_ids).index(2)  # the block holding the input of layer 2
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, which * h:(which + 1) * h] = torch.eye(h)
        head.midlayer.self_attn.o_proj.weight.mul_(0.05)
        head.midlayer.mlp.down_proj.weight.mul_(0.05)
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight)
    probe = Engine(target, head, num_threads=1).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=NEW),
                                                         SPECS["chain"])
    accepted = sum(k == TokenKind.ACCEPTED for c in probe.completions for k in c.kinds)
    return head if accepted >= 20 else train_head(target, head, seed=seed)


def forward_logits(target: TargetModel, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """A cache-free forward's logits ``[C, V]`` predicting each completion token."""
    with torch.no_grad():
        out = target.model(torch.tensor([prompt + completion]), use_cache=False)
    return out.logits[0, len(prompt) - 1: len(prompt) - 1 + len(completion)].float()


@pytest.fixture(scope="module", params=MATRIX, ids=[row[0] for row in MATRIX])
def family(request, single_thread):
    model_type, overrides, _ = request.param
    target = TargetModel(tiny_model(model_type, overrides))
    return target, Engine(target, copy_head(target), num_threads=1)


def test_the_matrix_covers_every_accepted_family():
    built = {type(tiny_model(t, o)).__name__ for t, o, _ in MATRIX}
    assert built == set(FAMILIES), f"accepted without a row: {set(FAMILIES) - built}; rows not accepted: {built - set(FAMILIES)}"


def test_greedy_decoding_is_the_forwards_argmax(family):
    target, engine = family
    res = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=NEW), SpecConfig(mode="off"))
    for prompt, comp in zip(PROMPTS, res.completions):
        ids = list(prompt)
        for _ in range(NEW):
            with torch.no_grad():
                ids.append(int(target.model(torch.tensor([ids]), use_cache=False).logits[0, -1].argmax()))
        assert comp.completion_ids == ids[len(prompt):]


@pytest.mark.parametrize("spec", list(SPECS))
def test_greedy_speculation_equals_greedy_decoding(family, spec):
    target, engine = family
    sampling = SamplingParams(temperature=0, max_new_tokens=NEW)
    plain = engine.generate(PROMPTS, sampling, SpecConfig(mode="off"))
    res = engine.generate(PROMPTS, sampling, SPECS[spec])
    for a, b in zip(plain.completions, res.completions):
        assert b.completion_ids == a.completion_ids
    accepted = sum(k == TokenKind.ACCEPTED for c in res.completions for k in c.kinds)
    assert accepted >= 10, f"drafts should be accepted (got {accepted}): the blocks must hold drafted tokens"


@pytest.mark.parametrize("spec", list(SAMPLED))
def test_lossless_logprobs_equal_a_cache_free_forward(family, spec):
    target, engine = family
    res = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=NEW), SAMPLED[spec], seed=3)
    assert sum(k == TokenKind.ACCEPTED for c in res.completions for k in c.kinds) >= 4
    worst = 0.0
    for comp in res.completions:
        lp = torch.log_softmax(forward_logits(target, comp.prompt_ids, comp.completion_ids), -1)
        ref = lp.gather(1, torch.tensor(comp.completion_ids)[:, None])[:, 0]
        worst = max(worst, float((torch.tensor(comp.behaviour_logprobs) - ref).abs().max()))
    assert worst <= 1e-4


def test_a_lossy_rules_logprobs_equal_its_closed_form(family):
    target, engine = family
    verifier = VerifierConfig("mars", {"theta": 0.5})
    res = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=NEW), SAMPLED["chain"], verifier,
                          seed=4, debug=True)
    rule, drafted = verifier.rule(), 0
    logits = {i: forward_logits(target, c.prompt_ids, c.completion_ids) for i, c in enumerate(res.completions)}
    for rec in res.debug:
        p_logits = logits[rec.row][rec.index][None]  # [1, V]: the cache-free forward's
        if rec.draft_logits is not None:
            drafted += 1
            dist = induced_chain(rule, p_logits, rec.draft_logits.cpu()[None], temperature=1.0)
        elif rec.candidates is not None:
            dist = induced_candidates(rule, p_logits, rec.candidates.cpu()[None], temperature=1.0)
        else:
            dist = torch.softmax(p_logits, -1)
        got = res.completions[rec.row].behaviour_logprobs[rec.index]
        assert got == pytest.approx(float(dist[0, rec.token].log()), abs=1e-4)
    assert drafted > 0


# ----------------------------------------------------------------------------- refusals


def test_an_unlisted_architecture_is_refused_by_name():
    config = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=HIDDEN, n_layer=4, n_head=4)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel is refused by the hf engine: not among"):
        Engine(TargetModel(model))


@pytest.mark.parametrize("rope", ["dynamic", "longrope"])
def test_a_length_dependent_rope_is_refused(rope):
    params = dict(rope_type=rope, rope_theta=10000.0, factor=2.0)
    if rope == "longrope":
        params.update(short_factor=[1.0] * 8, long_factor=[2.0] * 8, original_max_position_embeddings=32)
    model = tiny_model("phi3" if rope == "longrope" else "llama", dict(rope_parameters=params))
    with pytest.raises(UnsupportedModelError, match=f"rope type '{rope}' rescales"):
        Engine(TargetModel(model))


def test_attention_sinks_are_refused():
    config = AutoConfig.for_model("gpt_oss", **{**BASE, "num_local_experts": 4, "num_experts_per_tok": 2,
                                                 "sliding_window": WINDOW})
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(UnsupportedModelError, match="GptOssForCausalLM"):
        Engine(TargetModel(model))


def test_a_refused_folder_is_refused_before_any_model_loads(tmp_path):
    """``scripts.train``'s preflight reads the folder's config.json alone and names the class."""
    from rollout.models import TargetConfig
    from trainers.grpo.preflight import check_target_architecture

    for name, model_type, extra in (("gpt2", "gpt2", dict(n_embd=HIDDEN, n_layer=4, n_head=4)),
                                    ("qwen3", "qwen3", BASE)):
        AutoConfig.for_model(model_type, **{"vocab_size": VOCAB, **extra}, architectures=[
            "GPT2LMHeadModel" if name == "gpt2" else "Qwen3ForCausalLM"]).save_pretrained(tmp_path / name)
    check_target_architecture(TargetConfig(path=str(tmp_path / "qwen3")))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel is refused"):
        check_target_architecture(TargetConfig(path=str(tmp_path / "gpt2")))


def test_the_trainers_logprobs_equal_a_cache_free_forward(family):
    """The other side of the importance ratio: the trainer's log pi over GRPO groups (rows that
    share a prompt), by every forward path that applies to the family, equals a cache-free forward."""
    from trainers.grpo.policy import PATHS, completion_logprobs, forward_paths

    target, engine = family
    prompts = [PROMPTS[0]] * 3 + [PROMPTS[2]] * 2
    res = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=NEW), SAMPLED["chain"], seed=5)
    completions = [c.completion_ids for c in res.completions]
    paths = forward_paths(target.model)
    assert "whole" in paths and set(paths) <= set(PATHS)
    for path in paths:
        with torch.no_grad():
            logp, mask = completion_logprobs(target.model, prompts, completions, temperature=1.0, path=path)
        for i, (prompt, comp) in enumerate(zip(prompts, completions)):
            ref = torch.log_softmax(forward_logits(target, prompt, comp), -1)
            ref = ref.gather(1, torch.tensor(comp)[:, None])[:, 0]
            assert logp[i, : len(comp)].tolist() == pytest.approx(ref.tolist(), abs=1e-4), path
