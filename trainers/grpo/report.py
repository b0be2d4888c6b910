"""What a training run leaves behind: the metrics log, TensorBoard events, a summary, plots.

- ``metrics.jsonl``: one JSON object per step (all scalar metrics, flat keys).
- ``rollouts.jsonl``: per step, per completion: reward, token ids, behaviour / rollout-time
  target / trainer log-probs and relaxed flags, for drift diagnostics after the fact
  (``scripts/drift.py --from-run``).
- ``tb/``: TensorBoard events of the same scalars.
- ``summary.md`` and ``plots/*.png`` at the end: reward, tau and drift over steps. KL(P || pi)
  shows as k1 and k3 side by side: k3 is low by pi's mass outside the behaviour's support
  (a lossy rule emitting a tree node or greedy draft outright; ``trainers.drift.stats``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

SUMMARY_KEYS = (
    ("reward_mean", "reward"), ("accuracy", "accuracy"), ("tau", "tau"),
    ("rollout_tokens_per_s", "tok/s"), ("relaxed_frac", "relaxed"), ("kl_k1", "KL(P||pi) k1"),
    ("kl_k3", "KL(P||pi) k3"),
    ("log_ratio_mean", "mean log w"), ("is_ess", "ESS"), ("is_masked_frac", "masked"),
    ("drafter_est_tau", "head tau"), ("drafter_est_tau_initial", "initial head tau"), ("step_s", "step s"),
)
log = logging.getLogger(__name__)


class MetricsLogger:
    def __init__(self, out_dir: Path, resume_step: int = 0):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        self.rollouts_path = self.out_dir / "rollouts.jsonl"
        for p in (self.path, self.rollouts_path):  # drop steps after the resume point
            _truncate_after(p, resume_step)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out_dir / "tb"), purge_step=resume_step + 1)
        except ImportError:  # tensorboard is optional at run time
            self.tb = None

    def log(self, step: int, metrics: dict[str, float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.tb is not None:
            for k, v in metrics.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)
            self.tb.flush()

    def log_rollouts(self, step: int, records: list[dict]) -> None:
        with self.rollouts_path.open("a") as f:
            for r in records:
                f.write(json.dumps({"step": step, **r}) + "\n")

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSONL log. A torn last line (a kill during its write) is dropped with a
    warning; a bad line before the last is damage this code did not make and raises, naming it."""
    lines = Path(path).read_text().splitlines()
    out = []
    for i, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError("not a record with an integer 'step'")
        except ValueError as err:
            if i == len(lines):
                log.warning("%s: dropping a torn last line %d (%s)", path, i, err)
                break
            raise ValueError(f"{path}:{i}: corrupt log line ({err})") from None
        out.append(rec)
    return out


def _truncate_after(path: Path, step: int) -> None:
    """Keep the records up to ``step`` (a resume point), rewritten atomically; drops a torn tail."""
    if not path.is_file():
        return
    keep = [rec for rec in read_jsonl(path) if rec["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(json.dumps(rec) + "\n" for rec in keep))
    os.replace(tmp, path)


def read_metrics(out_dir: Path) -> list[dict]:
    path = Path(out_dir) / "metrics.jsonl"
    return read_jsonl(path) if path.is_file() else []


def summary_table(rows: list[dict]) -> str:
    """A Markdown table of the key metrics per step, plus first-vs-last reward."""
    keys = [(k, label) for k, label in SUMMARY_KEYS if any(k in r for r in rows)]
    lines = ["| step | " + " | ".join(label for _, label in keys) + " |",
             "|---" * (len(keys) + 1) + "|"]
    for r in rows:
        cells = [_fmt(r.get(k)) for k, _ in keys]
        lines.append(f"| {r['step']} | " + " | ".join(cells) + " |")
    if len(rows) >= 2 and "reward_mean" in rows[0]:
        half = max(1, len(rows) // 2)
        first = sum(r["reward_mean"] for r in rows[:half]) / half
        last = sum(r["reward_mean"] for r in rows[-half:]) / half
        lines.append(f"\nmean reward, first {half} steps: {first:.3f}; last {half} steps: {last:.3f}")
    return "\n".join(lines)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def write_report(out_dir: Path) -> tuple[list[dict], str, list[Path]]:
    """``summary.md`` and ``plots/`` of the run in ``out_dir`` from its ``metrics.jsonl``: the
    rows, the table and the figures written."""
    out_dir = Path(out_dir)
    rows = read_metrics(out_dir)
    table = summary_table(rows)
    (out_dir / "summary.md").write_text(table + "\n")
    return rows, table, plot_run(rows, out_dir)


def plot_run(rows: list[dict], out_dir: Path) -> list[Path]:
    """PNG plots of reward, tau and drift over steps; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plots = Path(out_dir) / "plots"
    plots.mkdir(parents=True, exist_ok=True)
    steps = [r["step"] for r in rows]
    panels = [
        ("reward.png", "reward", [("reward_mean", "mean reward"), ("accuracy", "accuracy")]),
        ("tau.png", "acceptance length tau", [("tau", "tau (rollouts)"),
                                               ("drafter_est_tau", "head, teacher-forced on fresh rollouts (T = 1)"),
                                               ("drafter_est_tau_initial", "the head as loaded, same rollouts")]),
        ("drift.png", "drift (behaviour vs policy)", [("kl_k3", "KL(P||pi), k3"), ("kl_k1", "KL(P||pi), k1"),
                                                       ("log_ratio_abs_mean", "mean |log w|"),
                                                       ("relaxed_frac", "relaxed fraction")]),
        ("is_weights.png", "importance weights", [("is_weight_min", "min"), ("is_weight_mean", "mean"),
                                                  ("is_weight_max", "max"), ("is_ess", "ESS")]),
    ]
    written = []
    for name, title, series in panels:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for key, label in series:
            if key != series[0][0] and not any(key in r for r in rows):
                continue  # an optional series (the online drafter's)
            ys = [r.get(key, float("nan")) for r in rows]
            ax.plot(steps, ys, marker="o", label=label)
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(plots / name, dpi=100)
        plt.close(fig)
        written.append(plots / name)
    return written
