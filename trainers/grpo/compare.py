"""Training runs side by side: what their configs differ in, their metrics over windows of
steps, and one figure (``scripts/compare_runs.py`` is the command).

The question it answers is the one a lossy or rounded rollout setting raises: does the run
still learn like the exact one, and at what drift? Each run is a folder written by the GRPO
trainer (``metrics.jsonl`` and the ``config.json`` snapshot).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from trainers.grpo.report import read_metrics
from trainers.grpo.run_dir import flatten, read_snapshot

# (metric key in metrics.jsonl, label, log-scale axis)
DEFAULT_METRICS = (
    ("reward_mean", "mean reward", False),
    ("accuracy", "accuracy", False),
    ("is_ess", "IS effective sample size", False),
    ("kl_k3", "KL(behaviour || policy), k3", False),
    ("rollout_vs_trainer_logp_max", "max |rollout - trainer log-prob|", True),
    ("tau", "acceptance length tau", False),
    ("rollout_tokens_per_s", "rollout tok/s", False),
    ("step_s", "step seconds", False),
)
IGNORED_CONFIG_FIELDS = ("run.out_dir",)  # every run has its own


@dataclass(frozen=True)
class Run:
    label: str
    path: Path
    rows: list[dict]          # one per step, sorted by step
    config: dict | None       # the run folder's snapshot (None when it has none)


def load_run(path: str | Path, label: str | None = None) -> Run:
    """A run folder's metrics (a step logged twice keeps its last record) and snapshot."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"{path}: not a folder")
    by_step = {r["step"]: r for r in read_metrics(path)}
    if not by_step:
        raise ValueError(f"{path}: no metrics.jsonl records (is it a training run's out_dir?)")
    return Run(label or path.name, path, [by_step[s] for s in sorted(by_step)], read_snapshot(path))


def labels_for(paths: list[str | Path], labels: list[str] | None) -> list[str]:
    """The given labels, or each folder's name (its full path where two names clash)."""
    if labels is not None:
        if len(labels) != len(paths):
            raise ValueError(f"--labels: {len(labels)} labels for {len(paths)} runs")
        if len(set(labels)) != len(labels):
            raise ValueError(f"--labels: repeated label in {labels}")
        return list(labels)
    names = [Path(p).name for p in paths]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, paths)]


def check_metrics(runs: list[Run], metrics: list[str]) -> None:
    """Raise ValueError naming a metric that no run logged, with the ones they did."""
    logged = {k for run in runs for r in run.rows for k in r}
    missing = [m for m in metrics if m not in logged]
    if missing:
        raise ValueError(f"metric(s) {', '.join(missing)} not in any run's metrics.jsonl; "
                         f"logged: {', '.join(sorted(logged - {'step'}))}")


def window_means(rows: list[dict], key: str, window: int, last_step: int) -> list[float | None]:
    """The mean of ``key`` over steps 1..window, window+1..2*window, ... up to ``last_step``;
    None for a window where the run logged no finite value."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    sums = [0.0] * math.ceil(last_step / window)
    counts = [0] * len(sums)
    for r in rows:
        v = r.get(key)
        if isinstance(v, (int, float)) and math.isfinite(v) and 1 <= r["step"] <= last_step:
            i = (r["step"] - 1) // window
            sums[i] += v
            counts[i] += 1
    return [s / n if n else None for s, n in zip(sums, counts)]


def config_differences(runs: list[Run]) -> list[str]:
    """``field: label=value, ...`` for every config field whose value is not the same in all
    runs (``run.out_dir`` and empty sections left out); a run without a snapshot is named once."""
    out = [f"{run.label}: no config.json snapshot" for run in runs if run.config is None]
    flats = [(run.label, {k: v for k, v in flatten(run.config).items() if v != {}})
             for run in runs if run.config is not None]
    keys = sorted({k for _, f in flats for k in f} - set(IGNORED_CONFIG_FIELDS))
    for k in keys:
        values = [f.get(k, "<absent>") for _, f in flats]
        if any(v != values[0] for v in values):
            out.append(f"{k}: " + ", ".join(f"{label}={v!r}" for (label, _), v in zip(flats, values)))
    return out


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v != 0 and abs(v) < 1e-2:
        return f"{v:.3g}"  # a log-prob gap of 3e-05 keeps its digits
    return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"


def comparison_markdown(runs: list[Run], metrics: list[str], window: int) -> str:
    """The comparison as Markdown: the runs, their config differences, one table per metric
    (rows: windows of steps and all steps; columns: runs)."""
    check_metrics(runs, metrics)
    labels = {k: label for k, label, _ in DEFAULT_METRICS}
    last = max(run.rows[-1]["step"] for run in runs)
    lines = ["# Runs compared", ""]
    lines += [f"- **{run.label}**: `{run.path}`, {len(run.rows)} steps (last {run.rows[-1]['step']})" for run in runs]
    diffs = config_differences(runs)
    lines += ["", "Config differences:" if diffs else "Config differences: none (same snapshot)"]
    lines += [f"- {d}" for d in diffs]
    for key in metrics:
        cols = [window_means(run.rows, key, window, last) for run in runs]
        alls = [window_means(run.rows, key, last, last)[0] for run in runs]
        lines += ["", f"## {labels.get(key, key)} (`{key}`), mean per {window} steps", "",
                  "| steps | " + " | ".join(run.label for run in runs) + " |",
                  "|---" * (len(runs) + 1) + "|"]
        for i in range(len(cols[0])):
            span = f"{i * window + 1}-{min((i + 1) * window, last)}"
            lines.append(f"| {span} | " + " | ".join(_fmt(c[i]) for c in cols) + " |")
        lines.append("| all | " + " | ".join(_fmt(a) for a in alls) + " |")
    return "\n".join(lines) + "\n"


def plot_comparison(runs: list[Run], metrics: list[str], path: str | Path) -> Path:
    """One PNG: a panel per metric, a line per run (log scale where the metric spans decades)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    check_metrics(runs, metrics)
    spec = {k: (label, log) for k, label, log in DEFAULT_METRICS}
    ncols = 2 if len(metrics) > 1 else 1
    nrows = math.ceil(len(metrics) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6 * ncols, 3.2 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, metrics):
        label, log = spec.get(key, (key, False))
        for run in runs:
            pts = [(r["step"], r[key]) for r in run.rows
                   if isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) and (not log or r[key] > 0)]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=run.label)
        if log:
            ax.set_yscale("log")
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
