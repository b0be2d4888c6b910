"""Statistics, tables and plots of a drift study (``trainers.drift``), and the view of a
training run's logged rollouts over steps.

Vocabulary: see ``trainers.drift``. Added here:
- **Wilson interval**: the 95% score interval of an accuracy k / n.
- **gap**: accuracy of a configuration minus that of its matched baseline, with Newcombe's
  hybrid score interval (from the two Wilson intervals) and a pooled two-proportion z-test.
  The two runs use the same prompts, but independent samples, so the unpaired test is
  conservative.
- **speedup**: tokens/s over lossless verification in the same speculative mode, and over
  plain autoregressive sampling (the ``plain`` baseline, same engine, mode off); the
  ``cpu_`` variants use tokens per CPU-second of the generate calls instead of wall time.
Non-finite numbers (e.g. KL = inf where P puts mass outside supp p) are written as null in
JSON, with the fraction of infinite KL reported separately.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from trainers.drift import PLAIN
from trainers.drift_run import RunData

Z95 = 1.959963984540054
METRIC_LABELS = {"tv": "TV(P,p)", "kl": "KL(P||p)"}


# ----------------------------------------------------------------------------- statistics
def quantiles(x: torch.Tensor, qs=(0.5, 0.9, 0.99)) -> dict[str, float]:
    """mean and quantiles (p50/p90/p99 keys) of a 1-D tensor; NaN when empty."""
    x = x.double()
    if x.numel() == 0:
        return {"mean": math.nan, **{f"p{round(q * 100)}": math.nan for q in qs}}
    return {"mean": float(x.mean()), **{f"p{round(q * 100)}": float(torch.quantile(x, q)) for q in qs}}



def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion k / n; (0, 1) when n = 0."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    lo = 0.0 if k == 0 else min(p, max(0.0, centre - half))  # exact ends where rounding would cross p
    hi = 1.0 if k == n else max(p, min(1.0, centre + half))
    return lo, hi


def accuracy_stats(rewards: list[float]) -> dict:
    """k, n, accuracy and its Wilson interval (a reward >= 1 counts as correct)."""
    n = len(rewards)
    k = sum(1 for r in rewards if r >= 1.0)
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "mean": k / n if n else None, "ci_low": lo, "ci_high": hi}


def compare_accuracy(a: dict, b: dict) -> dict:
    """Gap a - b with Newcombe's interval, a two-proportion z-test and whether the intervals overlap."""
    if not a["n"] or not b["n"]:
        return {"diff": None, "diff_ci_low": None, "diff_ci_high": None, "z": None, "p_value": None,
                "intervals_overlap": None}
    pa, pb = a["k"] / a["n"], b["k"] / b["n"]
    d = pa - pb
    lo = d - math.sqrt((pa - a["ci_low"]) ** 2 + (b["ci_high"] - pb) ** 2)
    hi = d + math.sqrt((a["ci_high"] - pa) ** 2 + (pb - b["ci_low"]) ** 2)
    pool = (a["k"] + b["k"]) / (a["n"] + b["n"])
    se = math.sqrt(pool * (1 - pool) * (1 / a["n"] + 1 / b["n"]))
    z = d / se if se > 0 else 0.0
    return {"diff": d, "diff_ci_low": lo, "diff_ci_high": hi, "z": z, "p_value": math.erfc(abs(z) / math.sqrt(2)),
            "intervals_overlap": a["ci_low"] <= b["ci_high"] and b["ci_low"] <= a["ci_high"]}


def sequence_ess(log_w: torch.Tensor) -> float:
    """(sum w)^2 / (n sum w^2) of weights exp(log_w) [n], computed stably; 1.0 when empty."""
    if log_w.numel() == 0:
        return 1.0
    w = torch.exp(log_w.double() - log_w.max())
    return min(1.0, float(w.sum() ** 2 / (w.numel() * (w * w).sum())))


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
    head = (f"| configuration | tau | tok/s | tok/CPU-s | x lossless ({basis}) | x AR ({basis}) | TV mean | TV p99 | KL mean | KL p99 | H(P) | H(p) "
            "| relaxed | uncovered | seq log w mean | seq ESS | accuracy [95% CI] | vs matched baseline |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for key, r in report["configurations"].items():
        lines.append("| " + " | ".join([
            key, _f(r["tau"], ".2f"), _f(r["tokens_per_s"], ".1f"), _f(r["tokens_per_cpu_s"], ".1f"),
            _f(r[f"{pre}speedup_vs_lossless"], ".2f"), _f(r[f"{pre}speedup_vs_autoregressive"], ".2f"),
            _f(r["tv"]["mean"], ".4f"), _f(r["tv"]["p99"], ".3f"),
            _f(r["kl"]["mean"], ".4f"), _f(r["kl"]["p99"], ".3f"), _f(r["entropy_P"], ".2f"), _f(r["entropy_p"], ".2f"),
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
    from trainers.drift_plots import plot_report

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
