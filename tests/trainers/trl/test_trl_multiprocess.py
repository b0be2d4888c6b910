"""The TRL plug-in under ``accelerate launch --multi_gpu --num_processes 2`` on the CPU
(torch.distributed with gloo): a 3-step run of ``scripts.train_trl``'s path on the tiny policy, lossless chain drafts,
one prompt x 8 generations a step, so TRL gives each process 4 completions of the same prompt.
From what each process records (``trl_multiprocess_run.py``): both generate, each for its own
share, with exact behaviour log-probs; both generate with the same weights, which the
optimizer steps move; their completions of the same prompt differ (per-process seeds); the
logged ``speculative/*`` and ``generation/*`` metrics are the means over the processes; and
only the main process writes the run's files."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("trl")

HELPER = Path(__file__).with_name("trl_multiprocess_run.py")
STEPS = 3


@pytest.fixture(scope="module")
def launched(tmp_path_factory, tiny_policy_dir, tiny_head_dir):
    """The run's folder and each process's record, from one ``accelerate launch`` of 2 processes."""
    tmp = tmp_path_factory.mktemp("trl_multiprocess")
    out, probe = tmp / "out", tmp / "probe"
    probe.mkdir()
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "reward_mean": 9.0}\n')  # an earlier run's
    cfg = {
        "run": {"out_dir": str(out), "steps": STEPS, "seed": 0},
        "model": {"target": {"path": str(tiny_policy_dir)}, "drafter": str(tiny_head_dir)},
        "rollout": {"spec": {"mode": "chain", "num_draft_tokens": 3}, "verifier": {"name": "lossless"}},
        "task": {"source": "arithmetic", "difficulty": 1, "prompts_per_step": 1},
        "correction": {"mode": "token_tis", "cap": 2.0},
        # weight decay moves the weights every step even where a group's rewards tie (zero advantages)
        "trl": {"num_generations": 8, "max_completion_length": 8, "temperature": 1.0, "learning_rate": 1e-3,
                "weight_decay": 0.1, "logging_steps": 1, "save_strategy": "steps", "save_steps": 2,
                "report_to": []},
    }
    config = tmp / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    # accelerate's torchrun launcher (--multi_gpu); the run config puts TRL on the CPU (no CUDA here), so the
    # processes join with gloo. (accelerate's --cpu starts one process unless given an MPI hostfile.)
    proc = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
                           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                           str(HELPER), str(config), str(probe)],
                          capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[3])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    records = [json.loads((probe / f"process{r}.json").read_text()) for r in range(2)]
    return out, records, proc.stdout


def _steps(record: dict) -> dict[int, dict]:
    return {g["step"]: g for g in record["records"]}


def test_each_process_generates_its_share_with_exact_behaviour_logprobs(launched):
    _, records, _ = launched
    assert [r["process_index"] for r in records] == [0, 1] and all(r["num_processes"] == 2 for r in records)
    for record in records:
        assert sorted(_steps(record)) == list(range(STEPS))  # one generation before each step
        for gen in record["records"]:
            assert len(gen["completion_ids"]) == 4  # 8 completions a step, split over 2 processes
            assert len({tuple(p) for p in gen["prompt_ids"]}) == 1  # the step's one prompt
            assert gen["logprob_max_difference"] == 0.0  # TRL divides by our behaviour log-probs
            assert gen["ratio_max_deviation"] < 2e-3  # ... which its own forward confirms (lossless)
            assert gen["tau"] > 1.0  # the drafts were used
    # TRL gave both processes the same prompt each step: a group split over them
    for a, b in zip(records[0]["records"], records[1]["records"]):
        assert a["prompt_ids"] == b["prompt_ids"]


def test_processes_generate_with_the_same_weights_which_the_steps_move(launched):
    _, records, _ = launched
    first, second = (_steps(r) for r in records)
    digests = []
    for step in range(STEPS):
        a, b = first[step], second[step]
        assert a["digests"] == b["digests"] == [a["digest"], b["digest"]]
        assert a["digest"] == b["digest"], f"step {step}: the processes generated with different weights"
        digests.append(a["digest"])
    assert len(set(digests)) == STEPS, "an optimizer step did not reach the rollouts' weights"


def test_processes_sample_their_own_completions(launched):
    _, records, _ = launched
    for a, b in zip(records[0]["records"], records[1]["records"]):
        assert a["seed"] != b["seed"]
        assert a["completion_ids"] != b["completion_ids"], f"step {a['step']}: both sampled the same completions"
    # the plug-in gives each of the 2 processes its share of the cores
    from rollout.engine.engine import available_cores

    assert [r["torch_threads"] for r in records] == [max(1, available_cores() // 2)] * 2


def test_logged_rollout_metrics_are_means_over_the_processes(launched):
    _, records, _ = launched
    logs = [[h for h in r["log_history"] if "loss" in h] for r in records]
    assert len(logs[0]) == len(logs[1]) == STEPS
    for a, b in zip(*logs):
        for key in [k for k in a if k.startswith(("speculative/", "generation/"))]:
            assert a[key] == pytest.approx(b[key], rel=1e-9), key  # every process logs the same mean
        assert {"speculative/tau", "speculative/is_ess", "generation/tokens_per_s"} <= set(a)
    first, second = (_steps(r) for r in records)
    for i, row in enumerate(logs[0]):  # step i + 1 trained on generation i
        for key in ("tau", "relaxed_fraction"):
            mean = (first[i][key] + second[i][key]) / 2
            assert row[f"speculative/{key}"] == pytest.approx(mean, rel=1e-6), (i, key)
    assert any(first[i]["tau"] != second[i]["tau"] for i in range(STEPS))  # so a process's own would differ


def test_only_the_main_process_writes_the_run_files(launched):
    out, records, stdout = launched
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # each step once: one writer
    logs = [h for h in records[0]["log_history"] if "loss" in h]
    assert [r["tau"] for r in rows] == pytest.approx([h["speculative/tau"] for h in logs])
    assert (out / "summary.md").is_file()
    moved = list((out / "superseded").glob("*/metrics.jsonl"))  # the earlier run's, moved aside once
    assert len(moved) == 1 and '"reward_mean": 9.0' in moved[0].read_text()
    assert json.loads((out / "checkpoint-2" / "speculative_rollouts.json").read_text()) == {"generations": 2}
    assert stdout.count(f"step {STEPS}/{STEPS}") == 1  # the progress lines come from one process


# ---------------------------------------------------------------------------- in one process
def _run_config(tmp_path, policy, head, **sections):
    from trainers.trl.config import load_trl_config

    cfg = {"run": {"out_dir": str(tmp_path / "out"), "steps": 1},
           "model": {"target": {"path": str(policy)}, "drafter": str(head)},
           "task": {"source": "arithmetic", "prompts_per_step": 1},
           "trl": {"num_generations": 8, "max_completion_length": 8, "report_to": []}}
    for name, values in sections.items():
        cfg[name] = {**cfg.get(name, {}), **values}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return lambda: load_trl_config(path)


def test_the_step_is_split_over_the_launched_processes(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    from rollout.config import ConfigError

    load = _run_config(tmp_path, tiny_policy_dir, tiny_head_dir)
    cfg = load()
    assert cfg.grpo_arguments()["per_device_train_batch_size"] == 8
    monkeypatch.setenv("WORLD_SIZE", "2")  # as accelerate launch sets it
    assert cfg.grpo_arguments()["per_device_train_batch_size"] == 4
    load = _run_config(tmp_path, tiny_policy_dir, tiny_head_dir, trl={"num_generations": 3})
    with pytest.raises(ConfigError, match="'task.prompts_per_step'.*3 completions per step do not split evenly"):
        load()
    load = _run_config(tmp_path, tiny_policy_dir, tiny_head_dir, rollout={"drafter_training": {"every": 1}})
    with pytest.raises(ConfigError, match="'rollout.drafter_training.every'"):
        load()


def test_each_process_draws_its_own_random_stream():
    """torch's CPU generator keeps the low 32 bits of a seed: the processes' seeds differ there."""
    import torch

    from trainers.trl import RolloutSettings, SpeculativeRollouts

    draws = []
    for rank in range(3):
        rollouts = SpeculativeRollouts(RolloutSettings(seed=5))
        rollouts.process_index = rank
        draws.append(torch.rand(4, generator=torch.Generator().manual_seed(rollouts.call_seed(7))).tolist())
    assert draws[0] != draws[1] and draws[0] != draws[2] and draws[1] != draws[2]
    assert SpeculativeRollouts(RolloutSettings(seed=5)).call_seed(7) == 5 * 1_000_003 + 7  # one process: as before


def test_local_threads_share_the_cores(monkeypatch):
    from rollout.engine.engine import available_cores
    from trainers.trl.rollouts import local_threads

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert local_threads() is None  # the engine's own default: every core
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert local_threads() == max(1, available_cores() // 2)
