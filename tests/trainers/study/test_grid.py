"""The study's config and grid: settings x seeds in seed order, each run's GRPO config, the paired
problem streams, the comparisons, and refusals that name the field (no Ray, no model)."""

from __future__ import annotations

import pytest
import yaml

from rollout.config import ConfigError
from tests.trainers.study.conftest import write_study
from trainers.grpo.loop import ProblemSource
from trainers.study.config import DEFAULT_SETTINGS, load_study_config
from trainers.study.grid import Comparison, comparisons, plan_runs


def _default_grid(tmp_path, tiny_policy_dir, tiny_head_dir, seeds=(0, 1)):
    path = tmp_path / "s.yaml"
    write_study(path, tiny_policy_dir, tiny_head_dir, tmp_path / "study", study={"seeds": list(seeds)})
    data = yaml.safe_load(path.read_text())
    del data["settings"]  # the default grid
    path.write_text(yaml.safe_dump(data))
    return load_study_config(path)


def test_default_grid_expands_settings_by_seeds(tmp_path, tiny_policy_dir, tiny_head_dir):
    cfg = _default_grid(tmp_path, tiny_policy_dir, tiny_head_dir)
    plans = plan_runs(cfg)
    names = list(DEFAULT_SETTINGS)
    assert names == ["lossless", "mars_none", "mars_tis", "mars_geo", "overshoot_none", "overshoot_tis",
                     "overshoot_geo", "typical_none", "typical_tis", "typical_sampling"]
    assert len(plans) == 20
    assert [(p.setting, p.seed) for p in plans] == [(n, s) for s in (0, 1) for n in names]  # seed by seed
    assert [p.index for p in plans] == list(range(1, 21)) and {p.total for p in plans} == {20}
    assert plans[13].label == "mars_geo seed 1" and plans[13].index == 14
    for p in plans:
        c = p.config
        assert p.out_dir == tmp_path / "study" / "runs" / p.setting / f"seed{p.seed}"
        assert c.run.seed == p.seed and c.run.steps == 2
        s = DEFAULT_SETTINGS[p.setting]
        assert c.rollout.verifier == s.verifier and c.correction == s.correction
        assert c.rollout.truncation_sampling == (p.setting == "typical_sampling")
        assert c.rollout.spec.mode == ("off" if p.setting == "typical_sampling" else "chain")
    by = {(p.setting, p.seed): p.config for p in plans}
    assert by["mars_tis", 0].rollout.verifier.params == {"theta": 0.9} and by["mars_tis", 0].rollout.verifier.test == "law"
    assert by["mars_tis", 0].correction.mode == "token_tis" and by["mars_geo", 1].correction.mode == "geo_mis"
    assert by["overshoot_none", 0].rollout.verifier.params == {"lenience": 0.5}
    assert by["typical_sampling", 0].rollout.behaviour_verifier.rule().name == "sampling[typical]"


def test_runs_of_one_seed_share_their_training_problems(tmp_path, tiny_policy_dir, tiny_head_dir):
    plans = plan_runs(_default_grid(tmp_path, tiny_policy_dir, tiny_head_dir))
    streams = {(p.setting, p.seed): [[q.id for q in ProblemSource(p.config).for_step(k)] for k in range(3)]
               for p in plans}
    for seed in (0, 1):
        mine = {v.__repr__() for (n, s), v in streams.items() if s == seed}
        assert len(mine) == 1, f"seed {seed}: settings see different problems"
    assert streams["lossless", 0] != streams["lossless", 1]


def test_comparisons_of_the_default_grid(tmp_path, tiny_policy_dir, tiny_head_dir):
    got = comparisons(_default_grid(tmp_path, tiny_policy_dir, tiny_head_dir, seeds=(0,)))
    ref = [c.setting for c in got if c.kind == "reference"]
    assert ref == [n for n in DEFAULT_SETTINGS if n != "lossless"] and {c.other for c in got if c.kind == "reference"} == {"lossless"}
    assert [c for c in got if c.kind != "reference"] == [
        Comparison("mars_tis", "mars_none", "uncorrected"), Comparison("mars_geo", "mars_none", "uncorrected"),
        Comparison("overshoot_tis", "overshoot_none", "uncorrected"),
        Comparison("overshoot_geo", "overshoot_none", "uncorrected"),
        Comparison("typical_none", "typical_sampling", "baseline"),
        Comparison("typical_tis", "typical_none", "uncorrected"),
        Comparison("typical_tis", "typical_sampling", "baseline")]


