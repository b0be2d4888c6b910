"""PNG plots of a drift study and of a training run's drift over steps.

Study plots (from the report of ``trainers.drift.report``):
- ``speed_vs_accuracy.png``: speedup over plain autoregressive sampling against accuracy
  (Wilson 95% bars); matched baselines are stars, each configuration is joined to its
  baseline by a dotted line.
- ``drift_by_position.png``: mean TV(P, p) and KL(P || p) at each completion position (KL:
  the mean of its finite values; a configuration with infinite KL has its share in the legend).
- ``accuracy_gap_by_difficulty.png``: accuracy minus the matched baseline's, per
  difficulty (Newcombe 95% bars).
Training-run plots (rows of ``trainers.drift.report.step_stats``): ``drift_over_steps.png``
(KL as k1 and k3, relaxed fraction, staleness) and ``is_weights_over_steps.png`` (weights and ESS).
"""

from __future__ import annotations

import math
from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(n: int) -> list:
    """n distinct colours (tab20 beyond 10 series)."""
    cmap = _plt().get_cmap("tab10" if n <= 10 else "tab20")
    return [cmap(i % cmap.N) for i in range(n)]


LINESTYLE = {"off": "--", "chain": "-", "tree": "-."}


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


# ----------------------------------------------------------------------------- the study
def plot_speed_accuracy(configs: dict[str, dict], path: Path, basis: str = "wall") -> Path:
    plt = _plt()
    speed = "cpu_speedup_vs_autoregressive" if basis == "cpu" else "speedup_vs_autoregressive"
    fig, ax = plt.subplots(figsize=(10, 5))
    colours = _colours(len(configs))
    stars = 0  # baselines labelled so far: each label one line higher, so stars close together stay legible
    for i, (key, r) in enumerate(configs.items()):
        acc, x = r["accuracy"], r[speed]
        if acc["mean"] is None or x is None:
            continue
        err = [[max(0.0, acc["mean"] - acc["ci_low"])], [max(0.0, acc["ci_high"] - acc["mean"])]]
        base = configs.get(r["baseline"]) if r["baseline"] else None
        if r["kind"] == "baseline":
            ax.errorbar([x], [acc["mean"]], yerr=err, fmt="*", ms=14, color="black", capsize=3)
            ax.annotate(key, (x, acc["mean"]), fontsize=7, xytext=(4, 4 + 9 * stars), textcoords="offset points")
            stars += 1
            continue
        marker = "o" if r["mode"] == "chain" else "^"
        c = colours[i]
        ax.errorbar([x], [acc["mean"]], yerr=err, fmt=marker, color=c, capsize=3, label=key)
        if base and base["accuracy"]["mean"] is not None and base[speed] is not None:
            ax.plot([base[speed], x], [base["accuracy"]["mean"], acc["mean"]], ":", color=c, lw=1)
    ax.set_xlabel(f"speedup over plain autoregressive sampling ({'tokens per CPU-second' if basis == 'cpu' else 'tokens/s'})")
    ax.set_ylabel("accuracy (95% Wilson interval)")
    ax.set_title("speed against accuracy; stars: matched baselines (no speculation)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def plot_drift_positions(configs: dict[str, dict], path: Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for (key, r), colour in zip(configs.items(), _colours(len(configs))):
        inf = r["kl"].get("inf_frac") or 0.0  # the legend is the KL panel's: the share it leaves out
        label = f"{key} (KL inf {inf:.2%})" if inf > 0 else key
        for ax, metric in zip(axes, ("tv", "kl")):
            ys = [math.nan if v is None else v for v in r["per_position"][metric]]
            if ys:
                ax.plot(range(len(ys)), ys, LINESTYLE[r["mode"]], color=colour, lw=1, label=label)
    for ax, title in zip(axes, ("mean TV(P, p)", "mean KL(P || p) over its finite values")):
        ax.set_xlabel("position in the completion")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return _save(fig, path)


def plot_difficulty_gap(configs: dict[str, dict], path: Path) -> Path:
    plt = _plt()
    rows = [(k, r) for k, r in configs.items() if r["kind"] == "verifier" and r.get("vs_baseline")]
    diffs = sorted({d for _, r in rows for d in r["vs_baseline"]["per_difficulty"]})
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rows) + 2), 4.5))
    width = 0.8 / max(1, len(diffs))
    for j, d in enumerate(diffs):
        xs, ys, lo, hi = [], [], [], []
        for i, (_, r) in enumerate(rows):
            g = r["vs_baseline"]["per_difficulty"].get(d)
            if g and g["diff"] is not None:
                xs.append(i + (j - (len(diffs) - 1) / 2) * width)
                ys.append(g["diff"])
                lo.append(max(0.0, g["diff"] - g["diff_ci_low"]))
                hi.append(max(0.0, g["diff_ci_high"] - g["diff"]))
        ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=f"difficulty {d}")
    ax.axhline(0, color="black", lw=0.8)
    ax.set_xticks(range(len(rows)), [k for k, _ in rows], rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("accuracy - matched baseline")
    ax.set_title("accuracy gap to the matched baseline per difficulty (95% Newcombe)")
    ax.grid(alpha=0.3, axis="y")
    if diffs:
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_report(report: dict, out_dir: Path) -> list[Path]:
    configs = report["configurations"]
    basis = report.get("config", {}).get("speed_basis", "wall")
    return [plot_speed_accuracy(configs, out_dir / "speed_vs_accuracy.png", basis),
            plot_drift_positions(configs, out_dir / "drift_by_position.png"),
            plot_difficulty_gap(configs, out_dir / "accuracy_gap_by_difficulty.png")]


def plot_run_drift(rows: list[dict], out_dir: Path) -> list[Path]:
    plt = _plt()
    steps = [r["step"] for r in rows]
    panels = (("drift_over_steps.png", "drift over training steps",
               (("kl_P_p_k1", "KL(P||p) k1 (rollout target)"), ("kl_P_p_k3", "KL(P||p) k3 (rollout target)"),
                ("kl_P_pi_k1", "KL(P||pi) k1 (trainer policy)"), ("kl_P_pi_k3", "KL(P||pi) k3 (trainer policy)"),
                ("relaxed_frac", "relaxed fraction"), ("stale_abs_mean", "mean |log pi - log p|"))),
              ("is_weights_over_steps.png", "importance weights over training steps",
               (("weight_min", "min w"), ("weight_mean", "mean w"), ("weight_max", "max w"),
                ("weight_ess", "token ESS"), ("seq_ess", "sequence ESS"), ("masked_frac", "masked"))))
    out = []
    for name, title, series in panels:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key, label in series:
            ax.plot(steps, [r[key] for r in rows], marker="o", ms=3, label=label)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        out.append(_save(fig, out_dir / name))
    return out
