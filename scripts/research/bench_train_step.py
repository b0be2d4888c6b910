"""The trainer's forward + backward over one GRPO batch, four ways side by side in one run.

    python -m scripts.research.bench_train_step [--config configs/default.yaml] [--from-run runs/default]
        [--step 1] [--reps 3]

- ``all positions, batch order``: whole rows, lm_head over every position, micro-batches cut
  in the batch's order (the trainer before commit 2542b67);
- ``kept positions, length order``: whole rows, lm_head only from the first position that
  predicts a completion token, micro-batches of similar lengths (from commit 2542b67);
- ``prompts cached``: each distinct prompt of a micro-batch runs once and its rows take its KV
  cache (``forward_plan``'s ``cached`` path where it applies, micro-batches planned for it);
- ``planned paths``: what the trainer does: per micro-batch the cheapest of whole rows, the
  cached prompt and the packed group (``trainers.grpo.forward_plan``), micro-batches planned.

The batch is the config's step (its prompts, group size, micro-batch and temperature) with
the completions a run recorded at that step (``--from-run``: its ``rollouts.jsonl``), or,
without one, random completions of 8 to max_new_tokens tokens. Prints the paths each planned
variant runs, each variant's median seconds, its ratio to the first, and the largest
log-prob difference from the first (the four compute the same values up to float rounding).
"""

from __future__ import annotations

import os

os.environ.setdefault("MKL_CBWR", "AVX2")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

VARIANTS = ("all positions, batch order", "kept positions, length order", "prompts cached", "planned paths")
# the paths each variant may take (forward_plan.PATHS)
VARIANT_PATHS = (("whole",), ("whole",), ("whole", "cached"), ("whole", "cached", "packed"))


class AllPositions(torch.nn.Module):
    """The model behind a forward that takes no ``logits_to_keep``: lm_head sees every position."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, input_ids, attention_mask, use_cache):
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=use_cache)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/default.yaml", help="training YAML")
    ap.add_argument("--from-run", help="a run folder whose rollouts.jsonl gives the completions")
    ap.add_argument("--step", type=int, default=1, help="the step (1-based) whose batch is timed")
    ap.add_argument("--reps", type=int, default=3, help="timed passes of each variant, interleaved")
    return ap.parse_args(argv)


def completions(args, cfg, n: int) -> list[list[int]]:
    if args.from_run is None:
        g = torch.Generator().manual_seed(args.step)
        lengths = torch.randint(8, cfg.rollout.sampling.max_new_tokens + 1, (n,), generator=g)
        return [torch.randint(100, 40000, (int(k),), generator=g).tolist() for k in lengths]
    from trainers.grpo.report import read_jsonl

    path = Path(args.from_run) / "rollouts.jsonl"
    if not path.is_file():
        raise ValueError(f"--from-run: {path} does not exist")
    outs = [r["completion_ids"] for r in read_jsonl(path) if r["step"] == args.step]
    if len(outs) != n:
        raise ValueError(f"--from-run: {path} holds {len(outs)} completions at step {args.step}, the config's "
                         f"batch is {n} (prompts_per_step x group_size)")
    return outs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from rollout.chat import chat_ids
    from rollout.config import ConfigError
    from rollout.models import load_target
    from trainers.grpo.config import load_train_config
    from trainers.grpo.forward_plan import ForwardCost, choose_path, length_order, micro_batches
    from trainers.grpo.loop import ProblemSource
    from trainers.grpo.policy import completion_logprobs

    try:
        if args.step < 1 or args.reps < 1:
            raise ValueError("--step and --reps must be >= 1")
        cfg = load_train_config(args.config)
        n = cfg.task.prompts_per_step * cfg.grpo.group_size
        outs = completions(args, cfg, n)
    except (ConfigError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    target, tok = load_target(cfg.model.target)
    model = target.model.eval()
    problems = ProblemSource(cfg).for_step(args.step - 1)
    prompts = [chat_ids(tok, p.prompt, system=cfg.task.system_prompt) for p in problems for _ in range(cfg.grpo.group_size)]
    pad, mb, temp = tok.pad_token_id or 0, cfg.optim.micro_batch, cfg.rollout.sampling.temperature
    print(f"{n} rows, prompts {min(map(len, prompts))}-{max(map(len, prompts))} tokens, completions "
          f"{sum(map(len, outs)) / n:.1f} tokens on average (max {max(map(len, outs))}), micro-batch {mb}, "
          f"{torch.get_num_threads()} threads (as the trainer's process)", flush=True)
    wrapped, width = AllPositions(model), max(map(len, outs))

    cost = ForwardCost.of(model.config)
    plans = []  # per variant: [(rows, path)] per micro-batch
    for v, paths in enumerate(VARIANT_PATHS):
        if v == 0:
            cut = [list(range(a, min(a + mb, n))) for a in range(0, n, mb)]
        elif v == 1:
            order = length_order(prompts, outs)
            cut = [order[a:a + mb] for a in range(0, n, mb)]
        else:
            cut = micro_batches(prompts, outs, mb, cost=cost, paths=paths)
        plans.append([(rows, choose_path([prompts[i] for i in rows], [outs[i] for i in rows], cost, paths)[0])
                      for rows in cut])
        if v >= 2:
            print(f"  {VARIANTS[v]}: micro-batches of {[len(r) for r, _ in plans[v]]} rows by "
                  f"{', '.join(p for _, p in plans[v])}", flush=True)

    def run(variant: int) -> tuple[float, torch.Tensor]:
        net = wrapped if variant == 0 else model
        logp = torch.zeros(n, width)
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        for rows, path in plans[variant]:
            lp, _ = completion_logprobs(net, [prompts[i] for i in rows], [outs[i] for i in rows],
                                        temperature=temp, pad_id=pad, path=None if variant == 0 else path)
            lp.sum().backward()
            logp[rows, :lp.shape[1]] = lp.detach()
        return time.perf_counter() - t0, logp

    for v in range(len(VARIANTS)):  # warm-up
        run(v)
    times: list[list[float]] = [[] for _ in VARIANTS]
    values: list[torch.Tensor] = [torch.empty(0)] * len(VARIANTS)
    for rep in range(args.reps):
        for v in range(len(VARIANTS)):
            dt, values[v] = run(v)
            times[v].append(dt)
        print(f"  pass {rep + 1}/{args.reps}: " + ", ".join(f"{t[-1]:.2f} s" for t in times), flush=True)
    base = statistics.median(times[0])
    print(f"{'variant':32s} {'median s':>9s} {'speedup':>8s} {'max |dlogp|':>12s}")
    for v, name in enumerate(VARIANTS):
        med = statistics.median(times[v])
        diff = float((values[v] - values[0]).abs().max())
        print(f"{name:32s} {med:9.2f} {base / med:7.2f}x {diff:12.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
