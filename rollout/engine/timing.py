"""Step costs of the engine's model runner, measured on a group of prompts.

The benchmarks and ``scripts.measure_acceptance`` time a target forward over ``n`` block
tokens per row (``T(n)``) and one draft step the way the engine runs them (after the
prefill, on the runner's caches, with the engine's linear layers: ``Engine.linear_routing``),
so their numbers compare with the engine's own.
"""

from __future__ import annotations

import time

import torch

from rollout.engine.engine import Engine
from rollout.engine.runner import ModelRunner


def upper_median(xs: list[float]) -> float:
    """The middle value (of an even count, the upper of the two middle ones): a measured time,
    not an average of two."""
    xs = sorted(xs)
    return xs[len(xs) // 2]


CHAIN = "chain"  # step-cost keys of one-call chains: CHAIN + K


def chain_key(k: int) -> str:
    """The step-cost key of a chain of ``k`` drafts after the root in one C++ call."""
    return f"{CHAIN}{k}"


def cost_label(key) -> str:
    """How a step cost of :func:`step_costs` is printed: T(n), T_draft, T_chain(K)."""
    if key == "draft":
        return "T_draft"
    return f"T_chain({key[len(CHAIN):]})" if str(key).startswith(CHAIN) else f"T({key})"


def step_costs(engine: Engine, group: list[list[int]], blocks: list[int], reps: int, raw: bool = False,
               chains: tuple[int, ...] = (), temperature: float = 1.0) -> dict:
    """Median seconds of a target forward over ``n`` block tokens per row (``T(n)``) for each n
    in ``blocks``, and of one draft step (``draft``), on ``group`` after its prefill; the
    measurements are interleaved rep by rep. ``raw``: every timed repetition's seconds (a list
    per step) instead of their median.

    ``chains``: also, for each k, a chain of k drafts after the root drafted in one C++ call
    (``ModelRunner.draft_chain``: k draws at ``temperature``, greedy at 0, and k - 1 draft steps;
    key :func:`chain_key`), as the engine drafts sampled and greedy chains; left out where that
    call does not run here (no AVX-512, the engine's ``EngineOptions(draft_chains=False)``), so a
    round's drafting is then timed one step at a time. Every step runs under the engine's options."""
    runner = ModelRunner(engine.target, engine.head, engine.prefill_tokens, options=engine.options)
    times: dict = {n: [] for n in blocks}
    times["draft"] = []
    chains = tuple(chains) if engine.head is not None else ()
    times |= {chain_key(k): [] for k in chains}
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode(), engine.linear_routing(engine.head):
        logits = runner.start(group, max(len(p) for p in group) + max([*blocks, *chains]) + 8)
        runner.set_first_tokens(logits.argmax(-1))
        root = runner.draft_root() if engine.head is not None else None
        for rep in range(reps + 1):  # rep 0 warms up
            for n in blocks:
                block = runner.pending[:, None].expand(-1, n).contiguous()
                t0 = time.perf_counter()
                runner.verify_forward(block, torch.arange(n, device=block.device)[None], None)
                if rep:
                    times[n].append(time.perf_counter() - t0)
            if root is None:
                continue
            runner.drop_speculation()  # every timed draft step is the round's first one
            t0 = time.perf_counter()
            runner.draft_step(runner.draft_ids[:1].expand(len(group))[:, None], root.hidden[:, None], 1, None)
            if rep:
                times["draft"].append(time.perf_counter() - t0)
            for k in chains:
                runner.drop_speculation()
                t0 = time.perf_counter()  # the uniforms are drawn in the timed span, as the engine does
                uniforms = torch.rand(k, len(group), generator=generator, dtype=torch.float64) \
                    if temperature > 0 else None
                ran = runner.draft_chain(root.logits, root.hidden, k, temperature, uniforms)
                if rep and ran is not None:
                    times[chain_key(k)].append(time.perf_counter() - t0)
    return {k: (v if raw else upper_median(v)) for k, v in times.items() if v}


