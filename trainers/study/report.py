"""The study's report, rebuilt from the run folders alone: ``study.json`` (every number),
``study.md`` (tables, verdicts, method) and ``plots/`` (``trainers.study.plots``).

Per setting: held-out accuracy over steps (a band across seeds) at each evaluation temperature;
the final accuracy (the evaluation after the last step) with its 95% interval, overall and by
difficulty; its paired differences (``trainers.study.grid.comparisons``); the training totals
(rollout tokens/s and time, tau, KL(P || pi) as k1 and k3, IS ESS) and their curves; the rollout
speed against the reference, seed by seed; and the verdict (``trainers.study.verdict``). The
statistics are ``trainers.study.stats``'s. A run counts as finished once its final evaluation
is in its ``eval.jsonl``; the final numbers use finished runs only, the curves every run.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from trainers.drift.study import baseline_key, verifier_label
from trainers.grpo.checkpoint import write_atomic
from trainers.grpo.report import read_metrics
from trainers.study import stats
from trainers.study.config import SettingConfig, StudyConfig
from trainers.study.evaluate import EvalLog, eval_key, resolved_max_new_tokens
from trainers.study.grid import Comparison, RunPlan, comparisons
from trainers.study.verdict import verdict

CURVE_METRICS = ("tau", "kl_k1", "kl_k3", "is_ess", "rollout_tokens_per_s")


def temp_key(t: float) -> str:
    return f"{t:g}"


# ----------------------------------------------------------------------------- reading
def read_run(plan: RunPlan, cfg: StudyConfig) -> dict:
    """One run folder: its metrics rows (the last record of a step), its evaluation records of the
    current evaluation (by temperature and step) and whether its final evaluation is there."""
    by_step = {r["step"]: r for r in read_metrics(plan.out_dir)}
    rows = [by_step[s] for s in sorted(by_step) if s <= plan.config.run.steps]
    max_new = resolved_max_new_tokens(cfg.eval, plan.config)
    keys = {eval_key(cfg.eval, t, max_new): temp_key(t) for t in cfg.eval.temperatures}
    evals: dict[tuple[str, int], dict] = {}
    for rec in EvalLog(plan.out_dir).records():
        if rec.get("key") in keys:
            evals[(keys[rec["key"]], rec["step"])] = rec
    steps = plan.config.run.steps
    finished = all((t, steps) in evals for t in keys.values())
    return {"setting": plan.setting, "seed": plan.seed, "out_dir": str(plan.out_dir), "rows": rows, "evals": evals,
            "finished": finished, "last_step": rows[-1]["step"] if rows else 0}


# ----------------------------------------------------------------------------- describing settings
def rollouts_label(s: SettingConfig, train) -> str:
    """What a setting samples with: the truncation baseline, or the verifier and its speculation."""
    if s.truncation_sampling:
        return f"{baseline_key(s.verifier)}, no speculation"
    spec = train.rollout.spec
    shape = {"off": "no speculation", "chain": f"chain K = {spec.num_draft_tokens}",
             "tree": f"tree {spec.depth},{spec.top_k},{spec.total_tokens}"}[spec.mode]
    return f"{verifier_label(s.verifier)}, {shape}"


def correction_label(s: SettingConfig) -> str:
    c = s.correction
    if c.mode == "none":
        return "none"
    if c.mode in ("token_tis", "seq_tis"):
        return f"{c.mode} (cap {c.cap:g})"
    extra = f", cap {c.cap:g}" if c.mode == "geo_mis" else ""
    return f"{c.mode} ([{c.low:g}, {c.high:g}]{extra})"


# ----------------------------------------------------------------------------- the summary
def _answers(runs: list[dict], t: str, step: int, difficulty: int | None = None) -> dict[int, dict[str, int]]:
    out = {}
    for r in runs:
        rec = r["evals"].get((t, step))
        if rec is None:
            continue
        out[r["seed"]] = {i: c for i, c, d in zip(rec["ids"], rec["correct"], rec["difficulty"])
                          if difficulty is None or d == difficulty}
    return out


def summarise(cfg: StudyConfig, plans: list[RunPlan], runs: list[dict], provenance: dict | None = None) -> dict:
    """Everything ``study.json`` holds (see the module docstring)."""
    draws, bseed = cfg.study.bootstrap_draws, cfg.study.bootstrap_seed
    ref = cfg.study.reference
    steps = plans[0].config.run.steps if plans else 0
    temps = [temp_key(t) for t in cfg.eval.temperatures]
    finished = {name: [r for r in runs if r["setting"] == name and r["finished"]] for name in cfg.settings}
    answers = {name: {t: _answers(finished[name], t, steps) for t in temps} for name in cfg.settings}
    totals = {name: {r["seed"]: stats.run_totals(r["rows"]) for r in finished[name]} for name in cfg.settings}
    cmps: dict[str, list[Comparison]] = {}
    for c in comparisons(cfg):
        cmps.setdefault(c.setting, []).append(c)
    train_of = {p.setting: p.config for p in plans}
    settings = {}
    for name, s in cfg.settings.items():
        mine = [r for r in runs if r["setting"] == name]
        final = {}
        for t in temps:
            final[t] = {
                "accuracy": stats.accuracy(answers[name][t], draws, bseed),
                "by_difficulty": {str(d): stats.accuracy(_answers(finished[name], t, steps, d), draws, bseed)
                                  for d in cfg.eval.difficulties},
                "comparisons": [{"other": c.other, "kind": c.kind, "difference": stats.paired_difference(
                    answers[name][t], answers[c.other][t], draws, bseed)} for c in cmps.get(name, [])],
            }
        curves = {t: stats.band({r["seed"]: {k: rec["accuracy"] for (tt, k), rec in r["evals"].items() if tt == t}
                                 for r in mine}) for t in temps}
        training_curves = {m: stats.band({r["seed"]: {row["step"]: row.get(m) for row in r["rows"]} for r in mine})
                           for m in CURVE_METRICS}
        mine_totals = totals[name]
        training = {k: stats.spread([t[k] for t in mine_totals.values()])
                    for k in ("tokens_per_s", "rollout_s", *stats.TRAINING_MEANS)}
        speed = {key: stats.seed_ratios({sd: t[key] for sd, t in mine_totals.items()},
                                        {sd: t[key] for sd, t in totals[ref].items()})
                 for key in ("tokens_per_s", "rollout_s")}
        entry = {"name": name, "verifier": s.verifier.name,
                 "rollouts": rollouts_label(s, train_of[name]) if name in train_of else None,
                 "correction": correction_label(s), "runs_planned": len([p for p in plans if p.setting == name]),
                 "seeds_finished": sorted(r["seed"] for r in finished[name]), "final": final, "curves": curves,
                 "training": training, "training_curves": training_curves, "speed_vs_reference": speed}
        entry["verdict"] = verdict(entry, ref)
        settings[name] = entry
    run_rows = [{"setting": r["setting"], "seed": r["seed"], "finished": r["finished"], "last_step": r["last_step"],
                 "out_dir": r["out_dir"]} for r in runs]
    return {"study": {"out_dir": cfg.study.out_dir, "seeds": list(cfg.study.seeds), "reference": ref, "steps": steps,
                      "settings": list(cfg.settings), "eval": {**_plain(cfg.eval), "problems": (
                          cfg.eval.problems_per_difficulty * len(cfg.eval.difficulties))},
                      "bootstrap": {"draws": draws, "seed": bseed, "level": stats.LEVEL}},
            "provenance": provenance or {}, "settings": settings, "runs": run_rows}


def _plain(obj) -> dict:
    import dataclasses

    return json.loads(json.dumps(dataclasses.asdict(obj)))


# ----------------------------------------------------------------------------- Markdown
def _f(x: float | None, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if x != 0 and abs(x) < 10 ** -digits:
        return f"{x:.2g}"
    return f"{x:.{digits}f}" if abs(x) < 1000 else f"{x:.0f}"


def _ci(d: dict | None, signed: bool = False) -> str:
    if d is None:
        return "-"
    fmt = (lambda x: f"{x:+.3f}") if signed else (lambda x: f"{x:.3f}")
    return f"{fmt(d['mean'])} [{fmt(d['ci_low'])}, {fmt(d['ci_high'])}]"


def _sp(d: dict | None, digits: int = 3) -> str:
    if d is None:
        return "-"
    if d["n"] == 1 or d["min"] == d["max"]:
        return _f(d["mean"], digits)
    return f"{_f(d['mean'], digits)} [{_f(d['min'], digits)}-{_f(d['max'], digits)}]"


def markdown(summary: dict) -> str:
    st, prov, settings = summary["study"], summary["provenance"], summary["settings"]
    ref, ev = st["reference"], st["eval"]
    temps = list(next(iter(settings.values()))["final"]) if settings else []
    done = sum(r["finished"] for r in summary["runs"])
    lines = ["# GRPO with lossy verification: study report", ""]
    if prov:
        lines.append(f"Generated {prov.get('time', '-')} by `{prov.get('command', '-')}` at commit "
                     f"{prov.get('commit', '-')} on {prov.get('machine', '-')}.")
    lines += [f"{len(st['settings'])} settings x {len(st['seeds'])} seeds ({', '.join(map(str, st['seeds']))}), "
              f"{st['steps']} steps each; {done} of {len(summary['runs'])} runs finished. Held-out accuracy of the "
              f"policy itself, sampled exactly, on {ev['problems']} problems (difficulties "
              f"{', '.join(map(str, ev['difficulties']))}) at T = {', '.join(temps)}, every {ev['every']} steps, "
              f"before the first and after the last. Reference: `{ref}`.", ""]
    lines += ["## Verdicts", ""]
    for name, s in settings.items():
        lines += [f"**{name}** ({s['rollouts']}; correction {s['correction']})", ""]
        lines += [f"- {v}" for v in s["verdict"]] + [""]
    for t in temps:
        lines += [f"## Final held-out accuracy, T = {t} (step {st['steps']})", "",
                  "Accuracy with its 95% interval (two-way bootstrap over seeds and problems), per seed, and the "
                  "paired difference (this setting minus the other, same seeds and problems) with its interval.", "",
                  f"| setting | rollouts | correction | accuracy | per seed | vs {ref} | vs uncorrected | "
                  "vs baseline |",
                  "|---|---|---|---|---|---|---|---|"]
        for name, s in settings.items():
            f = s["final"][t]
            acc = f["accuracy"]
            per = ", ".join(f"{x:.3f}" for x in acc["per_seed"]) if acc else "-"
            by_kind = {c["kind"]: c for c in f["comparisons"]}

            def cell(kind: str) -> str:
                c = by_kind.get(kind)
                return "-" if c is None else f"{_ci(c['difference'], signed=True)} ({c['other']})"
            lines.append(f"| {name} | {s['rollouts']} | {s['correction']} | {_ci(acc)} | {per} | {cell('reference')} | "
                         f"{cell('uncorrected')} | {cell('baseline')} |")
        lines.append("")
    diffs = ev["difficulties"]
    lines += ["## Final accuracy by difficulty", "",
              "| setting | T | " + " | ".join(f"difficulty {d}" for d in diffs) + " |",
              "|---|---|" + "---|" * len(diffs)]
    for name, s in settings.items():
        for t in temps:
            cells = [_ci(s["final"][t]["by_difficulty"][str(d)]) for d in diffs]
            lines.append(f"| {name} | {t} | " + " | ".join(cells) + " |")
    lines += ["", "## Training", "",
              "Per run: rollout tokens over rollout seconds, rollout seconds in all, and the mean over steps of the "
              "rest (IS ESS: of the weights the correction applied, 1 without one); per setting: the mean over its "
              "finished runs [min-max]. Speeds are measured on the machine as it was during each run.", "",
              "| setting | rollout tok/s | rollout time (s) | tau | KL(P\\|\\|pi) k1 | KL k3 | IS ESS | step (s) | "
              f"tok/s vs {ref} (per seed) |", "|---|---|---|---|---|---|---|---|---|"]
    for name, s in settings.items():
        tr = s["training"]
        lines.append(f"| {name} | {_sp(tr['tokens_per_s'], 1)} | {_sp(tr['rollout_s'], 1)} | {_sp(tr['tau'], 2)} | "
                     f"{_sp(tr['kl_k1'])} | {_sp(tr['kl_k3'])} | {_sp(tr['is_ess'])} | {_sp(tr['step_s'], 1)} | "
                     f"{_sp(s['speed_vs_reference']['tokens_per_s'], 2)} |")
    lines += ["", "## Figures", "",
              "- `plots/accuracy_over_steps.png`: held-out accuracy over steps, one row per temperature, one panel "
              f"per verifier with `{ref}` in each; the line is the mean over seeds, the band their min to max.",
              "- `plots/final_differences.png`: the paired differences with their 95% intervals.",
              "- `plots/training_over_steps.png`: tau, KL(P || pi) k1 and k3, IS ESS and rollout tokens/s over "
              "steps (mean over seeds, band min to max).",
              "- `plots/rollout_speed.png`: rollout tokens/s and total rollout time per setting (bars: mean over "
              "seeds; whiskers: min to max).", "",
              "![accuracy over steps](plots/accuracy_over_steps.png)", "",
              "![final differences](plots/final_differences.png)", "",
              "![training over steps](plots/training_over_steps.png)", "",
              "![rollout speed](plots/rollout_speed.png)", "",
              "## Method", "",
              "- Runs of one seed share the training problems and rollout seeds; every run is evaluated on the same "
              "held-out problems with the same sampling seeds. Differences are taken per (seed, problem) over the "
              "seeds both settings finished.",
              f"- 95% intervals: two-way bootstrap ({summary['study']['bootstrap']['draws']} draws, seed "
              f"{summary['study']['bootstrap']['seed']}): each draw resamples the seeds and, independently, the "
              "problems with replacement; percentiles 2.5 and 97.5 of the draws' means. It covers run-to-run and "
              "problem sampling noise; with few seeds its run-to-run part is too narrow (see the verdicts).",
              "- The evaluation samples the policy exactly (plain decoding, lossless, its full distribution) and "
              "checks that every token's behaviour log-prob equals its target log-prob; it never uses the run's "
              "verifier.",
              "- Speed is measured on the machine that ran each run; ratios are taken seed by seed against the "
              "reference's run of that seed.", "",
              "## Runs", "", "| setting | seed | finished | last step | folder |", "|---|---|---|---|---|"]
    for r in summary["runs"]:
        lines.append(f"| {r['setting']} | {r['seed']} | {'yes' if r['finished'] else 'no'} | {r['last_step']} | "
                     f"`{r['out_dir']}` |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- writing
def provenance(command: str) -> dict:
    """When, by which command, at which commit and on what machine the report was made."""
    import os
    import platform
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                                cwd=Path(__file__).resolve().parent).stdout.strip() or "-"
    except (OSError, subprocess.SubprocessError):
        commit = "-"
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command, "commit": commit,
            "machine": f"{cpu}, {os.cpu_count()} cores"}


def write_report(cfg: StudyConfig, plans: list[RunPlan], command: str = "") -> tuple[Path, Path, list[Path]]:
    """Read every run folder of ``plans``, write ``study.json``, ``study.md`` and ``plots/`` in the
    study folder; returns their paths."""
    from trainers.study.plots import plot_study

    out = Path(cfg.study.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarise(cfg, plans, [read_run(p, cfg) for p in plans], provenance(command))
    js = out / "study.json"
    write_atomic(js, json.dumps(summary, indent=1, allow_nan=False) + "\n")
    md = out / "study.md"
    write_atomic(md, markdown(summary))
    return md, js, plot_study(summary, out / "plots")
