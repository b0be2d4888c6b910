"""Training runs side by side: what their configs differ in, their metrics over windows of
steps, and one figure (``scripts/compare_runs.py`` is the command).

The question it answers is the one a lossy or rounded rollout setting raises: does the run
still learn like the exact one, and at what drift? Each run is a folder written by the GRPO
trainer (``metrics.jsonl`` and the ``config.json`` snapshot). Runs given the same label are
one setting run several times (seeds): a table cell is then the mean of their window means
with the range ``[min-max]``, and the figure draws their mean with a band.
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
    ("kl_k1", "KL(behaviour || policy), k1 (unbiased)", False),
    ("kl_k3", "KL(behaviour || policy), k3 (low where the behaviour misses policy mass)", False),
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
    """The given labels (a repeated one groups runs), or each folder's name (its full path
    where two names clash, so that no runs are grouped unasked)."""
    if labels is not None:
        if len(labels) != len(paths):
            raise ValueError(f"--labels: {len(labels)} labels for {len(paths)} runs")
        return list(labels)
    names = [Path(p).name for p in paths]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, paths)]


def groups(runs: list[Run]) -> list[tuple[str, list[Run]]]:
    """The runs by label, in the order the labels first appear."""
    out: dict[str, list[Run]] = {}
    for run in runs:
        out.setdefault(run.label, []).append(run)
    return list(out.items())


def _name(run: Run, runs: list[Run]) -> str:
    """The run's label, with its folder's name where the label is shared."""
    return run.label if sum(r.label == run.label for r in runs) == 1 else f"{run.label} ({run.path.name})"


def check_metrics(runs: list[Run], metrics: list[str]) -> None:
    """Raise ValueError naming a metric that no run logged, with the ones they did."""
    logged = {k for run in runs for r in run.rows for k in r}
    missing = [m for m in metrics if m not in logged]
    if missing:
        raise ValueError(f"metric(s) {', '.join(missing)} not in any run's metrics.jsonl; "
                         f"logged: {', '.join(sorted(logged - {'step'}))}")


def _finite(row: dict, key: str) -> float | None:
    """The row's value of ``key`` when it is a finite number, else None."""
    v = row.get(key)
    return v if isinstance(v, (int, float)) and math.isfinite(v) else None


def window_means(rows: list[dict], key: str, window: int, last_step: int) -> list[float | None]:
    """The mean of ``key`` over steps 1..window, window+1..2*window, ... up to ``last_step``;
    None for a window where the run logged no finite value."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    sums = [0.0] * math.ceil(last_step / window)
    counts = [0] * len(sums)
    for r in rows:
        v = _finite(r, key)
        if v is not None and 1 <= r["step"] <= last_step:
            i = (r["step"] - 1) // window
            sums[i] += v
            counts[i] += 1
    return [s / n if n else None for s, n in zip(sums, counts)]


def config_differences(runs: list[Run]) -> list[str]:
    """``field: label=value, ...`` for every config field whose value is not the same in all
    runs (``run.out_dir`` and empty sections left out); a run without a snapshot is named once."""
    out = [f"{_name(run, runs)}: no config.json snapshot" for run in runs if run.config is None]
    flats = [(_name(run, runs), {k: v for k, v in flatten(run.config).items() if v != {}})
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


def _cell(values: list[float | None]) -> str:
    """One run's value, or a group's mean and [min-max] over the runs that have one."""
    vals = [v for v in values if v is not None]
    if len(vals) <= 1:
        return _fmt(vals[0] if vals else None)
    return f"{_fmt(sum(vals) / len(vals))} [{_fmt(min(vals))}-{_fmt(max(vals))}]"


def comparison_markdown(runs: list[Run], metrics: list[str], window: int) -> str:
    """The comparison as Markdown: the runs, their config differences, one table per metric
    (rows: windows of steps and all steps; columns: runs, or groups of runs sharing a label)."""
    check_metrics(runs, metrics)
    titles = {k: title for k, title, _ in DEFAULT_METRICS}
    last = max(run.rows[-1]["step"] for run in runs)
    grouped = groups(runs)
    lines = ["# Runs compared", ""]
    lines += [f"- **{_name(run, runs)}**: `{run.path}`, {len(run.rows)} steps (last {run.rows[-1]['step']})"
              for run in runs]
    diffs = config_differences(runs)
    lines += ["", "Config differences:" if diffs else "Config differences: none (same snapshot)"]
    lines += [f"- {d}" for d in diffs]
    heads = [label if len(members) == 1 else f"{label} ({len(members)} runs: mean [min-max])"
             for label, members in grouped]
    for key in metrics:
        cols = [[window_means(run.rows, key, window, last) for run in members] for _, members in grouped]
        alls = [[window_means(run.rows, key, last, last)[0] for run in members] for _, members in grouped]
        lines += ["", f"## {titles.get(key, key)} (`{key}`), mean per {window} steps", "",
                  "| steps | " + " | ".join(heads) + " |", "|---" * (len(heads) + 1) + "|"]
        for i in range(math.ceil(last / window)):
            span = f"{i * window + 1}-{min((i + 1) * window, last)}"
            lines.append(f"| {span} | " + " | ".join(_cell([m[i] for m in c]) for c in cols) + " |")
        lines.append("| all | " + " | ".join(_cell(a) for a in alls) + " |")
    return "\n".join(lines) + "\n"


def plot_comparison(runs: list[Run], metrics: list[str], path: str | Path) -> Path:
    """One PNG: a panel per metric, a line per run or group (its mean, a band from its min to its
    max), log scale where the metric spans decades."""
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
        for name, members in groups(runs):
            per_step: dict[int, list[float]] = {}
            for run in members:
                for r in run.rows:
                    v = _finite(r, key)
                    if v is not None and (not log or v > 0):
                        per_step.setdefault(r["step"], []).append(v)
            steps = sorted(s for s, vs in per_step.items() if len(vs) == len(members))  # every run logged it
            if not steps:
                continue
            mean = [sum(per_step[s]) / len(members) for s in steps]
            line, = ax.plot(steps, mean, marker=".",
                            label=name if len(members) == 1 else f"{name} (mean of {len(members)})")
            if len(members) > 1:
                ax.fill_between(steps, [min(per_step[s]) for s in steps], [max(per_step[s]) for s in steps],
                                color=line.get_color(), alpha=0.2, linewidth=0)
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
