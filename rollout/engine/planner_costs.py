"""The measured costs behind :class:`rollout.engine.planner.RoundPlanner`: a robust recent value of a
noisy measurement (:class:`Recent`) and the cost curve of a round over its block rows
(:func:`pooled_curve`, read with :func:`read_curve`). Pure: no clocks, no models."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field
from statistics import median


@dataclass
class Recent:
    """The median of the last ``keep`` measurements taken within ``window`` rounds of the newest
    one: one round slowed by another process does not move it, a lasting change of cost does
    within a few rounds, and an option measured only now and then is judged on its latest
    measurements, not on ones from a time when the machine was busier (or idler)."""

    keep: int = 5
    window: int = 48
    values: list[tuple[int, float]] = field(default_factory=list)  # (planner round, seconds)

    def add(self, x: float, now: int = 0) -> None:
        self.values = (self.values + [(now, x)])[-self.keep:]

    def fresh(self) -> list[float]:
        newest = self.values[-1][0]
        return [v for t, v in self.values if newest - t <= self.window]

    @property
    def value(self) -> float:
        return median(self.fresh())


def pooled_curve(points: list[tuple[float, float]]) -> list[tuple[float, float]] | None:
    """Points (block rows, seconds) made non-decreasing in rows by pooling adjacent violators
    (and points at the same rows) into their mean: a forward never gets cheaper with more rows,
    and a point measured in a quiet second next to one measured in a busy one is averaged with
    it rather than read as a block that costs less than a plain round over fewer rows. None:
    fewer than two distinct row counts."""
    raw = sorted(points)
    if len({x for x, _ in raw}) < 2:
        return None
    blocks: list[list[float]] = []  # [x sum, y sum, count] of pooled points

    def mean(block: list[float], i: int) -> float:
        return block[i] / block[2]

    for x, y in raw:
        blocks.append([x, y, 1.0])
        while len(blocks) > 1 and (mean(blocks[-2], 1) >= mean(blocks[-1], 1)
                                   or mean(blocks[-2], 0) == mean(blocks[-1], 0)):
            last = blocks.pop()
            blocks[-1] = [a + c for a, c in zip(blocks[-1], last)]
    return [(mean(b, 0), mean(b, 1)) for b in blocks]


def read_curve(curve: list[tuple[float, float]], x: float) -> float:
    """The curve at ``x`` rows: linear between its points, beyond them along the nearest segment
    (flat when every point pooled into one); at least 1e-9."""
    if len(curve) == 1:
        return curve[0][1]
    i = min(max(1, bisect_left([p[0] for p in curve], x)), len(curve) - 1)
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    return max(1e-9, y0 + (y1 - y0) / (x1 - x0) * (x - x0))


def covers(curve: list[tuple[float, float]] | None, x: float) -> bool:
    """Whether ``x`` lies between the curve's first and last points (read, not extrapolated)."""
    return curve is not None and len(curve) > 1 and curve[0][0] <= x <= curve[-1][0]
