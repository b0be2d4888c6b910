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

The matrix (``scripts.check_model.MATRIX``) is also what ``python -m scripts.check_model --matrix``
prints. A new family joins by adding one line to it and one to ``rollout.architectures.FAMILIES``."""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import single_thread, train_head  # noqa: F401
from transformers import AutoConfig, AutoModelForCausalLM

from rollout.architectures import FAMILIES, UnsupportedModelError
from rollout.eagle3 import Eagle3Head
from rollout.engine.engine import Engine
from rollout.models import TargetModel
from rollout.params import SamplingParams, SpecConfig
from scripts import check_model
from scripts.check_model import BASE, HIDDEN, MATRIX, PROMPTS, VOCAB, WINDOW, tiny_model
from scripts.check_model import GREEDY_SPECS as SPECS
from scripts.check_model import SAMPLED_SPECS as SAMPLED
from verifiers import TokenKind

NEW = 32


def copy_head(target: TargetModel, seed: int = 1) -> Eagle3Head:
    """``scripts.check_model.copy_head``; where its drafts are seldom accepted (a greedy probe), it
    is trained for a few seconds on the target's own samples (``test_engine_utils.train_head``)."""
    head = check_model.copy_head(target, seed)
    probe = Engine(target, head, num_threads=1).generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=NEW),
                                                         SPECS["chain"])
    accepted = sum(k == TokenKind.ACCEPTED for c in probe.completions for k in c.kinds)
    return head if accepted >= 20 else train_head(target, head, seed=seed)


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
    assert check_model.lossless_error(engine, target, PROMPTS, SAMPLED[spec], NEW, seed=3) <= 1e-4


def test_a_lossy_rules_logprobs_equal_its_closed_form(family):
    """MARS's behaviour log-probs against its closed form at the cache-free forward's logits."""
    target, engine = family
    res = engine.generate(PROMPTS, SamplingParams(temperature=1.0, max_new_tokens=NEW), SAMPLED["chain"],
                          check_model.MARS, seed=4, debug=True)
    assert sum(rec.draft_logits is not None for rec in res.debug) > 0
    assert check_model.lossy_error(engine, target, PROMPTS, NEW, seed=4) <= 1e-4


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
    from trainers.grpo.policy import PATHS, forward_paths

    target, engine = family
    paths = forward_paths(target.model)
    assert "whole" in paths and set(paths) <= set(PATHS)
    assert check_model.trainer_error(engine, target, PROMPTS, NEW, seed=5) <= 1e-4
