"""Drift diagnostics (trainers.drift, scripts.drift) on tiny random models and controlled logits."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rollout.config import ConfigError, from_dict
from rollout.engine.engine import Engine
from rollout.outputs import DebugRecord
from rollout.params import SamplingParams, SpecConfig
from trainers.drift.report import build_report, write_outputs
from trainers.drift.run import run_all, token_drift
from trainers.drift.study import (DriftConfig, TruncationSamplingConfig, baseline_key, parse_verifier, plan_runs,
                                  verifier_label)
from tests.models import copy_head, tiny_target
from verifiers import get_rule, target_probs

# ----------------------------------------------------------------------------- tiny models
CHARS = "0123456789 +-=?:.,'abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


class CharTokenizer:
    """Ids 0-2 are pad/bos/eos; then one id per character of CHARS; the rest decode to ''."""

    eos_token_id = 2

    def __init__(self):
        self.ids = {c: i + 3 for i, c in enumerate(CHARS)}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize and add_generation_prompt
        return "U:" + messages[-1]["content"] + "\nA:"

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [self.ids.get(c, self.ids["?"]) for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return "".join(CHARS[i - 3] for i in ids if 3 <= i < 3 + len(CHARS))


VOCAB = 96


@pytest.fixture(scope="module")
def models():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    target = tiny_target(VOCAB, logit_scale=12.0, context=512)  # peaked: truncation sets and caps bite
    yield target, copy_head(target, noise=0.1), CharTokenizer()
    torch.set_num_threads(before)


LADDER = ("lossless", "mars:theta=0.97", "mars:theta=0.9", "mars:theta=0.5", "overshoot:lenience=0.9",
          "overshoot:lenience=0.5", "overshoot:lenience=0.1")


@pytest.fixture(scope="module")
def quick_report(models, tmp_path_factory):
    """A quick-mode study on the tiny models: the default verifiers plus a theta / lenience ladder."""
    target, head, tok = models
    cfg = from_dict(DriftConfig, {"difficulties": [1, 2], "prompts": 8, "modes": ["chain", "tree"],
                                  "verifiers": list(DriftConfig().verifiers) + list(LADDER),
                                  "max_new_tokens": 24, "batch_size": 8, "num_threads": 1})
    runs = run_all(cfg, target, head, tok, progress=False)
    report = build_report(runs, {"test": True})
    out = tmp_path_factory.mktemp("drift")
    files = write_outputs(report, out)
    return report, out, files


# ----------------------------------------------------------------------------- config and specs
def test_verifier_specs_parse_and_label():
    v = parse_verifier("overshoot:lenience=0.5,min_p=0.1")
    assert v.name == "overshoot" and v.params == {"lenience": 0.5, "min_p": 0.1}
    assert verifier_label(v) == "overshoot:lenience=0.5,min_p=0.1"
    assert verifier_label(parse_verifier({"name": "mars", "params": {"theta": 0.7}})) == "mars:theta=0.7"
    assert baseline_key(parse_verifier("min_p:p_base=0.2")) == "sampling[min_p:p_base=0.2]"
    assert baseline_key(parse_verifier("typical:epsilon=0.3,delta=0.9")) == "sampling[typical:epsilon=0.3,delta=0.9]"
    assert baseline_key(v) == "plain"  # the gated cap keeps the full support: matched with plain sampling


@pytest.mark.parametrize("data, field", [
    ({"source": "web"}, "source"), ({"modes": ["chain", "beam"]}, "modes"), ({"difficulties": [5]}, "difficulties"),
    ({"verifiers": ["mars:theta=2"]}, "verifiers"), ({"verifiers": ["nope"]}, "verifiers"),
    ({"prompts": 0}, "prompts"), ({"temperature": -1.0}, "temperature"), ({"source": "jsonl"}, "jsonl_path"),
    ({"tree": {"mode": "chain"}}, "tree"), ({"colour": 1}, "colour"), ({"speed_basis": "gpu"}, "speed_basis"),
    ({"head": "/no/such/head"}, "head"), ({"target": "/no/such/model.gguf"}, "target"),
    ({"num_threads": 0}, "num_threads"),
])
def test_config_errors_name_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        from_dict(DriftConfig, data)
    assert field in err.value.field


def test_a_sampled_tree_study_takes_lossy_verifiers():
    cfg = from_dict(DriftConfig, {"modes": ["tree"], "verifiers": ["mars", "overshoot:lenience=0.5"],
                                  "tree": {"mode": "tree", "tree_candidates": "sampled"}})
    assert cfg.tree.tree_candidates == "sampled" and set(cfg.verifiers) >= {"mars", "overshoot:lenience=0.5"}


def test_plan_adds_lossless_and_matched_baselines():
    cfg = DriftConfig(verifiers=("mars:theta=0.9", "min_p:p_base=0.1", "overshoot:lenience=0.5,min_p=0.1"),
                      modes=("chain", "tree"))
    runs = {r.key: r for r in plan_runs(cfg)}
    assert {"plain", "sampling[min_p:p_base=0.1]", "lossless@chain", "lossless@tree"} <= set(runs)
    assert runs["plain"].mode == runs["sampling[min_p:p_base=0.1]"].mode == "off"
    assert runs["min_p:p_base=0.1@tree"].baseline == "sampling[min_p:p_base=0.1]"
    assert runs["overshoot:lenience=0.5,min_p=0.1@chain"].secondary == "sampling[min_p:p_base=0.1]"
    assert runs["mars:theta=0.9@chain"].secondary is None


def test_plan_runs_the_law_test_on_chains_only():
    """``mars:theta=0.9,test=law`` is a chain run of its own with MARS's baseline; no tree run
    (a sampled tree's own run is that run, a top-k tree cannot)."""
    cfg = DriftConfig(verifiers=("mars:theta=0.9", "mars:theta=0.9,test=law"), modes=("chain", "tree"))
    runs = {r.key: r for r in plan_runs(cfg)}
    assert runs["mars:theta=0.9,test=law@chain"].verifier.test == "law"
    assert runs["mars:theta=0.9,test=law@chain"].baseline == runs["mars:theta=0.9@chain"].baseline
    assert "mars:theta=0.9,test=law@tree" not in runs and "mars:theta=0.9@tree" in runs


GREEDY_CHAIN = {"mode": "chain", "draft_sampling": "greedy"}


@pytest.mark.parametrize("data, mode", [
    ({"verifiers": ["lossless:test=block"], "modes": ["chain", "tree"]}, "tree"),
    ({"verifiers": ["mars:theta=0.9,test=law"], "chain": GREEDY_CHAIN}, "chain"),
    ({"verifiers": ["lossless:test=block"], "chain": GREEDY_CHAIN}, "chain"),
])
def test_a_test_the_engine_refuses_in_a_mode_is_refused_with_the_config(data, mode, capsys):
    """test=block on top-k trees, law or block on greedy chains: the engine's own check
    (``check_test``) refuses them at config time, naming the verifier and the mode, not mid-study
    after the earlier configurations ran; where the engine takes them, so does the config."""
    with pytest.raises(ConfigError, match=f"in mode '{mode}'") as err:
        from_dict(DriftConfig, data)
    assert err.value.field == f"verifiers[{data['verifiers'][0]!r}].test"
    other = {"tree": {"mode": "tree", "tree_candidates": "sampled"}} if mode == "tree" else {"chain": {"mode": "chain"}}
    for ok in ({**data, **other}, {**data, "temperature": 0.0}):  # sampled drafts, or every test greedy
        assert data["verifiers"][0] in from_dict(DriftConfig, ok).verifiers
    from scripts.drift import main

    if "chain" not in data:
        assert main(["--modes", ",".join(data["modes"]), "--verifiers", data["verifiers"][0]]) == 2
        assert f"verifiers[{data['verifiers'][0]!r}].test" in capsys.readouterr().err


# ----------------------------------------------------------------------------- per-token drift
def _records(n: int = 400, v: int = 40, seed: int = 0, chain: bool = True) -> list[DebugRecord]:
    g = torch.Generator().manual_seed(seed)
    z = 2.5 * torch.randn(n, v, generator=g) + 6.0  # positive top logits: MARS's ratio test applies
    d = z + 1.5 * torch.randn(n, v, generator=g)
    out = []
    for i in range(n):
        tok = int(torch.argmax(z[i]))
        if chain:
            out.append(DebugRecord(row=0, index=i, step_position=0, token=tok, target_logits=z[i], draft_logits=d[i]))
        else:
            cands = torch.topk(d[i], 3).indices
            out.append(DebugRecord(row=0, index=i, step_position=0, token=int(cands[0]), target_logits=z[i],
                                   candidates=cands))
    return out


@pytest.mark.parametrize("chain", [True, False])
def test_drift_is_zero_for_lossless_and_grows_as_rules_loosen(chain):
    records = _records(chain=chain)
    s = SamplingParams(temperature=1.0)

    def mean_tv(spec):
        return float(token_drift(parse_verifier(spec).rule(), records, s)["tv"].mean())

    lossless = token_drift(get_rule("lossless"), records, s)
    assert lossless["tv"].abs().max() < 1e-5 and lossless["kl"].abs().max() < 1e-5
    mars = [mean_tv(f"mars:theta={t}") for t in (1.0, 0.95, 0.9, 0.8, 0.6)]
    over = [mean_tv(f"overshoot:lenience={l}") for l in (1.0, 0.8, 0.5, 0.3, 0.1)]
    assert mars[0] < 1e-5 and over[0] < 1e-5
    assert all(b > a for a, b in zip(mars, mars[1:])), mars
    assert all(b > a for a, b in zip(over, over[1:])), over


def test_truncation_sampling_rule_is_p_restricted_to_a():
    records = _records(n=50, chain=False)
    s = SamplingParams(temperature=1.0)
    cfg = TruncationSamplingConfig("min_p", {"p_base": 0.2})
    d = token_drift(cfg.rule(), records, s)
    p = target_probs(torch.stack([r.target_logits for r in records]), 1.0)
    mass_a = torch.where(p >= 0.2 * p.amax(-1, keepdim=True), p, 0.0).sum(-1).double()
    torch.testing.assert_close(d["tv"], 1 - mass_a, atol=1e-5, rtol=0)
    torch.testing.assert_close(d["kl"], -mass_a.log(), atol=1e-5, rtol=0)
    torch.testing.assert_close(d["uncovered"], 1 - mass_a, atol=1e-5, rtol=0)


def test_truncation_baseline_through_the_engine_samples_inside_a(models):
    target, head, _ = models
    res = Engine(target, head, num_threads=1).generate(
        [[5, 6, 7], [9, 10]], SamplingParams(temperature=1.0, max_new_tokens=20), SpecConfig(mode="off"),
        TruncationSamplingConfig("min_p", {"p_base": 0.3}), seed=3, debug=True)
    for r in res.debug:
        p = target_probs(r.target_logits[None].float(), 1.0)[0]
        keep = p >= 0.3 * p.max()
        assert keep[r.token], "a truncation baseline emitted a token outside A"
        expected = math.log(p[r.token] / p[keep].sum())
        assert abs(res.completions[r.row].behaviour_logprobs[r.index] - expected) < 1e-4


# ----------------------------------------------------------------------------- the study on tiny models
CONFIG_FIELDS = {
    "key", "kind", "mode", "verifier", "params", "baseline", "secondary_baseline", "n_prompts", "n_tokens",
    "mean_length", "tau", "tokens_per_s", "time_s", "target_forwards", "tv", "kl", "entropy_P", "entropy_p",
    "relaxed_frac", "uncovered", "seq_log_ratio", "seq_ess", "behaviour_logprob_max_err", "accuracy",
    "per_difficulty", "per_position", "speedup_vs_lossless", "speedup_vs_autoregressive", "vs_baseline",
    "vs_secondary", "tokens_per_cpu_s", "cpu_s", "cpu_speedup_vs_lossless", "cpu_speedup_vs_autoregressive",
    "length_vs_baseline",
}
NUMERIC = ("tau", "tokens_per_s", "tokens_per_cpu_s", "entropy_P", "entropy_p", "relaxed_frac", "seq_ess",
           "speedup_vs_autoregressive", "cpu_speedup_vs_autoregressive")


def check_every_field(configs: dict) -> None:
    for key, r in configs.items():
        assert set(r) == CONFIG_FIELDS, (key, set(r) ^ CONFIG_FIELDS)
        for f in NUMERIC:
            assert isinstance(r[f], float) and math.isfinite(r[f]), (key, f, r[f])
        assert set(r["tv"]) == {"mean", "p50", "p90", "p99"} and r["tv"]["mean"] is not None
        assert {"mean", "p50", "p90", "p99", "inf_frac"} == set(r["kl"])
        assert {"k", "n", "mean", "ci_low", "ci_high"} == set(r["accuracy"]) and r["accuracy"]["n"] == r["n_prompts"]
        assert r["behaviour_logprob_max_err"] < 1e-3, (key, r["behaviour_logprob_max_err"])
        if r["kind"] == "verifier":
            assert isinstance(r["speedup_vs_lossless"], float) and isinstance(r["cpu_speedup_vs_lossless"], float)
            assert set(r["vs_baseline"]) >= {"baseline", "diff", "diff_ci_low", "diff_ci_high", "p_value",
                                             "intervals_overlap", "per_difficulty"}
            base = configs[r["baseline"]]
            assert r["length_vs_baseline"] == pytest.approx(r["mean_length"] / base["mean_length"])
            assert r["mean_length"] == pytest.approx(r["n_tokens"] / r["n_prompts"])


def test_quick_study_json_has_every_field(quick_report):
    report, out, files = quick_report
    configs = json.loads((out / "drift.json").read_text())["configurations"]
    assert len(configs) == 3 + 2 * len(set(DriftConfig().verifiers) | set(LADDER))
    check_every_field(configs)
    assert configs["overshoot:lenience=0.5,min_p=0.1@tree"]["vs_secondary"]["baseline"] == "sampling[min_p:p_base=0.1]"
    assert set(configs["lossless@chain"]["per_difficulty"]) == {"1", "2"}
    for name in ("drift.md", "speed_vs_accuracy.png", "drift_by_position.png", "accuracy_gap_by_difficulty.png"):
        assert (out / name).stat().st_size > 0
    md = (out / "drift.md").read_text()
    assert "mars:theta=0.9@chain" in md and "| mean len (x baseline) |" in md
    row = next(line for line in md.splitlines() if line.startswith("| mars:theta=0.9@tree |"))
    r = configs["mars:theta=0.9@tree"]
    assert f"| {r['mean_length']:.1f} ({r['length_vs_baseline']:.2f}x) |" in row


def test_lossless_has_no_drift_and_baselines_are_exact(quick_report):
    c = quick_report[0]["configurations"]
    for key in ("lossless@chain", "lossless@tree", "plain"):
        assert c[key]["tv"]["p99"] < 1e-5 and abs(c[key]["kl"]["mean"]) < 1e-5, key
        assert c[key]["relaxed_frac"] == 0.0 and abs(c[key]["seq_log_ratio"]["mean"]) < 1e-4
        assert c[key]["seq_ess"] > 0.999
    trunc = c["sampling[min_p:p_base=0.1]"]
    assert trunc["uncovered"]["mean"] > 0 and trunc["entropy_P"] < trunc["entropy_p"]
    assert c["plain"]["tau"] == 1.0 and c["lossless@chain"]["tau"] > 1.1  # the near-copy head drafts


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_study_drift_grows_as_theta_and_lenience_fall(quick_report, mode):
    """On sampled trajectories (different contexts per rule, ~200 tokens each); the exact,
    same-context monotonicity is test_drift_is_zero_for_lossless_and_grows_as_rules_loosen."""
    c = quick_report[0]["configurations"]
    mars = [c[f"{s}@{mode}"]["tv"]["mean"] for s in LADDER[1:4]]
    over = [c[f"{s}@{mode}"]["tv"]["mean"] for s in LADDER[4:]]
    assert over[0] > 1e-3 and over == sorted(over), over
    assert c[f"overshoot:lenience=0.1@{mode}"]["relaxed_frac"] > c[f"overshoot:lenience=0.9@{mode}"]["relaxed_frac"]
    assert mars[0] < mars[2] and mars[1] < mars[2], mars
    # theta 0.97 against 0.9 is not resolved by ~400 sampled tokens: over generation seeds 0-5
    # their mean TV spans 0.0007-0.0053 and 0.0041-0.0101 (chain), so their order is left to the
    # same-context test; theta 0.5 drifts clearly more (0.014-0.029)
    if mode == "chain":  # MARS in a tree moves P by point masses: its mean TV is noisier
        assert mars[2] > 1.5 * max(mars[:2]), mars


# ----------------------------------------------------------------------------- CLI and --from-run
def test_cli_quick_on_a_saved_tiny_model(tiny_policy_dir, tiny_head_dir, tmp_path):
    from scripts.drift import main

    out = tmp_path / "quick"
    rc = main(["--quick", "--target", str(tiny_policy_dir), "--head", str(tiny_head_dir), "--out", str(out),
               "--max-new-tokens", "8", "--threads", "1", "--no-progress", "--modes", "chain",
               "--verifiers", "lossless;mars:theta=0.5;min_p:p_base=0.1"])
    assert rc == 0
    configs = json.loads((out / "drift.json").read_text())["configurations"]
    assert set(configs) == {"plain", "sampling[min_p:p_base=0.1]", "lossless@chain", "mars:theta=0.5@chain",
                            "min_p:p_base=0.1@chain"}
    check_every_field(configs)
    assert main(["--quick", "--modes", "beam"]) == 2


def test_cli_takes_out_dir_as_scripts_train_does():
    from scripts.drift import parse_args

    assert parse_args(["--out-dir", "x"]).out == parse_args(["--out", "x"]).out == "x"


# ----------------------------------------------------------------------------- embedded model
@pytest.mark.slow
def test_lossless_accuracy_matches_plain_sampling_on_the_embedded_model(tmp_path):
    """Lossless speculation samples from p: its accuracy lies within the plain baseline's interval."""
    from rollout.eagle3 import default_head_path
    from trainers.drift.run import load_models

    head = "default" if default_head_path().exists() else "random"
    cfg = DriftConfig(difficulties=(1,), prompts=48, verifiers=("lossless",), max_new_tokens=64, batch_size=16,
                      head=head, num_threads=1, out=str(tmp_path))
    target, head_model, tok = load_models(cfg)
    report = build_report(run_all(cfg, target, head_model, tok, progress=False), {})
    c = report["configurations"]
    assert c["lossless@chain"]["tv"]["p99"] < 1e-5
    gap = c["lossless@chain"]["vs_baseline"]
    assert gap["intervals_overlap"] and gap["p_value"] > 0.01, gap


def test_each_batch_runs_with_its_own_seed_and_keeps_each_completions_summed_log_ratio(monkeypatch):
    """``run_batch``: batch i is generated with seed ``cfg.seed + i``; each completion's sequence log
    ratio is the sum over its tokens of log p - log P (the engine's log-probs; the per-token drift
    is stubbed out, it is ``token_drift``'s test)."""
    from types import SimpleNamespace

    import trainers.drift.run as run_module
    from trainers.drift.run import PromptItem, RunData, TIMING_KEYS, run_batch
    from trainers.drift.study import RunSpec

    comps = [SimpleNamespace(num_tokens=3, completion_ids=[5, 6, 7], behaviour_logprobs=[-1.0, -2.0, -0.5],
                             target_logprobs=[-1.5, -1.0, -0.5], relaxed=[False] * 3),
             SimpleNamespace(num_tokens=1, completion_ids=[8], behaviour_logprobs=[-0.25], target_logprobs=[-0.5],
                             relaxed=[True])]
    debug = [SimpleNamespace(row=r, index=i) for r, c in enumerate(comps) for i in range(c.num_tokens)]
    seeds = []

    class Engine:
        def generate(self, prompts, sampling, spec, verifier, seed, debug):
            seeds.append(seed)
            return SimpleNamespace(completions=comps, debug=debug_records,
                                   timings=SimpleNamespace(**{k: 1.0 for k in TIMING_KEYS}))

    debug_records = debug
    monkeypatch.setattr(run_module, "token_drift", lambda rule, records, sampling: {
        k: torch.zeros(len(records), dtype=torch.float64) for k in ("tv", "kl", "logP")})
    cfg = DriftConfig(seed=11)
    data = RunData(RunSpec("lossless@chain", "verifier", "chain", parse_verifier("lossless")))
    items = [PromptItem([1, 2], None, 0), PromptItem([3], None, 0)]
    tokenizer = SimpleNamespace(eos_token_id=2, decode=lambda ids, skip_special_tokens=True: "")
    for index in (0, 3):
        run_batch(Engine(), data, items, index, cfg, tokenizer)
    assert seeds == [11, 14]
    assert data.seq_log_ratio == pytest.approx([sum(c.target_logprobs) - sum(c.behaviour_logprobs) for c in comps] * 2)
    assert data.lengths == [3, 1, 3, 1]


def test_the_prompt_set_has_the_configured_size_split_evenly_over_the_difficulties():
    """``build_prompts``: ``cfg.prompts`` task prompts, the remainder of an uneven split going to the
    first difficulties (5 over levels 1, 2, 3: 2, 2, 1)."""
    from trainers.drift.run import build_prompts

    items = build_prompts(DriftConfig(prompts=5, difficulties=(1, 2, 3)), CharTokenizer())
    assert [it.difficulty for it in items] == [1, 1, 2, 2, 3]


def test_uncovered_mass_is_the_untruncated_targets_under_top_k_sampling():
    """With top-k sampling, a lossless rule's P is p restricted to the top k; ``uncovered`` is the
    mass the *untruncated* target (softmax at the temperature) puts where P is 0, not the truncated
    p's (which is 0 there by construction)."""
    records = _records(n=20, chain=False)
    s = SamplingParams(temperature=1.0, top_k=3)
    drift = token_drift(get_rule("lossless"), records, s)
    full = torch.softmax(torch.stack([r.target_logits for r in records]).double(), -1)
    outside = 1.0 - full.topk(3, -1).values.sum(-1)
    torch.testing.assert_close(drift["uncovered"], outside, rtol=1e-5, atol=1e-6)
    assert float(outside.min()) > 0.0 and float(outside.mean()) > 0.1
