"""What block verification gains on the engine's own rounds: expected tokens per round, token by
token against as a block, on the same drafted chains.

    python -m scripts.research.block_gain [--k 4,6,8] [--n-arith 8] [--n-general 8] [--max-new-tokens 96]
        [--temperature 1.0] [--seed 7] [--head DIR] [--json OUT]

The engine generates from held-out prompts (arithmetic and general instructions, batch 1) with a
lossless chain of K sampled drafts, verified token by token. Every round's target logits, draft
logits and drafts are recorded, and ``verifiers.block.expected_accepted`` gives the expected
drafts accepted by each verification given those drafts. Comparing expectations on the same
rounds removes the sampling noise that separate runs of each verifier carry (their completions
differ: tau moved by 0.2-0.4 between rows of one ``bench_rollout`` run). The printed tau is 1 +
the mean expected accepted drafts per row per round: tokens per verifying forward.
"""

from __future__ import annotations

import argparse
import contextlib
import json

import torch

from rollout.chat import chat_ids
from rollout.eagle3 import default_head_path, load_eagle3
import rollout.engine.engine as engine_module
from rollout.engine.engine import Engine
from rollout.models import load_embedded_target
from rollout.params import SamplingParams, SpecConfig
from scripts.cli import head_folder
from trainers.tasks.general import heldout_prompts
from verifiers.block import expected_accepted
from verifiers.processing import draft_probs, target_probs


@contextlib.contextmanager
def recorded_rounds(sampling: SamplingParams):
    """Inside the block, every chain round the engine verifies adds its expected accepted drafts
    per row, (token by token, as a block), to the yielded list."""
    rounds: list[tuple[torch.Tensor, torch.Tensor]] = []
    verify = engine_module.verify_chain

    def recording(rule, target_logits, draft_logits, draft_tokens, **kw):
        if draft_tokens.shape[1]:
            p = target_probs(target_logits, sampling.temperature, sampling.top_k, sampling.top_p)
            rounds.append(expected_accepted(p, draft_probs(draft_logits, sampling.temperature), draft_tokens.long()))
        return verify(rule, target_logits, draft_logits, draft_tokens, **kw)

    engine_module.verify_chain = recording
    try:
        yield rounds
    finally:
        engine_module.verify_chain = verify


def measure(engine: Engine, prompts: list[list[int]], k: int, sampling: SamplingParams, seed: int) -> dict:
    """Tau per verifying forward, token by token and as a block, over every round of one call per
    prompt (seeds ``seed`` onwards)."""
    spec = SpecConfig(mode="chain", num_draft_tokens=k)
    with recorded_rounds(sampling) as rounds:
        for i, prompt in enumerate(prompts):
            engine.generate([prompt], sampling, spec, None, seed=seed + i)
    if not rounds:
        raise SystemExit("no speculative round ran (every completion ended at its first token)")
    token, block = (torch.cat(parts) for parts in zip(*rounds))
    tau_token, tau_block = 1 + float(token.mean()), 1 + float(block.mean())
    return {"k": k, "rounds": len(token), "tau_token": tau_token, "tau_block": tau_block,
            "ratio": tau_block / tau_token}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", default="4,6,8", help="chain lengths (comma list)")
    ap.add_argument("--n-arith", type=int, default=8)
    ap.add_argument("--n-general", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--head", default=None, type=head_folder, help="draft head folder (default: the shipped head)")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0 (at T = 0 both verifications are the greedy test)")
    try:
        ks = [int(k) for k in args.k.split(",") if k.strip()]
    except ValueError:
        raise SystemExit(f"--k: expected a comma list of integers, got {args.k!r}") from None
    if not ks or min(ks) < 1:
        raise SystemExit(f"--k: chain lengths must be >= 1, got {args.k!r}")
    target, tok = load_embedded_target()
    head = load_eagle3(args.head or default_head_path(), target)
    engine = Engine(target, head, num_threads=torch.get_num_threads())
    eos = target.config.eos_token_id
    sampling = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                              stop_token_ids=(int(eos[0] if isinstance(eos, list) else eos),))
    results = []
    print(f"T = {args.temperature}, {args.max_new_tokens} tokens, batch 1; tau = tokens per verifying forward")
    texts, kinds = heldout_prompts(args.n_arith, (1, 2, 3, 4), 1234, args.n_general)  # measure_acceptance's sets
    for kind in ("arithmetic", "general"):
        prompts = [chat_ids(tok, t) for t, k in zip(texts, kinds) if k == kind]
        for k in ks if prompts else []:
            row = {"prompts": kind, "n": len(prompts), **measure(engine, prompts, k, sampling, args.seed)}
            results.append(row)
            print(f"{kind:10s} K = {k}: {row['rounds']:4d} rounds, tau token by token {row['tau_token']:.3f}, "
                  f"as a block {row['tau_block']:.3f} ({100 * (row['ratio'] - 1):+.1f}%)", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
