"""A PNG of ``scripts/bench_rollout.py``'s rows: each configuration's speedup over our
autoregressive mode next to the bound its measured tau and step costs allow; or of its
``--planner-trace`` file: what the ``max_batch: auto`` planner chose, round by round, and why.

    python -m scripts.bench_rollout ... --plot speed.png        # at the end of a run
    python -m scripts.bench_plot OUT.json [--out speed.png]     # from a run's --json file
    python -m scripts.bench_plot plans.json [--out plans.png]   # from a run's --planner-trace file

One panel per batch size; per row a bar for the whole call's speedup, a dot for the decoding
alone (``dec AR``), a black tick for the bound and a grey one for the bound with each call's
setup put back (``call bd``; rows without a bound, e.g. ``max_batch: auto``, have neither). The
gap between bar and grey tick is the engine's distance from its own cost model over whole calls;
the line at 1.0 is our autoregressive mode.

A planner trace: one panel per auto row and batch size; each round a dot at its draft length
(0: plain), coloured by the reason (``rollout.engine.planner.REASONS``), a dotted line where a call
begins, and on the right axis the tokens each row emitted, averaged over 8 rounds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rollout.engine.planner import BEST, NEW_BUCKET, NO_CLEAR_GAIN, REPROBE
from trainers.drift.plots import _plt, _save


def plot_data(rows: list[dict]) -> dict[int, list[dict]]:
    """Per batch size (ascending), the rows to draw in run order: ``label``, ``speedup`` (whole
    call), ``decode`` (decoding alone), ``bound`` and ``call_bound`` (None where a row has none; a
    file from before ``call_bound`` existed has None there). Rows without a
    speedup over the autoregressive mode (HF generate) are left out; ValueError when none is left."""
    out: dict[int, list[dict]] = {}
    for r in rows:
        if r.get("speedup_vs_ar") is None or r["mode"] == "hf generate":
            continue
        out.setdefault(r["batch"], []).append({
            "label": f"{r['mode']}  {r['verifier']}", "speedup": r["speedup_vs_ar"], "tau": r["tau"],
            "decode": r.get("decode_vs_ar"), "bound": r.get("bound"), "call_bound": r.get("call_bound"),
            "plain": r["mode"].startswith("off")})
    if not out:
        raise ValueError("no rows with a speedup over the autoregressive mode to plot")
    return dict(sorted(out.items()))


def plot_rows(rows: list[dict], path: str | Path) -> Path:
    """Write the figure of ``rows`` (``bench_measure.measure``'s dicts, or a ``--json`` file's
    ``results``) to ``path``."""
    data = plot_data(rows)
    plt = _plt()
    heights = [len(v) for v in data.values()]
    fig, axes = plt.subplots(len(data), 1, figsize=(10, 1.2 + 0.32 * sum(heights) + 0.6 * len(data)),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    top = max(max(d["speedup"], d["bound"] or 0, d["decode"] or 0) for v in data.values() for d in v)
    for ax, (size, mine) in zip(axes[:, 0], data.items()):
        ys = list(range(len(mine)))[::-1]
        ax.barh(ys, [d["speedup"] for d in mine], height=0.6, label="whole call",
                color=["tab:grey" if d["plain"] else "tab:blue" for d in mine])
        for key, style, name in (("decode", dict(marker="o", color="tab:orange", ms=5), "decoding alone"),
                                 ("bound", dict(marker="|", color="black", ms=16, mew=2.5), "bound"),
                                 ("call_bound", dict(marker="|", color="tab:grey", ms=16, mew=2.5),
                                  "bound with setup")):
            pts = [(d[key], y) for d, y in zip(mine, ys) if d[key] is not None]
            if pts:
                ax.plot(*zip(*pts), ls="none", label=name, **style)
        for d, y in zip(mine, ys):  # the figures right of the row's furthest mark
            x = max(d["speedup"], d["bound"] or 0, d["decode"] or 0)
            ax.annotate(f"{d['speedup']:.2f}x  tau {d['tau']:.2f}", (x, y), xytext=(7, -3),
                        textcoords="offset points", fontsize=7)
        ax.axvline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_yticks(ys)
        ax.set_yticklabels([d["label"] for d in mine], fontsize=8)
        ax.set_xlim(0, top * 1.25)
        ax.set_title(f"batch {size}: speedup over our autoregressive mode", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
    axes[-1, 0].set_xlabel("x our autoregressive mode (tokens/s)")
    return _save(fig, Path(path))


REASON_COLOURS = {BEST: "tab:blue", REPROBE: "tab:orange", NO_CLEAR_GAIN: "tab:red", NEW_BUCKET: "tab:grey"}


def plan_data(traces: list[dict]) -> list[dict]:
    """Per traced row (a ``--planner-trace`` file's entries, in order): ``label``, ``k``, ``why`` and
    ``tokens`` (mean tokens a row emitted; None where the round was not measured) per round,
    ``starts`` (the round indices where a call begins) and ``plain`` (the share of plain rounds).
    ValueError for entries without rounds or not shaped like the file's."""
    out = []
    for t in traces:
        if not isinstance(t, dict) or not {"batch", "mode", "verifier", "rounds"} <= set(t) or not t["rounds"]:
            raise ValueError("not a bench_rollout --planner-trace entry (batch, mode, verifier and rounds)")
        rounds = t["rounds"]
        calls = [r["call"] for r in rounds]
        out.append({
            "label": f"batch {t['batch']}  {t['mode']}  {t['verifier']}",
            "k": [r["k"] for r in rounds], "why": [r["why"] for r in rounds],
            "tokens": [sum(r["emitted"]) / len(r["emitted"]) if r.get("emitted") else None for r in rounds],
            "starts": [i for i in range(1, len(calls)) if calls[i] != calls[i - 1]],
            "plain": sum(r["k"] == 0 for r in rounds) / len(rounds)})
    if not out:
        raise ValueError("no traced rows to plot")
    return out


def plot_plans(traces: list[dict], path: str | Path, window: int = 8) -> Path:
    """Write the figure of a planner trace (``bench_rollout --planner-trace``'s list) to ``path``."""
    data = plan_data(traces)
    plt = _plt()
    fig, axes = plt.subplots(len(data), 1, figsize=(11, 0.6 + 2.2 * len(data)), squeeze=False)
    for ax, d in zip(axes[:, 0], data):
        for x in d["starts"]:
            ax.axvline(x, color="grey", lw=0.4, ls=":")
        for why, colour in REASON_COLOURS.items():
            pts = [(i, k) for i, (k, w) in enumerate(zip(d["k"], d["why"])) if w == why]
            if pts:
                ax.plot(*zip(*pts), ls="none", marker="o", ms=2.5, color=colour, label=why)
        ax.set_ylabel("draft length (0 = plain)", fontsize=7)
        ax.set_ylim(-0.5, max(d["k"]) + 1.5)  # (room for the legend above the longest draft)
        ax.set_title(f"{d['label']}: {len(d['k'])} rounds, {d['plain']:.1%} plain", fontsize=9)
        ax.legend(fontsize=7, loc="upper right", ncol=4, markerscale=2)
        pts = [(i, t) for i, t in enumerate(d["tokens"]) if t is not None]
        if pts:
            xs, ts = zip(*pts)
            spans = [ts[max(0, j - window + 1):j + 1] for j in range(len(ts))]
            mean = [sum(x) / len(x) for x in spans]
            right = ax.twinx()
            right.plot(xs, mean, color="tab:green", lw=0.8, alpha=0.7)
            right.set_ylabel(f"tokens a row emitted ({window}-round mean)", fontsize=7, color="tab:green")
    axes[-1, 0].set_xlabel("planner round (dotted: a call begins)")
    return _save(fig, Path(path))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a bench_rollout --json file, or its --planner-trace file")
    ap.add_argument("--out", default=None, help="the PNG (default: the JSON's name with .png)")
    args = ap.parse_args(argv)
    src = Path(args.json)
    try:
        report = json.loads(src.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"error: cannot read {src}: {err}") from None
    if isinstance(report, list):  # a --planner-trace file
        draw, what = plot_plans, report
    elif isinstance(report, dict) and "results" in report:
        draw, what = plot_rows, report["results"]
    else:
        raise SystemExit(f"error: {src} is neither a bench_rollout --json file (no 'results') nor a "
                         "--planner-trace file (a list)")
    try:
        out = draw(what, args.out or src.with_suffix(".png"))
    except ValueError as err:
        raise SystemExit(f"error: {src}: {err}") from None
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
