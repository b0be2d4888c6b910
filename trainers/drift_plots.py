"""PNG plots of a drift study, and the drift / importance-weight view of a training run.

Study plots (from the report of ``trainers.drift_report``):
- ``speed_vs_accuracy.png``: speedup over plain autoregressive sampling against accuracy
  (Wilson 95% bars); matched baselines are stars, each configuration is joined to its
  baseline by a dotted line.
- ``drift_by_position.png``: mean TV(P, p) and KL(P || p) at each completion position.
- ``accuracy_gap_by_difficulty.png``: accuracy minus the matched baseline's, per
  difficulty (Newcombe 95% bars).

Training-run view (``--from-run``): a run's ``rollouts.jsonl`` (one line per completion:
step, completion_ids, behaviour_logprobs = log P, target_logprobs = rollout-time log p,
policy_logprobs = the trainer's log pi_old, relaxed, weights = the applied IS weights,
reward, text) reduced per step to: rollout drift log p - log P (KL(P || p) estimated from
the samples: k1 = mean(log P - log p), k3 = mean(r - 1 - log r) with r = p / P), the same
for the policy (r = pi / P: the trainer's importance ratio), staleness mean |log pi - log p|,
relaxed fraction, the applied weights (min / mean / max, token ESS, masked fraction) and
the sequence-level ESS of prod_t pi / P.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from trainers.drift_report import finite_json, sequence_ess
from trainers.report import read_jsonl


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
    for i, (key, r) in enumerate(configs.items()):
        acc, x = r["accuracy"], r[speed]
        if acc["mean"] is None or x is None:
            continue
        err = [[max(0.0, acc["mean"] - acc["ci_low"])], [max(0.0, acc["ci_high"] - acc["mean"])]]
        base = configs.get(r["baseline"]) if r["baseline"] else None
        if r["kind"] == "baseline":
            ax.errorbar([x], [acc["mean"]], yerr=err, fmt="*", ms=14, color="black", capsize=3)
            ax.annotate(key, (x, acc["mean"]), fontsize=7, xytext=(4, -10), textcoords="offset points")
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
        for ax, metric in zip(axes, ("tv", "kl")):
            ys = [math.nan if v is None else v for v in r["per_position"][metric]]
            if ys:
                ax.plot(range(len(ys)), ys, LINESTYLE[r["mode"]], color=colour, lw=1, label=key)
    for ax, title in zip(axes, ("mean TV(P, p)", "mean KL(P || p)")):
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


# ----------------------------------------------------------------------------- training runs
ROLLOUT_FIELDS = ("step", "completion_ids", "behaviour_logprobs", "target_logprobs", "policy_logprobs", "relaxed",
                  "weights", "reward")


def read_rollouts(run_dir: str | Path) -> dict[int, list[dict]]:
    """``run_dir/rollouts.jsonl`` grouped by step; a bad record raises ValueError naming it."""
    path = Path(run_dir) / "rollouts.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no rollouts.jsonl in {run_dir}")
    steps: dict[int, list[dict]] = {}
    for n, rec in enumerate(read_jsonl(path), start=1):  # n: the record's number (a torn tail is dropped)
        missing = [f for f in ROLLOUT_FIELDS if f not in rec]
        if missing:
            raise ValueError(f"{path}:{n}: missing fields {missing}")
        if len({len(rec[f]) for f in ROLLOUT_FIELDS[1:-1]}) != 1:
            raise ValueError(f"{path}:{n}: per-token lists differ in length")
        steps.setdefault(int(rec["step"]), []).append(rec)
    return dict(sorted(steps.items()))


def _kl(log_r: torch.Tensor) -> tuple[float, float]:
    """(k1, k3) estimates of KL(P || .) from log r = log(. / P) at samples of P."""
    if log_r.numel() == 0:
        return 0.0, 0.0
    return float(-log_r.mean()), float((torch.expm1(log_r.clamp(max=700)) - log_r).mean())


def step_stats(records: list[dict]) -> dict[str, float]:
    """Drift and IS-weight statistics of one step's completions (see the module docstring)."""
    cat = {f: torch.tensor([v for r in records for v in r[f]], dtype=torch.float64) for f in ROLLOUT_FIELDS[2:-1]}
    to_p = cat["target_logprobs"] - cat["behaviour_logprobs"]  # log p - log P
    to_pi = cat["policy_logprobs"] - cat["behaviour_logprobs"]  # log pi - log P
    w = cat["weights"]
    seq = torch.tensor([sum(r["policy_logprobs"]) - sum(r["behaviour_logprobs"]) for r in records], dtype=torch.float64)
    k1, k3 = _kl(to_p)
    pk1, pk3 = _kl(to_pi)
    n = w.numel()
    return {
        "completions": len(records), "tokens": n, "reward_mean": sum(r["reward"] for r in records) / len(records),
        "relaxed_frac": float(cat["relaxed"].mean()) if n else 0.0,
        "kl_P_p_k1": k1, "kl_P_p_k3": k3, "kl_P_pi_k1": pk1, "kl_P_pi_k3": pk3,
        "log_ratio_abs_mean": float(to_pi.abs().mean()) if n else 0.0,
        "stale_abs_mean": float((cat["policy_logprobs"] - cat["target_logprobs"]).abs().mean()) if n else 0.0,
        "weight_min": float(w.min()) if n else 0.0, "weight_mean": float(w.mean()) if n else 0.0,
        "weight_max": float(w.max()) if n else 0.0,
        "weight_ess": min(1.0, float(w.sum() ** 2 / (n * (w * w).sum()))) if n and (w * w).sum() > 0 else 0.0,
        "masked_frac": float((w == 0).double().mean()) if n else 0.0,
        "seq_log_ratio_mean": float(seq.mean()), "seq_ess": sequence_ess(seq),
    }


def plot_run_drift(rows: list[dict], out_dir: Path) -> list[Path]:
    plt = _plt()
    steps = [r["step"] for r in rows]
    panels = (("drift_over_steps.png", "drift over training steps",
               (("kl_P_p_k3", "KL(P||p) k3 (rollout target)"), ("kl_P_pi_k3", "KL(P||pi) k3 (trainer policy)"),
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


def from_run(run_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Per-step drift and IS statistics of a training run: JSON, Markdown table and two plots."""
    rows = [{"step": s, **step_stats(recs)} for s, recs in read_rollouts(run_dir).items()]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_drift.json").write_text(json.dumps(finite_json({"run": str(run_dir), "steps": rows}), indent=1))
    keys = ("reward_mean", "relaxed_frac", "kl_P_p_k3", "kl_P_pi_k3", "weight_mean", "weight_ess", "seq_ess",
            "masked_frac")
    lines = ["| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {r['step']} | " + " | ".join(f"{r[k]:.4g}" for k in keys) + " |" for r in rows]
    (out / "run_drift.md").write_text("# Drift over training steps\n\n" + "\n".join(lines) + "\n")
    return [out / "run_drift.json", out / "run_drift.md", *plot_run_drift(rows, out)]
