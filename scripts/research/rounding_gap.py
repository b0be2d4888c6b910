"""What rounding the rollout copy's weights to bf16 (the hf backend's ``weights: bfloat16``) does
to the rollout distribution: completions are sampled from the rounded copy (plain decoding),
then every token is scored by the rounded and by the exact model's plain forwards.

    python -m scripts.research.rounding_gap --prompts 16 --max-new-tokens 96 [--rounding bfloat16_nearest]
    python -m scripts.research.rounding_gap --policy runs/x/checkpoints/step_000004

Prints, over the completion tokens: the per-token KL(rounded || exact) over the whole
vocabulary (mean, max), the log-ratio log pi(y) - log P(y) that the trainer's importance
weights correct (mean |.|, max |.|), and the effective sample size of the token and of the
sequence weights (1 = on-policy). It also checks that the engine's behaviour log-probs are the
rounded model's. Target: the embedded SmolLM2-135M-Instruct; prompts: held-out arithmetic.
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AVX2")  # before torch loads MKL: fast small matmuls on AMD CPUs

import argparse  # noqa: E402
import copy  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

from rollout.engine.engine import Engine, available_cores  # noqa: E402
from rollout.models import WEIGHT_ROUNDINGS, TargetModel, load_embedded_target, round_weights_  # noqa: E402
from rollout.params import SamplingParams, SpecConfig  # noqa: E402
from scripts.cli import checkpoint_folder  # noqa: E402
from trainers.drift.stats import effective_sample_size, sequence_ess  # noqa: E402
from trainers.grpo.checkpoint import read_policy  # noqa: E402
from trainers.tasks.general import benchmark_prompts  # noqa: E402


def _logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """[len(completion), V] float64 log-softmax of ``model``'s plain forward at each completion position."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion]), use_cache=False).logits[0]
    return torch.log_softmax(logits[len(prompt) - 1:-1].double(), -1)


def rounding_gap(target: TargetModel, prompts: list[list[int]], sampling: SamplingParams, seed: int,
                 threads: int | None = None, rounding: str = "bfloat16") -> dict:
    """Sample from a copy of ``target`` (left as it is) rounded as ``rounding`` says
    (``rollout.models.WEIGHT_ROUNDINGS``) and score both (see the module docstring). The
    sampling temperature must be 1: the log-probs are of the raw softmax."""
    if sampling.temperature != 1.0 or sampling.top_k is not None or sampling.top_p not in (None, 1.0):
        raise ValueError("rounding_gap scores the raw softmax: sample at temperature 1.0 without top-k / top-p")
    rounded = copy.deepcopy(target)
    round_weights_(rounded.model, rounding, seed=seed)
    completions = Engine(rounded, None, num_threads=threads).generate(
        prompts, sampling, SpecConfig(mode="off"), seed=seed).completions
    kls, ratios, sequences, engine_gap = [], [], [], 0.0
    for prompt, c in zip(prompts, completions):
        y = torch.tensor(c.completion_ids)[:, None]
        if not len(y):
            continue
        lp_rounded = _logprobs(rounded.model, prompt, c.completion_ids)
        lp_exact = _logprobs(target.model, prompt, c.completion_ids)
        kls.append((lp_rounded.exp() * (lp_rounded - lp_exact)).sum(-1))
        ratio = (lp_exact.gather(-1, y) - lp_rounded.gather(-1, y))[:, 0]
        ratios.append(ratio)
        sequences.append(ratio.sum())
        behaviour = torch.tensor(c.behaviour_logprobs, dtype=torch.float64)
        engine_gap = max(engine_gap, float((behaviour - lp_rounded.gather(-1, y)[:, 0]).abs().max()))
    kl, ratio, seq = torch.cat(kls), torch.cat(ratios), torch.stack(sequences)
    return {"tokens": len(kl), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "log_ratio_abs_mean": float(ratio.abs().mean()), "log_ratio_abs_max": float(ratio.abs().max()),
            "token_ess": effective_sample_size(ratio.exp()), "sequence_log_ratio_abs_max": float(seq.abs().max()),
            "sequence_ess": sequence_ess(seq), "behaviour_vs_rounded_max": engine_gap}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--rounding", default="bfloat16", choices=WEIGHT_ROUNDINGS[1:],
                    help="stochastic (bfloat16, the hf backend's default rounding) or nearest")
    ap.add_argument("--policy", default=None, type=checkpoint_folder, metavar="CHECKPOINT",
                    help="the policy of a training checkpoint folder (runs/NAME/checkpoints/step_N; default: the "
                         "embedded model as shipped)")
    args = ap.parse_args(argv)
    target, tok = load_embedded_target()
    if args.policy:
        target.model.load_state_dict(read_policy(Path(args.policy))[0])
    prompts = benchmark_prompts(tok, args.prompts, args.seed)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(tok.eos_token_id,))
    g = rounding_gap(target, prompts, sampling, args.seed, available_cores(), args.rounding)
    print(f"{g['tokens']} completion tokens of {len(prompts)} prompts, sampled at T = 1 from the copy rounded "
          f"by {args.rounding}")
    print(f"KL(rounded || exact) per token: mean {g['kl_mean']:.2e}, max {g['kl_max']:.2e}")
    print(f"|log pi(y) - log P(y)|: mean {g['log_ratio_abs_mean']:.2e}, max {g['log_ratio_abs_max']:.2e}; "
          f"per sequence max {g['sequence_log_ratio_abs_max']:.3f}")
    print(f"ESS of the importance weights: per token {g['token_ess']:.5f}, per sequence {g['sequence_ess']:.4f}")
    print(f"the engine's behaviour log-probs against the rounded model's plain forward: max |diff| "
          f"{g['behaviour_vs_rounded_max']:.1e}")


if __name__ == "__main__":
    main()