def test_overrides_select_settings_seeds_steps(tmp_path, tiny_policy_dir, tiny_head_dir):
    path = write_study(tmp_path / "s.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "study")
    cfg = load_study_config(path, settings=["lossless"], seeds=[4, 7], steps=5, out_dir=str(tmp_path / "o"),
                            eval_problems=3)
    plans = plan_runs(cfg)
    assert [(p.setting, p.seed, p.config.run.steps) for p in plans] == [("lossless", 4, 5), ("lossless", 7, 5)]
    assert plans[0].out_dir == tmp_path / "o" / "runs" / "lossless" / "seed4"
    assert cfg.eval.problems_per_difficulty == 3
    with pytest.raises(ConfigError, match="must include the reference setting 'lossless'"):
        load_study_config(path, settings=["overshoot_tis"])
    with pytest.raises(ConfigError) as err:
        load_study_config(path, settings=["lossless", "nope"])
    assert err.value.field == "settings" and "allowed: lossless, overshoot_tis" in str(err.value)


@pytest.mark.parametrize("section, values, field", [
    ("study", {"seeds": [0, 0]}, "study.seeds"),
    ("study", {"reference": "nothing"}, "study.reference"),
    ("study", {"parallel": 0}, "study.parallel"),
    ("study", {"sedes": [1]}, "study.sedes"),
    ("eval", {"temperatures": [0.0, -1.0]}, "eval.temperatures"),
    ("eval", {"difficulties": [1, 9]}, "eval.difficulties"),
    ("train", {"run": {"seed": 3}}, "train.run.seed"),
    ("train", {"task": {"source": "jsonl"}}, "train.task.source"),
])
def test_bad_study_fields_are_named(tmp_path, tiny_policy_dir, tiny_head_dir, section, values, field):
    path = write_study(tmp_path / "s.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "study", **{section: values})
    with pytest.raises(ConfigError) as err:
        plan_runs(load_study_config(path))
    assert err.value.field == field, str(err.value)


@pytest.mark.parametrize("setting, field", [
    ({"verifier": {"name": "mars"}, "correction": {"mode": "sometimes"}}, "settings.bad.correction.mode"),
    ({"verifier": {"name": "mystery"}}, "settings.bad.verifier.name"),
    ({"verifier": {"name": "mars"}, "truncation_sampling": True}, "settings.bad -> train.rollout.verifier.name"),
    ({"verifier": {"name": "lossless"}, "overrides": {"rollout": {"spec": {"mode": "forest"}}}},
     "settings.bad -> train.rollout.spec.mode"),
    ({"verifier": {"name": "lossless"}, "overrides": {"ray": {"num_cpus": 4}}}, "settings.bad.overrides.ray"),
])
def test_bad_settings_are_named_with_the_setting(tmp_path, tiny_policy_dir, tiny_head_dir, setting, field):
    settings = {"lossless": {"verifier": {"name": "lossless"}}, "bad": setting}
    path = write_study(tmp_path / "s.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "study", settings=settings)
    with pytest.raises(ConfigError) as err:
        plan_runs(load_study_config(path))
    assert err.value.field == field, str(err.value)


def test_cli_refuses_a_bad_config_in_one_line_before_ray(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    import ray

    from scripts.study import main

    path = write_study(tmp_path / "s.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "study",
                       eval={"temperatures": "hot"})
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config field 'eval.temperatures'") and err.count("\n") == 1
    assert not ray.is_initialized()


def test_shipped_presets_validate():
    from pathlib import Path

    configs = Path(__file__).parents[3] / "configs"
    quick = load_study_config(configs / "study_quick.yaml")
    plans = plan_runs(quick)
    assert quick.settings == DEFAULT_SETTINGS and len(plans) == 20 and quick.study.parallel == 1
    assert {p.config.rollout.backend for p in plans} == {"hf"} and plans[0].config.run.device == "cpu"
    gpu = load_study_config(configs / "study.yaml")
    plans = plan_runs(gpu)
    assert len(plans) == 10 * len(gpu.study.seeds) and gpu.study.parallel > 1 and gpu.study.gpus_per_run >= 1
    # the default grid spelled out, but for the baseline on our engine (vLLM samples plain tokens from p)
    assert {n: s for n, s in gpu.settings.items() if n != "typical_sampling"} == {
        n: s for n, s in DEFAULT_SETTINGS.items() if n != "typical_sampling"}
    for p in plans:
        assert p.config.run.device == "cuda"
        assert p.config.rollout.backend == ("hf" if p.setting == "typical_sampling" else "vllm")
    base = [p for p in plans if p.setting == "typical_sampling"][0].config.rollout
    assert base.backend_options == {} and base.truncation_sampling and base.num_gpus_per_actor == 1
