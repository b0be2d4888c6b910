"""The report of a drift study (``trainers.drift.study``): JSON, Markdown tables and plots,
and the same view of a training run's logged rollouts over steps.

Vocabulary: see ``trainers.drift.study``; the statistics (KL, ESS, accuracy intervals and
gaps) are ``trainers.drift.stats``. Added here:
- **speedup**: tokens/s over lossless verification in the same speculative mode, and over
  plain autoregressive sampling (the ``plain`` baseline, same engine, mode off); the
  ``cpu_`` variants use tokens per CPU-second of the generate calls instead of wall time.
- **length**: mean completion tokens, and its ratio to the matched baseline's
  (``length_vs_baseline``): a rule that makes completions shorter (MARS on tree candidates
  emits the target's top-2 outright wherever it relaxes, near-greedy) drifts visibly there.
- **training-run view** (``--from-run``): a run's ``rollouts.jsonl`` (one line per
  completion: step, completion_ids, behaviour_logprobs = log P, target_logprobs =
  rollout-time log p, policy_logprobs = the trainer's log pi_old, relaxed, weights = the
  applied IS weights, reward, text) reduced per step to: rollout drift log p - log P
  (KL(P || p) as k1 and k3, side by side: k3 is low by p's mass outside P's support, e.g.
  where a lossy rule emits a tree node outright; ``trainers.drift.stats``), the same for the
  policy (log pi - log P: the trainer's importance ratio), staleness mean |log pi - log p|,
  relaxed fraction, the applied weights (min / mean / max, token ESS, masked fraction) and
  the sequence ESS of prod_t pi / P.
Non-finite numbers (e.g. KL = inf where P puts mass outside supp p) are written as null in
JSON, with the fraction of infinite KL reported separately; the KL mean and p99 of ``drift.md``
and the per-position KL plot are over the finite values, with that fraction next to them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from trainers.drift.plots import plot_report, plot_run_drift
from trainers.drift.run import RunData
from trainers.drift.stats import (accuracy_stats, compare_accuracy, effective_sample_size, kl_estimates, quantiles,
                                   sequence_ess)
from trainers.drift.study import PLAIN
from trainers.grpo.report import read_jsonl


def position_profile(data: RunData, key: str) -> list[float | None]:
    """Mean of per-token metric ``key`` at each completion position (None where no token)."""
    pos = data.token_array("position").long()
    vals = data.token_array(key)
    if pos.numel() == 0:
        return []
    n = int(pos.max()) + 1
    finite = torch.isfinite(vals)
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, pos[finite], vals[finite])
    counts = torch.zeros(n, dtype=torch.float64).index_add_(0, pos[finite], torch.ones_like(vals[finite]))
    return [float(s / c) if c else None for s, c in zip(sums, counts)]


def summarise(data: RunData) -> dict:
    """Every per-configuration field of the JSON (comparisons are added by :func:`compare`)."""
    t, spec = data.timings, data.spec
    kl = data.token_array("kl")
    finite_kl = kl[torch.isfinite(kl)]
    seq = torch.tensor(data.seq_log_ratio, dtype=torch.float64)
    rewards = [r for r in data.rewards if r is not None]
    out = {
        "key": spec.key, "kind": spec.kind, "mode": spec.mode, "verifier": spec.verifier.name,
        "params": dict(spec.verifier.params), "baseline": spec.baseline, "secondary_baseline": spec.secondary,
        "n_prompts": len(data.lengths), "n_tokens": int(sum(data.lengths)),
        "mean_length": sum(data.lengths) / max(1, len(data.lengths)),
        "tau": t.get("emitted", 0.0) / t["row_rounds"] if t.get("row_rounds") else None,
        "tokens_per_s": t.get("tokens", 0.0) / t["total_s"] if t.get("total_s") else None,
        "tokens_per_cpu_s": t.get("tokens", 0.0) / t["cpu_s"] if t.get("cpu_s") else None,
        "time_s": t.get("total_s"), "cpu_s": t.get("cpu_s"), "target_forwards": t.get("target_forwards"),
        "tv": quantiles(data.token_array("tv")),
        "kl": {**quantiles(finite_kl), "inf_frac": float((~torch.isfinite(kl)).double().mean()) if kl.numel() else 0.0},
        "entropy_P": float(data.token_array("entropy_P").mean()) if kl.numel() else None,
        "entropy_p": float(data.token_array("entropy_p").mean()) if kl.numel() else None,
        "relaxed_frac": float(data.token_array("relaxed").mean()) if kl.numel() else None,
        "uncovered": quantiles(data.token_array("uncovered")),
        "seq_log_ratio": {**quantiles(seq, (0.01, 0.1, 0.5, 0.9)), "std": float(seq.std()) if seq.numel() > 1 else 0.0},
        "seq_ess": sequence_ess(seq),
        "behaviour_logprob_max_err": float(data.token_array("logP_err").max()) if kl.numel() else None,
        "accuracy": accuracy_stats(rewards),
        "per_difficulty": {},
        "per_position": {"tv": position_profile(data, "tv"), "kl": position_profile(data, "kl")},
    }
    for d in sorted(set(data.difficulties)):
        out["per_difficulty"][str(d)] = {"accuracy": accuracy_stats(
            [r for r, dd in zip(data.rewards, data.difficulties) if dd == d and r is not None])}
    return out


def compare(results: dict[str, dict]) -> dict[str, dict]:
    """Add speedups and the accuracy gaps against the matched (and secondary) baselines."""
    plain = results.get(PLAIN)
    for r in results.values():
        lossless = results.get(f"lossless@{r['mode']}")
        for prefix, speed in (("", "tokens_per_s"), ("cpu_", "tokens_per_cpu_s")):
            r[f"{prefix}speedup_vs_lossless"] = _ratio(r[speed], lossless and lossless[speed])
            r[f"{prefix}speedup_vs_autoregressive"] = _ratio(r[speed], plain and plain[speed])
        base = results.get(r["baseline"]) if r["baseline"] else None
        # completions shorter or longer than the matched baseline's: drift, seen without a task score
        r["length_vs_baseline"] = _ratio(r["mean_length"], base and base["mean_length"])
        for field_name, base_key in (("vs_baseline", r["baseline"]), ("vs_secondary", r["secondary_baseline"])):
            base = results.get(base_key) if base_key else None
            if base is None:
                r[field_name] = None
                continue
            per_d = {d: compare_accuracy(v["accuracy"], base["per_difficulty"][d]["accuracy"])
                     for d, v in r["per_difficulty"].items() if d in base["per_difficulty"]}
            r[field_name] = {"baseline": base_key, **compare_accuracy(r["accuracy"], base["accuracy"]),
                             "per_difficulty": per_d}
    return results


def _ratio(a, b):
    return a / b if a is not None and b else None


def build_report(runs: list[RunData], config: dict) -> dict:
    return {"config": config, "configurations": compare({d.spec.key: summarise(d) for d in runs})}


def finite_json(obj):
    """A copy with NaN / inf replaced by None (strict JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_json(v) for v in obj]
    return obj


