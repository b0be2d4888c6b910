"""The planner tests' simulated calls and synthetic costs (deterministic; no models); no test
functions here."""

from __future__ import annotations

from rollout.engine.planner import RoundPlanner


def simulate(planner: RoundPlanner, batch: int, rounds: int, cost, accept: float, draft: float = 0.0,
             switch: float = 0.0) -> list[int]:
    """Run ``rounds`` rounds (one call) over ``batch`` rows: option k costs ``cost(batch, k)``
    seconds without drafting and ``k * draft`` drafting, plus ``switch`` when it drafts after a
    plain round or first in the call (the catch-up); every row accepts each draft with
    probability ``accept`` (the planner sees the expected counts, deterministically)."""
    chosen = []
    last = 0  # before the first round: the prefill (the first draft runs over the prompt)
    for _ in range(rounds):
        k = planner.choose(batch)
        chosen.append(k)
        if k == 0:
            emitted = [1] * batch
        else:  # rows split so that depth j is reached with the geometric frequencies
            emitted = []
            for r in range(batch * 8):
                u = (r + 0.5) / (batch * 8)
                a = 0
                while a < k and u < accept ** (a + 1):
                    a += 1
                emitted.append(a + 1)
        catch_up = k > 0 and last == 0
        planner.observe(batch, k, cost(batch, k), k * draft + (switch if catch_up else 0.0), emitted,
                        catch_up=catch_up)
        last = k
    return chosen


def spent(chosen: list[int], batch: int, cost, draft: float, switch: float) -> float:
    """Seconds the rounds of ``simulate`` took."""
    return sum(cost(batch, k) + k * draft + (switch if k and prev == 0 else 0.0)
               for prev, k in zip([0, *chosen], chosen))


def cpu_like(b: int, k: int) -> float:
    """A forward's cost grows with its tokens once the batch has rows: b * (k + 1) tokens."""
    return 1.0 + 0.08 * b * (k + 1)


def kernel_like(b: int, k: int) -> float:
    """Costs shaped like the engine's on this CPU: nearly flat up to about 16 rows in a forward
    (the native kernel reads the weights once), then growing with the rows (bound by FMAs)."""
    rows = b * (k + 1)
    return 1.0 + 0.02 * rows + 0.07 * max(0, rows - 16)
