"""A PNG of ``scripts/bench_rollout.py``'s rows: each configuration's speedup over our
autoregressive mode next to the bound its measured tau and step costs allow.

    python -m scripts.bench_rollout ... --plot speed.png        # at the end of a run
    python -m scripts.bench_plot OUT.json [--out speed.png]     # from a run's --json file

One panel per batch size; per row a bar for the whole call's speedup, a dot for the decoding
alone (``dec AR``) and a black tick for the bound (rows without one, e.g. ``max_batch: auto``,
have none). The gap between bar and tick is the engine's distance from its own cost model;
the line at 1.0 is our autoregressive mode.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from trainers.drift.plots import _plt, _save


def plot_data(rows: list[dict]) -> dict[int, list[dict]]:
    """Per batch size (ascending), the rows to draw in run order: ``label``, ``speedup`` (whole
    call), ``decode`` (decoding alone) and ``bound`` (None where a row has none). Rows without a
    speedup over the autoregressive mode (HF generate) are left out; ValueError when none is left."""
    out: dict[int, list[dict]] = {}
    for r in rows:
        if r.get("speedup_vs_ar") is None or r["mode"] == "hf generate":
            continue
        out.setdefault(r["batch"], []).append({
            "label": f"{r['mode']}  {r['verifier']}", "speedup": r["speedup_vs_ar"], "tau": r["tau"],
            "decode": r.get("decode_vs_ar"), "bound": r.get("bound"), "plain": r["mode"].startswith("off")})
    if not out:
        raise ValueError("no rows with a speedup over the autoregressive mode to plot")
    return dict(sorted(out.items()))


def plot_rows(rows: list[dict], path: str | Path) -> Path:
    """Write the figure of ``rows`` (``bench_rollout.measure``'s dicts, or a ``--json`` file's
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
                                 ("bound", dict(marker="|", color="black", ms=16, mew=2.5), "bound")):
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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("json", help="a bench_rollout --json file")
    ap.add_argument("--out", default=None, help="the PNG (default: the JSON's name with .png)")
    args = ap.parse_args(argv)
    src = Path(args.json)
    try:
        report = json.loads(src.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise SystemExit(f"error: cannot read {src}: {err}") from None
    if not isinstance(report, dict) or "results" not in report:
        raise SystemExit(f"error: {src} is not a bench_rollout --json file (no 'results')")
    try:
        out = plot_rows(report["results"], args.out or src.with_suffix(".png"))
    except ValueError as err:
        raise SystemExit(f"error: {src}: {err}") from None
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
