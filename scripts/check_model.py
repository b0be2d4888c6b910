"""Is a model reproduced exactly? The engine's and the trainer's log-probs against a cache-free forward.

    python -m scripts.check_model --model PATH [--drafter DIR] [--prompts 4] [--max-new-tokens 48]
    python -m scripts.check_model --matrix [--json OUT.json]

``--model`` checks a Hugging Face folder of your own: first whether the hf engine accepts its
architecture (``rollout.architectures``; a refused model is named with the reason, exit 2), then,
on random prompts sampled at T = 1, the largest difference between

- ``lossless``: every emitted token's behaviour log-prob under lossless verification (plain
  decoding, and with ``--drafter`` a sampled chain and a sampled tree) and the log-softmax of a
  cache-free forward over prompt + completion;
- ``mars``: (with ``--drafter``) MARS's behaviour log-probs and its closed form evaluated at the
  cache-free forward's logits and the drafts;
- ``trainer``: the trainer's log-probs of those completions, by every forward path that applies
  to the model (``trainers.grpo.policy``), and the cache-free forward;

and whether greedy speculation (chain and tree) emits greedy decoding's tokens. Exit 1 when a
difference exceeds ``--tolerance`` (1e-4, fp32) or greedy speculation differs.

``--matrix`` runs the same checks on :data:`MATRIX`, a tiny random model of each accepted family
built from its transformers config (no download) with a head that copies its lm_head, and prints
one row per family (the table ``tests/rollout/test_architectures.py`` asserts on)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rollout.architectures import UnsupportedModelError, family_of
from rollout.eagle3 import Eagle3Config, Eagle3Head, load_eagle3
from rollout.engine.engine import Engine
from rollout.models import TargetConfig, TargetModel, load_target
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from verifiers import induced_candidates, induced_chain

VOCAB, HIDDEN = 96, 64
BASE = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, pad_token_id=0, bos_token_id=1,
            eos_token_id=2)
WINDOW = 8  # shorter than the prompts plus completions, so windows bite
LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=32)

# (model_type, config overrides, what the row exercises): the settings that make a family differ
# from Llama turned up until they bite (small soft-caps, short windows, logit scales far from 1)
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
GREEDY_SPECS = {
    "chain": SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy"),
    "tree": SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8),
}
SAMPLED_SPECS = {
    "chain": SpecConfig(mode="chain", num_draft_tokens=3),
    "tree": SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8, tree_candidates="sampled"),
}
MARS = VerifierConfig("mars", {"theta": 0.5})


def tiny_model(model_type: str, overrides: dict, seed: int = 0):
    """A random 4-layer model of ``model_type`` (fp32, eval) with peaked logits and the layers after
    the first damped, so that early features nearly predict the logits (a copied head drafts well)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **{**BASE, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
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
    """A head reading the layer-2 input through an identity fc, a near-silent decoder layer and the
    target's own lm_head: its drafts are often the target's choices."""
    torch.manual_seed(seed)
    h = target.hidden_size
    cfg = Eagle3Config(hidden_size=h, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, vocab_size=target.vocab_size, draft_vocab_size=target.vocab_size,
                       target_hidden_size=h, aux_layer_ids=target.aux_layer_ids)
    head = Eagle3Head(cfg, target.embed_tokens).eval()
    which = list(target.aux_layer_ids).index(2) if 2 in target.aux_layer_ids else 0
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, which * h:(which + 1) * h] = torch.eye(h)
        head.midlayer.self_attn.o_proj.weight.mul_(0.05)
        head.midlayer.mlp.down_proj.weight.mul_(0.05)
        head.lm_head.weight.copy_(target.model.get_output_embeddings().weight[head.target_ids])
    return head


def forward_logits(target: TargetModel, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """A cache-free forward's logits ``[C, V]`` (float32) predicting each completion token."""
    device = target.device
    with torch.no_grad():
        out = target.model(torch.tensor([prompt + completion], device=device), use_cache=False)
    return out.logits[0, len(prompt) - 1: len(prompt) - 1 + len(completion)].float().cpu()


def _picked(logits: torch.Tensor, completion: list[int]) -> torch.Tensor:
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None])[:, 0]


def lossless_error(engine: Engine, target: TargetModel, prompts, spec: SpecConfig, new: int, seed: int) -> float:
    res = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new), spec, seed=seed)
    return max(float((torch.tensor(c.behaviour_logprobs) - _picked(forward_logits(target, c.prompt_ids,
                                                                                c.completion_ids), c.completion_ids)).abs().max())
               for c in res.completions if c.completion_ids)


def lossy_error(engine: Engine, target: TargetModel, prompts, new: int, seed: int) -> float:
    """MARS's behaviour log-probs against its closed form at the cache-free forward's logits."""
    res = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new), SAMPLED_SPECS["chain"],
                          MARS, seed=seed, debug=True)
    rule, worst = MARS.rule(), 0.0
    logits = {i: forward_logits(target, c.prompt_ids, c.completion_ids) for i, c in enumerate(res.completions)}
    for rec in res.debug:
        p_logits = logits[rec.row][rec.index][None]  # [1, V]
        if rec.draft_logits is not None:
            dist = induced_chain(rule, p_logits, rec.draft_logits.cpu()[None], temperature=1.0)
        elif rec.candidates is not None:
            dist = induced_candidates(rule, p_logits, rec.candidates.cpu()[None], temperature=1.0)
        else:
            dist = torch.softmax(p_logits, -1)
        got = res.completions[rec.row].behaviour_logprobs[rec.index]
        worst = max(worst, abs(got - float(dist[0, rec.token].log())))
    return worst


