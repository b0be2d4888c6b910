"""Step costs of the engine's model runner, measured on a group of prompts.

The benchmarks and ``scripts.measure_acceptance`` time a target forward over ``n`` block
tokens per row (``T(n)``) and one draft step the way the engine runs them (after the
prefill, on the runner's caches, with the engine's linear layers: ``Engine.linear_routing``),
so their numbers compare with the engine's own.
"""

from __future__ import annotations

import time

import torch

from rollout.engine import Engine
from rollout.runner import ModelRunner


def upper_median(xs: list[float]) -> float:
    """The middle value (of an even count, the upper of the two middle ones): a measured time,
    not an average of two."""
    xs = sorted(xs)
    return xs[len(xs) // 2]


def step_costs(engine: Engine, group: list[list[int]], blocks: list[int], reps: int, raw: bool = False) -> dict:
    """Median seconds of a target forward over ``n`` block tokens per row (``T(n)``) for each n
    in ``blocks``, and of one draft step (``draft``), on ``group`` after its prefill; the
    measurements are interleaved rep by rep. ``raw``: every timed repetition's seconds (a list
    per step) instead of their median."""
    runner = ModelRunner(engine.target, engine.head, engine.prefill_tokens)
    times: dict = {n: [] for n in blocks}
    times["draft"] = []
    with torch.inference_mode(), engine.linear_routing(engine.head):
        logits = runner.start(group, max(len(p) for p in group) + max(blocks) + 8)
        runner.set_first_tokens(logits.argmax(-1))
        hidden = runner.draft_root().hidden if engine.head is not None else None
        for rep in range(reps + 1):  # rep 0 warms up
            for n in blocks:
                block = runner.pending[:, None].expand(-1, n).contiguous()
                t0 = time.perf_counter()
                runner.verify_forward(block, torch.arange(n, device=block.device)[None], None)
                if rep:
                    times[n].append(time.perf_counter() - t0)
            if engine.head is not None:
                runner.drop_speculation()  # every timed draft step is the round's first one
                t0 = time.perf_counter()
                runner.draft_step(runner.draft_ids[:1].expand(len(group))[:, None], hidden[:, None], 1, None)
                if rep:
                    times["draft"].append(time.perf_counter() - t0)
    return {k: (v if raw else upper_median(v)) for k, v in times.items() if v}


