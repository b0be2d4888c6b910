"""The round records of :class:`rollout.engine.planner.RoundPlanner` (its ``trace``): why a round was
chosen (``REASONS``), the record each round leaves, written in two steps (the choice, then what
``observe`` measured), and :func:`trace_summary`, which counts them. The record's fields are
defined once, in :mod:`rollout.engine.planner`'s docstring. Pure: no clocks, no models."""

from __future__ import annotations

# why a round was chosen (``RoundPlanner.trace``)
NEW_BUCKET = "new bucket"  # the first plain round / cheapest draft measured at this batch bucket
BEST = "best"  # the best rate (speculative: by a clear gain)
NO_CLEAR_GAIN = "no clear gain"  # plain: a speculative option was best, but by less than hold / stay
REPROBE = "re-probe"  # an alternative run again to keep its measurements fresh
REASONS = (NEW_BUCKET, BEST, NO_CLEAR_GAIN, REPROBE)


def record_choice(trace: list[dict], call: int, round_: int, batch: int, k: int, why: str,
                  rates: dict[int, float]) -> None:
    """Append the record of a round as chosen: ``rates`` keyed by k as text."""
    trace.append({"call": call, "round": round_, "batch": batch, "k": k, "why": why,
                  "rates": {str(o): r for o, r in rates.items()}})


def record_measured(trace: list[dict] | None, round_: int, round_s: float, draft_s: float, emitted: list[int],
                    catch_up: bool) -> None:
    """Complete the record of round ``round_`` with what ``observe`` got, if the trace's last record
    is that round's and is not complete yet (no trace, or an empty one: nothing)."""
    if trace and trace[-1]["round"] == round_ and "round_s" not in trace[-1]:
        trace[-1].update(round_s=round_s, draft_s=draft_s, emitted=list(emitted), catch_up=catch_up)


def trace_summary(trace: list[dict]) -> dict:
    """Rounds of a planner trace (``RoundPlanner.trace``, or a slice of it) by choice and reason:
    ``{"rounds": n, "plain": {reason: n}, "draft": {reason: n}, "tokens": {"plain": t, "draft": t},
    "seconds": {"plain": s, "draft": s}}`` (tokens and seconds over the rounds that were measured;
    seconds include drafting)."""
    out = {"rounds": len(trace), "plain": {}, "draft": {}, "tokens": {"plain": 0, "draft": 0},
           "seconds": {"plain": 0.0, "draft": 0.0}}
    for r in trace:
        side = "draft" if r["k"] else "plain"
        out[side][r["why"]] = out[side].get(r["why"], 0) + 1
        if "round_s" in r:
            out["tokens"][side] += sum(r["emitted"])
            out["seconds"][side] += r["round_s"] + r["draft_s"]
    return out