# ----------------------------------------------------------------------------- table
def _f(x, spec: str = ".3f") -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _acc(a: dict) -> str:
    if not a["n"]:
        return "-"
    return f"{a['mean']:.3f} [{a['ci_low']:.2f}, {a['ci_high']:.2f}]"


def _gap(c: dict | None) -> str:
    if not c or c["diff"] is None:
        return "-"
    return f"{c['diff']:+.3f} (p={c['p_value']:.2f})"


def markdown_table(report: dict) -> str:
    """One row per configuration: speed, drift, IS weights, accuracy and the gap to its baseline."""
    basis = report.get("config", {}).get("speed_basis", "wall")
    pre = "cpu_" if basis == "cpu" else ""
    # KL mean / p99 are over the finite values; "KL inf" is the share of tokens with KL = inf
    head = (f"| configuration | tau | tok/s | tok/CPU-s | x lossless ({basis}) | x AR ({basis}) | mean len (x baseline) "
            "| TV mean | TV p99 | KL mean (finite) | KL p99 (finite) | KL inf | H(P) | H(p) | relaxed | uncovered "
            "| seq log w mean | seq ESS | accuracy [95% CI] | vs matched baseline |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, r in report["configurations"].items():
        lines.append("| " + " | ".join([
            key, _f(r["tau"], ".2f"), _f(r["tokens_per_s"], ".1f"), _f(r["tokens_per_cpu_s"], ".1f"),
            _f(r[f"{pre}speedup_vs_lossless"], ".2f"), _f(r[f"{pre}speedup_vs_autoregressive"], ".2f"),
            _f(r["mean_length"], ".1f") + (f" ({r['length_vs_baseline']:.2f}x)" if r["length_vs_baseline"] else ""),
            _f(r["tv"]["mean"], ".4f"), _f(r["tv"]["p99"], ".3f"),
            _f(r["kl"]["mean"], ".4f"), _f(r["kl"]["p99"], ".3f"), _f(r["kl"].get("inf_frac"), ".2%"),
            _f(r["entropy_P"], ".2f"), _f(r["entropy_p"], ".2f"),
            _f(r["relaxed_frac"], ".3f"), _f(r["uncovered"]["mean"], ".4f"), _f(r["seq_log_ratio"]["mean"], ".2f"),
            _f(r["seq_ess"], ".3f"), _acc(r["accuracy"]),
            (f"{r['baseline']}: " + _gap(r["vs_baseline"])) if r["vs_baseline"] else "-",
        ]) + " |")
    return "\n".join(lines)


def difficulty_table(report: dict) -> str:
    """Accuracy per difficulty, and the gap to the matched baseline."""
    diffs = sorted({d for r in report["configurations"].values() for d in r["per_difficulty"]})
    lines = ["| configuration | " + " | ".join(f"d{d} acc | d{d} gap" for d in diffs) + " |",
             "|---|" + "---|---|" * len(diffs)]
    for key, r in report["configurations"].items():
        cells = []
        for d in diffs:
            acc = r["per_difficulty"].get(d, {}).get("accuracy")
            gap = (r["vs_baseline"] or {}).get("per_difficulty", {}).get(d)
            cells += [_acc(acc) if acc else "-", _gap(gap)]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_outputs(report: dict, out_dir: str | Path, plots: bool = True) -> list[Path]:
    """``drift.json``, ``drift.md`` and (when ``plots``) the PNGs; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "drift.json").write_text(json.dumps(finite_json(report), indent=1))
    md = "# Drift diagnostics\n\n" + markdown_table(report) + "\n\n## Accuracy per difficulty\n\n" + \
        difficulty_table(report) + "\n"
    (out / "drift.md").write_text(md)
    files = [out / "drift.json", out / "drift.md"]
    if plots:
        files += plot_report(report, out)
    return files


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


def step_stats(records: list[dict]) -> dict[str, float]:
    """Drift and IS-weight statistics of one step's completions (the training-run view above)."""
    cat = {f: torch.tensor([v for r in records for v in r[f]], dtype=torch.float64) for f in ROLLOUT_FIELDS[2:-1]}
    to_p = cat["target_logprobs"] - cat["behaviour_logprobs"]  # log p - log P
    to_pi = cat["policy_logprobs"] - cat["behaviour_logprobs"]  # log pi - log P
    w = cat["weights"]
    seq = torch.tensor([sum(r["policy_logprobs"]) - sum(r["behaviour_logprobs"]) for r in records], dtype=torch.float64)
    k1, k3 = kl_estimates(to_p)
    pk1, pk3 = kl_estimates(to_pi)
    n = w.numel()
    return {
        "completions": len(records), "tokens": n, "reward_mean": sum(r["reward"] for r in records) / len(records),
        "relaxed_frac": float(cat["relaxed"].mean()) if n else 0.0,
        "kl_P_p_k1": k1, "kl_P_p_k3": k3, "kl_P_pi_k1": pk1, "kl_P_pi_k3": pk3,
        "log_ratio_abs_mean": float(to_pi.abs().mean()) if n else 0.0,
        "stale_abs_mean": float((cat["policy_logprobs"] - cat["target_logprobs"]).abs().mean()) if n else 0.0,
        "weight_min": float(w.min()) if n else 0.0, "weight_mean": float(w.mean()) if n else 0.0,
        "weight_max": float(w.max()) if n else 0.0,
        "weight_ess": min(1.0, effective_sample_size(w)) if n else 0.0,
        "masked_frac": float((w == 0).double().mean()) if n else 0.0,
        "seq_log_ratio_mean": float(seq.mean()), "seq_ess": sequence_ess(seq),
    }


def from_run(run_dir: str | Path, out_dir: str | Path) -> list[Path]:
    """Per-step drift and IS statistics of a training run: JSON, Markdown table and two plots."""
    rows = [{"step": s, **step_stats(recs)} for s, recs in read_rollouts(run_dir).items()]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_drift.json").write_text(json.dumps(finite_json({"run": str(run_dir), "steps": rows}), indent=1))
    keys = ("reward_mean", "relaxed_frac", "kl_P_p_k1", "kl_P_p_k3", "kl_P_pi_k1", "kl_P_pi_k3", "weight_mean",
            "weight_ess", "seq_ess", "masked_frac")
    lines = ["| step | " + " | ".join(keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines += [f"| {r['step']} | " + " | ".join(f"{r[k]:.4g}" for k in keys) + " |" for r in rows]
    (out / "run_drift.md").write_text("# Drift over training steps\n\n" + "\n".join(lines) + "\n")
    return [out / "run_drift.json", out / "run_drift.md", *plot_run_drift(rows, out)]