def trainer_error(engine: Engine, target: TargetModel, prompts, new: int, seed: int) -> float:
    """The trainer's log-probs over GRPO groups (rows sharing a prompt), by every path, against the forward."""
    from trainers.grpo.policy import completion_logprobs, forward_paths

    groups = [p for p in prompts if len(p) > 1 for _ in range(2)]  # a shared prompt needs a prefix to share
    res = engine.generate(groups, SamplingParams(temperature=1.0, max_new_tokens=new), SpecConfig(mode="off"), seed=seed)
    completions = [c.completion_ids for c in res.completions]
    worst = 0.0
    for path in forward_paths(target.model):
        with torch.no_grad():
            logp, _ = completion_logprobs(target.model, groups, completions, temperature=1.0, path=path)
        for i, (prompt, comp) in enumerate(zip(groups, completions)):
            if comp:
                ref = _picked(forward_logits(target, prompt, comp), comp)
                worst = max(worst, float((logp[i, : len(comp)].cpu() - ref).abs().max()))
    return worst


def greedy_equal(engine: Engine, prompts, new: int) -> bool:
    sampling = SamplingParams(temperature=0, max_new_tokens=new)
    plain = [c.completion_ids for c in engine.generate(prompts, sampling, SpecConfig(mode="off")).completions]
    return all([c.completion_ids for c in engine.generate(prompts, sampling, spec).completions] == plain
               for spec in GREEDY_SPECS.values())


def check(target: TargetModel, head: Eagle3Head | None, prompts, new: int, seed: int = 3) -> dict:
    """The worst differences (and greedy equality, with a head) for one target."""
    plain = Engine(target, num_threads=torch.get_num_threads())
    row = {"lossless": lossless_error(plain, target, prompts, SpecConfig(mode="off"), new, seed),
           "trainer": trainer_error(plain, target, prompts, new, seed)}
    if head is not None:
        engine = Engine(target, head, num_threads=torch.get_num_threads())
        for name, spec in SAMPLED_SPECS.items():
            row["lossless"] = max(row["lossless"], lossless_error(engine, target, prompts, spec, new, seed))
        row["mars"] = lossy_error(engine, target, prompts, new, seed)
        row["greedy_spec_equal"] = greedy_equal(engine, prompts, new)
    return row


def _ok(row: dict, tolerance: float) -> bool:
    return (max(row.get(k, 0.0) for k in ("lossless", "mars", "trainer")) <= tolerance
            and row.get("greedy_spec_equal", True))


def run_matrix(new: int, tolerance: float) -> list[dict]:
    rows = []
    print(f"| family | class | what it exercises | lossless | MARS | trainer | greedy spec = greedy |", flush=True)
    print("|---|---|---|---|---|---|---|")
    for model_type, overrides, what in MATRIX:
        target = TargetModel(tiny_model(model_type, overrides))
        row = {"family": model_type, "class": type(target.model).__name__, "what": what,
               **check(target, copy_head(target), PROMPTS, new)}
        row["ok"] = _ok(row, tolerance)
        rows.append(row)
        print(f"| {model_type} | {row['class']} | {what} | {row['lossless']:.1e} | {row['mars']:.1e} | "
              f"{row['trainer']:.1e} | {'yes' if row['greedy_spec_equal'] else 'NO'} |", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--model", help="a Hugging Face model folder to check")
    what.add_argument("--matrix", action="store_true", help="every accepted family, as tiny random models")
    ap.add_argument("--drafter", help="an EAGLE-3 head folder for --model (adds speculation and MARS)")
    ap.add_argument("--prompts", type=int, default=4, help="random prompts (--model)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--tolerance", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if args.matrix:
        rows = run_matrix(args.max_new_tokens, args.tolerance)
    else:
        try:
            target, _ = load_target(TargetConfig(path=args.model))
            family_of(target.model)
        except UnsupportedModelError as err:
            print(f"refused: {err}", file=sys.stderr)
            return 2
        head = load_eagle3(Path(args.drafter), target) if args.drafter else None
        gen = torch.Generator().manual_seed(args.seed)
        prompts = [torch.randint(0, target.vocab_size, (int(n),), generator=gen).tolist()
                   for n in torch.randint(2, 24, (args.prompts,), generator=gen)]
        row = {"model": args.model, "class": type(target.model).__name__,
               **check(target, head, prompts, args.max_new_tokens, args.seed)}
        row["ok"] = _ok(row, args.tolerance)
        rows = [row]
        for key, value in row.items():
            print(f"{key:18s} {value:.2e}" if isinstance(value, float) else f"{key:18s} {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
