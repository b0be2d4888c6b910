"""How much tau any lossless verifier could get from a head: the joint-overlap ceiling, teacher-forced.

    python -m scripts.research.measure_ceiling [--head DIR] [--prompts 96] [--samples 2] [--k 6]
        [--max-new-tokens 96] [--seed 7] [--batch-size 16] [--json OUT]

The target answers the benchmarks' prompts (``benchmark_prompts``: held-out arithmetic,
difficulties 1-3, the prompts ``bench_rollout --seed`` uses) ``--samples`` times each at T = 1,
and every answer is teacher-forced through the head's chain (``ttt_acceptance(block=True)``,
``trainers/drafter/ttt.py``). Per chain step s (s = 0..K-1), over the answers' positions:

- **token**: the overlap sum_v min(p_s, q_s) of the target's and the head's next-token laws
  after the target's own tokens. Token-by-token verification accepts draft s with this
  probability, given that it reached it. ``tau_token`` = 1 + sum_k prod_{s<k} token_s is the chain
  estimate of its tau.
- **joint**: the overlap sum over x_1..x_s+1 of min(P, Q) of the target's and the head's laws of
  the next s + 1 tokens (estimated along the target's samples). It bounds from above how often
  any lossless verifier accepts s + 1 drafts (a coupling bound), so ``ceiling`` = 1 + the sum
  of the first K is the most tau any lossless verifier of one drafted chain can reach.

Block verification (``verifier.test: block``) is the best lossless verifier of one chain (Sun et
al., 2024), and it need not reach the ceiling: the bounds of different prefix lengths need not
be reachable together. Compare the ceiling with the engine's tau (``bench_rollout`` or
``measure_acceptance`` with ``lossless:test=block``). A head whose ceiling is below a goal
cannot reach it with any lossless verifier of one chain; trees (several drafted paths) have no
such bound here.
"""

from __future__ import annotations

import argparse
import json

import torch

from rollout.eagle3 import default_head_path, load_eagle3
from rollout.models import load_embedded_target
from scripts.cli import head_folder
from trainers.drafter.data import DrafterData, collate, generate_dataset
from trainers.drafter.ttt import estimated_block_tau, estimated_tau, ttt_acceptance
from trainers.tasks.general import benchmark_prompts


def measure(head, data: DrafterData, k: int, batch_size: int = 16) -> dict:
    """Per-step token and joint overlaps of ``head`` over ``data`` (answers sampled at T = 1) for
    chains of ``k`` drafts, and the two tau figures of the module docstring."""
    sums: dict[str, torch.Tensor] | None = None
    with torch.no_grad():
        for start in range(0, len(data), batch_size):
            batch = collate(data, list(range(start, min(len(data), start + batch_size))))
            part = ttt_acceptance(head, batch, k, (head.cfg.logit_scale,), block=True)
            sums = part if sums is None else {key: sums[key] + part[key] for key in part}
    assert sums is not None
    token = (sums["acc_t1"][0] / sums["count"].clamp(min=1)).tolist()
    joint = (sums["acc_block"][0] / sums["count_block"].clamp(min=1)).tolist()
    return {"k": k, "positions": int(sums["count"][0]), "chains": [int(c) for c in sums["count_block"]],
            "token": token, "joint": joint, "tau_token": estimated_tau(token), "ceiling": estimated_block_tau(joint)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--head", default=None, type=head_folder, help="draft head folder (default: the shipped head)")
    ap.add_argument("--prompts", type=int, default=96, help="benchmark prompts (held-out arithmetic, difficulties 1-3)")
    ap.add_argument("--samples", type=int, default=2, help="answers per prompt, each sampled at T = 1")
    ap.add_argument("--k", type=int, default=6, help="chain length K")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=7, help="the prompts' seed (bench_rollout's --seed) and the answers'")
    ap.add_argument("--batch-size", type=int, default=16, help="answers per teacher-forced batch")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    for name in ("prompts", "samples", "k", "max_new_tokens", "batch_size"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    target, tok = load_embedded_target()
    head = load_eagle3(args.head or default_head_path(), target).eval()
    prompts = benchmark_prompts(tok, args.prompts, args.seed)
    data = generate_dataset(target, prompts, ["bench"] * len(prompts), max_new_tokens=args.max_new_tokens,
                            batch_size=48, greedy_fraction=0.0, gen=torch.Generator().manual_seed(args.seed),
                            samples_per_prompt=args.samples)
    out = {"head": args.head or "shipped", "prompts": args.prompts, "samples": args.samples, "seed": args.seed,
           "answers": len(data), "response_tokens": int(data.response_tokens().numel()),
           **measure(head, data, args.k, args.batch_size)}
    print(f"{out['answers']} answers, {out['response_tokens']} response tokens; chain K = {args.k}")
    print("step   token  joint")
    for s, (a, b) in enumerate(zip(out["token"], out["joint"])):
        print(f"{s:4d}  {a:.4f} {b:.4f}")
    print(f"tau token by token (estimate) {out['tau_token']:.3f}; ceiling of any lossless verifier "
          f"{out['ceiling']:.3f}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
