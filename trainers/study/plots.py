"""The study's figures, drawn from the report's summary (``trainers.study.report.summarise``):
nothing is computed here but the layout.

- ``accuracy_over_steps.png``: held-out accuracy over steps, a row per evaluation temperature and a
  panel per verifier (the settings sharing it), the reference dashed in every panel; lines are the
  mean over seeds, bands their min to max.
- ``final_differences.png``: the final paired differences with their 95% intervals, a row per
  temperature: against the reference, and against the uncorrected rollouts / matched baseline.
- ``training_over_steps.png``: tau, KL(P || pi) k1 and k3, IS ESS and rollout tokens/s over steps.
- ``rollout_speed.png``: rollout tokens/s and total rollout time per setting (mean, min to max).
"""

from __future__ import annotations

from pathlib import Path

TRAINING_PANELS = (("tau", "acceptance length tau"), ("kl_k1", "KL(P || pi), k1"), ("kl_k3", "KL(P || pi), k3"),
                   ("is_ess", "IS effective sample size"), ("rollout_tokens_per_s", "rollout tokens/s"))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _colours(names: list[str]) -> dict[str, tuple]:
    cmap = _plt().get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def _families(summary: dict) -> dict[str, list[str]]:
    """The settings by verifier rule name, the reference left out (it is drawn in every panel)."""
    ref = summary["study"]["reference"]
    out: dict[str, list[str]] = {}
    for name, s in summary["settings"].items():
        if name != ref:
            out.setdefault(s["verifier"], []).append(name)
    return out or {ref: []}


def _curve(ax, points: list, colour, label: str, dashed: bool = False) -> None:
    if not points:
        return
    steps = [p[0] for p in points]
    ax.plot(steps, [p[1] for p in points], marker=".", color=colour, linestyle="--" if dashed else "-", label=label)
    if any(p[2] != p[3] for p in points):
        ax.fill_between(steps, [p[2] for p in points], [p[3] for p in points], color=colour, alpha=0.15, linewidth=0)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def plot_accuracy(summary: dict, path: Path) -> Path:
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    settings, ref = summary["settings"], summary["study"]["reference"]
    temps = list(next(iter(settings.values()))["final"])
    families = _families(summary)
    colours = _colours(list(settings))
    fig, axes = plt.subplots(len(temps), len(families), figsize=(5 * len(families), 3.4 * len(temps)), squeeze=False)
    for row, t in enumerate(temps):
        for col, (family, names) in enumerate(families.items()):
            ax = axes[row][col]
            _curve(ax, settings[ref]["curves"][t], "black", ref, dashed=True)
            for n in names:
                _curve(ax, settings[n]["curves"][t], colours[n], n)
            ax.set_title(f"{family}: held-out accuracy, T = {t}")
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    return _save(fig, path)


def plot_differences(summary: dict, path: Path) -> Path:
    plt = _plt()
    settings, ref = summary["settings"], summary["study"]["reference"]
    temps = list(next(iter(settings.values()))["final"])
    height = 0.5 + 0.45 * max(2, len(settings)) * len(temps)
    fig, axes = plt.subplots(len(temps), 2, figsize=(11, height), squeeze=False)
    for row, t in enumerate(temps):
        for col, kinds in enumerate((("reference",), ("uncorrected", "baseline"))):
            ax = axes[row][col]
            rows = [(f"{name} - {c['other']}", c["difference"]) for name, s in settings.items()
                    for c in s["final"][t]["comparisons"] if c["kind"] in kinds and c["difference"] is not None]
            for y, (label, d) in enumerate(rows):
                ax.errorbar(d["mean"], y, xerr=[[d["mean"] - d["ci_low"]], [d["ci_high"] - d["mean"]]], fmt="o",
                            color="tab:blue", capsize=3)
            ax.axvline(0, color="grey", linewidth=1)
            if not rows:
                ax.text(0.5, 0.5, "none in this grid (or no finished pair)", ha="center", va="center",
                        transform=ax.transAxes, fontsize=8)
            ax.set_yticks(range(len(rows)), [label for label, _ in rows], fontsize=8)
            ax.set_ylim(-0.7, max(len(rows), 1) - 0.3)
            what = f"vs {ref}" if col == 0 else "vs uncorrected / matched baseline"
            ax.set_title(f"final accuracy difference, T = {t}, {what}", fontsize=9)
            ax.set_xlabel("difference (95% CI)")
            ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)


def plot_training(summary: dict, path: Path) -> Path:
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    settings = summary["settings"]
    colours = _colours(list(settings))
    fig, axes = plt.subplots(2, 3, figsize=(16, 7), squeeze=False)
    for ax, (key, title) in zip(axes.flat, TRAINING_PANELS):
        for name, s in settings.items():
            _curve(ax, s["training_curves"][key], colours[name], name)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    axes.flat[-1].axis("off")
    if handles:
        axes.flat[-1].legend(handles, labels, loc="center", fontsize=8)
    return _save(fig, path)


def plot_speed(summary: dict, path: Path) -> Path:
    plt = _plt()
    settings = summary["settings"]
    names = [n for n, s in settings.items() if s["training"]["tokens_per_s"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.8 + 0.4 * max(2, len(names))), squeeze=False)
    panels = (("tokens_per_s", "rollout tokens/s"), ("rollout_s", "total rollout time (s)"))
    for ax, (key, title) in zip(axes[0], panels):
        vals = [settings[n]["training"][key] for n in names]
        ax.barh(range(len(names)), [v["mean"] for v in vals],
                xerr=[[v["mean"] - v["min"] for v in vals], [v["max"] - v["mean"] for v in vals]], capsize=3,
                color="tab:blue", alpha=0.7)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.set_title(title)
        ax.grid(alpha=0.3, axis="x")
    return _save(fig, path)


def plot_study(summary: dict, out: Path) -> list[Path]:
    """Every figure of the study into ``out``; returns the files."""
    out = Path(out)
    if not summary["settings"]:
        return []
    return [plot_accuracy(summary, out / "accuracy_over_steps.png"),
            plot_differences(summary, out / "final_differences.png"),
            plot_training(summary, out / "training_over_steps.png"),
            plot_speed(summary, out / "rollout_speed.png")]
