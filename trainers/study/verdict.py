"""The generated verdict of each setting: what its numbers support, and what they do not.

Rules (the wording never goes past the intervals):
- a difference whose 95% interval holds 0 reads "no difference detected at this size", with the
  interval (differences inside it are not ruled out); one whose interval excludes 0 reads "below"
  or "above", by the point estimate, with the interval;
- fewer than 3 seeds: the interval's seed part is barely sampled (one seed: not at all), so it
  is called a lower bound on the uncertainty; a setting or comparison without finished runs says
  so and nothing else;
- speed is a ratio to the reference's, per seed: "faster" or "slower" only when every seed of
  several agrees, "mixed" otherwise; drift (KL, and the IS ESS where a correction applies weights)
  is stated as measured, without a judgement.
"""

from __future__ import annotations

QUESTIONS = {
    "reference": "against {other}",
    "uncorrected": "against the same rollouts uncorrected ({other}): what the correction buys back",
    "baseline": "against its matched baseline {other} (the same truncation on the target, no speculation)",
}
FEW_SEEDS = 3


def _signed(x: float) -> str:
    return f"{x:+.3f}"


def difference_sentence(cmp: dict | None, other: str, kind: str, temperature: str) -> str:
    """One comparison at one temperature (``cmp``: ``stats.paired_difference``'s dict, or None)."""
    what = QUESTIONS[kind].format(other=other)
    if cmp is None:
        return f"T = {temperature}, {what}: no finished pair of runs yet."
    d, lo, hi = cmp["mean"], cmp["ci_low"], cmp["ci_high"]
    interval = f"95% CI [{_signed(lo)}, {_signed(hi)}]"
    n = len(cmp["seeds"])
    size = f"{n} seed{'s' if n != 1 else ''} x {cmp['n_problems']} problems"
    if lo <= 0 <= hi:
        return (f"T = {temperature}, {what}: no difference detected at this size ({_signed(d)}, {interval}; {size}); "
                f"differences inside that interval are not ruled out.")
    side = "below" if hi < 0 else "above"
    return f"T = {temperature}, {what}: {side} by {abs(d):.3f} ({interval}; {size})."


def seeds_caveat(n_seeds: int) -> str | None:
    if n_seeds == 1:
        return ("With one seed the intervals cover the held-out problems only, not the run-to-run variation: "
                "read them as a lower bound on the uncertainty.")
    if 1 < n_seeds < FEW_SEEDS:
        return (f"With {n_seeds} seeds the intervals sample the run-to-run variation barely: read them as a "
                "lower bound on the uncertainty.")
    return None


def speed_sentence(ratio: dict | None, time_ratio: dict | None, reference: str) -> str | None:
    """Rollout speed against the reference, from the per-seed ratios of tokens/s and rollout time."""
    if ratio is None:
        return None
    if ratio["n"] == 1:
        text = f"Rollouts: {ratio['mean']:.2f}x {reference}'s tokens/s (one seed: a single pair of runs)"
    else:
        word = ("faster in every seed" if ratio["min"] > 1 else "slower in every seed" if ratio["max"] < 1
                else "mixed across seeds")
        text = (f"Rollouts: {ratio['mean']:.2f}x {reference}'s tokens/s (seeds {ratio['min']:.2f}-"
                f"{ratio['max']:.2f}x: {word})")
    if time_ratio is not None:
        text += f", {time_ratio['mean']:.2f}x its total rollout time"
    return text + "."


def drift_sentence(training: dict, corrected: bool) -> str | None:
    """KL(P || pi) as measured; the IS ESS of the applied weights where a correction applies some
    (without one every weight is 1)."""
    k1, k3, ess = training.get("kl_k1"), training.get("kl_k3"), training.get("is_ess")
    if k1 is None or k3 is None:
        return None
    text = f"Drift over training: KL(P || pi) k1 {k1['mean']:.3g} per token (k3 {k3['mean']:.3g})"
    return text + (f", IS ESS of the applied weights {ess['mean']:.3f}." if corrected and ess is not None else ".")


def verdict(setting: dict, reference: str) -> list[str]:
    """The verdict lines of one setting's summary (``report.summarise``'s per-setting dict)."""
    finals = setting.get("final") or {}
    if not finals or all(f.get("accuracy") is None for f in finals.values()):
        return ["No finished run with a final evaluation yet: nothing to conclude."]
    lines = []
    if setting["name"] == reference:
        accs = [f"T = {t}: {f['accuracy']['mean']:.3f} (95% CI [{f['accuracy']['ci_low']:.3f}, "
                f"{f['accuracy']['ci_high']:.3f}])" for t, f in finals.items() if f.get("accuracy")]
        lines.append("The reference (exact rollouts). Final held-out accuracy " + "; ".join(accs) + ".")
    for t, f in finals.items():
        for c in f.get("comparisons", []):
            lines.append(difference_sentence(c["difference"], c["other"], c["kind"], t))
    seeds = max((len(f["accuracy"]["seeds"]) for f in finals.values() if f.get("accuracy")), default=0)
    for extra in (seeds_caveat(seeds),
                  None if setting["name"] == reference else speed_sentence(
                      setting.get("speed_vs_reference", {}).get("tokens_per_s"),
                      setting.get("speed_vs_reference", {}).get("rollout_s"), reference),
                  drift_sentence(setting.get("training") or {}, setting.get("correction", "none") != "none")):
        if extra is not None:
            lines.append(extra)
    return lines
