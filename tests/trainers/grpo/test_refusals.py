"""Every bad training config is refused by ``scripts.train.main`` before Ray or a model
starts: exit code 2, one ``error: config field '<dotted path>': ...`` line, no traceback.

Each case edits the valid test config at one dotted path (or writes a bad file it
points to) and runs the CLI in-process; ``ray.is_initialized()`` stays False."""

from __future__ import annotations

import json
import shutil
import time

import pytest
import yaml

from rollout.models import embedded_gguf_path
from tests.trainers.conftest import write_config

_UNSET = object()


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def _run_cli(tmp_path, policy, head, edits: dict, capsys) -> tuple[int, str, float]:
    import ray

    from scripts.train import main

    path = write_config(tmp_path / "c.yaml", policy, head, tmp_path / "out")
    cfg = yaml.safe_load(path.read_text())
    for dotted, value in edits.items():
        _set(cfg, dotted, value)
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    rc = main(["--config", str(path)])
    took = time.perf_counter() - t0
    err = capsys.readouterr().err
    assert not ray.is_initialized()
    return rc, err, took


def _assert_refused(rc: int, err: str, took: float, field: str, *words: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith(f"error: config field '{field}': "), err
    for w in words:
        assert w in err, (w, err)
    assert took < 5.0, took


# one dotted edit each: (edits, refused field, words the message must contain)
CASES = {
    "section is a list": ({"rollout": [1, 2]}, "rollout", ["mapping", "list"]),
    "section is a string": ({"model.target": "/path"}, "model.target", ["mapping", "str"]),
    "section is null": ({"rollout.sampling": None}, "rollout.sampling", ["mapping", "null"]),
    "verifier given as a name": ({"rollout.verifier": "mars"}, "rollout.verifier", ["mapping"]),
    "rule parameter out of range": ({"rollout.verifier.params.theta": 1.5}, "rollout.verifier.params.theta",
                                    ["must be in [0, 1], got 1.5"]),
    "rule parameter unknown": ({"rollout.verifier.params.thta": 0.5}, "rollout.verifier.params.thta",
                               ["its parameters: theta"]),
    "greedy training": ({"rollout.sampling.temperature": 0}, "rollout.sampling.temperature", ["> 0"]),
    "lr inf": ({"optim.lr": float("inf")}, "optim.lr", ["finite"]),
    "lr nan": ({"optim.lr": float("nan")}, "optim.lr", ["finite"]),
    "weight_decay nan": ({"optim.weight_decay": float("nan")}, "optim.weight_decay", ["finite"]),
    "grad_clip nan": ({"optim.grad_clip": float("nan")}, "optim.grad_clip", ["finite"]),
    "betas nan": ({"optim.betas": [float("nan"), 0.9]}, "optim.betas", ["two numbers"]),
    "out_dir a number": ({"run.out_dir": 5}, "run.out_dir", ["string"]),
    "ray address a number": ({"ray.address": 5}, "ray.address", ["string"]),
    "steps a float": ({"run.steps": 2.5}, "run.steps", ["integer"]),
    "seed a string": ({"run.seed": "3"}, "run.seed", ["integer"]),
    "resume a string": ({"run.resume": "yes"}, "run.resume", ["true or false"]),
    "share_prompts a string": ({"optim.share_prompts": "no"}, "optim.share_prompts", ["true or false"]),
    "top_p a bool": ({"rollout.sampling.top_p": True}, "rollout.sampling.top_p", ["number"]),
    "temperature inf": ({"rollout.sampling.temperature": float("inf")}, "rollout.sampling.temperature", ["finite"]),
    "clip_low nan": ({"grpo.clip_low": float("nan")}, "grpo.clip_low", ["finite"]),
    "kl_coef inf": ({"grpo.kl_coef": float("inf")}, "grpo.kl_coef", ["finite"]),
    "cap inf": ({"correction.cap": float("inf")}, "correction.cap", ["finite"]),
    "gpus inf": ({"rollout.num_gpus_per_actor": float("inf")}, "rollout.num_gpus_per_actor", ["finite"]),
    "timeout zero": ({"rollout.actor_timeout_s": 0}, "rollout.actor_timeout_s", ["> 0"]),
    "aux layers out of range": ({"model.target.aux_layer_ids": [0, 1, 9]}, "model.target.aux_layer_ids",
                                ["out of range", "4-layer"]),
    "group of one": ({"grpo.group_size": 1}, "grpo.group_size", [">= 2", "advantage 0"]),
    # the backend's options, checked here rather than first in a Ray actor
    "hf option unknown": ({"rollout.backend_options": {"foo": 1}}, "rollout.backend_options",
                          ["unknown hf option(s) ['foo']", "allowed: linear, weights, drafter_weights"]),
    "hf weights unknown": ({"rollout.backend_options": {"weights": "int4"}}, "rollout.backend_options.weights",
                           ["'int4'", "allowed: exact, bfloat16"]),
    "hf drafter weights unknown": ({"rollout.backend_options": {"drafter_weights": "int2"}},
                                   "rollout.backend_options.drafter_weights", ["allowed: stored, int8"]),
    "more actor CPUs than the local Ray has": ({"rollout.num_actors": 2, "rollout.threads_per_actor": 2,
                                                "ray.num_cpus": 3}, "rollout.num_actors",
                                               ["ask the local Ray for 4 CPUs; it has 3", "for ever"]),
    "policy trained in bf16": ({"model.target.dtype": "bfloat16"}, "model.target.dtype",
                               ["no fp32 copy", "weights: bfloat16", "allowed: float32"]),
    "a bare YAML off": ({"rollout.spec.mode": False}, "rollout.spec.mode", ["boolean: quote it, e.g. 'off'"]),
    "vllm flag a string": ({"rollout.backend": "vllm", "rollout.backend_options": {"enforce_eager": "false"}},
                           "rollout.backend_options.enforce_eager", ["true or false", "'false'"]),
    "vllm seqs zero": ({"rollout.backend": "vllm", "rollout.backend_options": {"max_num_seqs": 0}},
                       "rollout.backend_options.max_num_seqs", ["positive integer"]),
    "vllm on a GGUF": ({"rollout.backend": "vllm", "model.target.path": str(embedded_gguf_path())}, "model.target.path",
                       ["not a GGUF file"]),
    "vllm option unknown": ({"rollout.backend": "vllm", "rollout.backend_options": {"weights": "bfloat16"}},
                            "rollout.backend_options", ["unknown vllm option(s) ['weights']", "kv_cache_memory_bytes"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_value_is_refused_before_ray(name, tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    edits, field, words = CASES[name]
    rc, err, took = _run_cli(tmp_path, tiny_policy_dir, tiny_head_dir, edits, capsys)
    _assert_refused(rc, err, took, field, *words)


def test_cuda_without_a_device_is_refused_before_ray(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    """The trainer runs in the driver: ``run.device: cuda`` on a machine without one is a config error
    before Ray starts (it was a traceback from the trainer, after Ray had started)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    rc, err, took = _run_cli(tmp_path, tiny_policy_dir, tiny_head_dir, {"run.device": "cuda"}, capsys)
    _assert_refused(rc, err, took, "run.device", "no CUDA device is visible", "allowed: auto, cpu")


def test_out_dir_that_is_a_file_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    (tmp_path / "afile").write_text("x")
    rc, err, took = _run_cli(tmp_path, tiny_policy_dir, tiny_head_dir, {"run.out_dir": str(tmp_path / "afile")}, capsys)
    _assert_refused(rc, err, took, "run.out_dir", "not a folder")


# ---------------------------------------------------------------------------- a drafter that does not fit
def _edited_head(tmp_path, head, **changes):
    out = tmp_path / "head"
    shutil.copytree(head, out)
    cfg = json.loads((out / "config.json").read_text())
    for key, value in changes.items():
        if value is _UNSET:
            cfg.pop(key, None)
        else:
            cfg[key] = value
    (out / "config.json").write_text(json.dumps(cfg))
    return out


@pytest.mark.parametrize("changes, words", [
    ({"hidden_size": 32}, ["hidden_size 32", "target hidden_size 64"]),
    ({"vocab_size": 1000}, ["vocab_size 1000", "target vocab_size"]),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 7]}, ["aux layers [1, 2, 7]", "4-layer"]),
])
def test_drafter_that_does_not_fit_is_refused(changes, words, tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    head = _edited_head(tmp_path, tiny_head_dir, **changes)
    rc, err, took = _run_cli(tmp_path, tiny_policy_dir, head, {}, capsys)
    _assert_refused(rc, err, took, "model.drafter", *words)


def test_drafter_without_weights_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    head = _edited_head(tmp_path, tiny_head_dir)
    (head / "model.safetensors").unlink()
    rc, err, took = _run_cli(tmp_path, tiny_policy_dir, head, {}, capsys)
    _assert_refused(rc, err, took, "model.drafter", "no weights")


def test_drafter_on_other_layers_than_the_target_captures(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    head = _edited_head(tmp_path, tiny_head_dir, eagle_aux_hidden_state_layer_ids=[0, 1, 3])
    rc, err, took = _run_cli(tmp_path, tiny_policy_dir, head, {}, capsys)
    _assert_refused(rc, err, took, "model.target.aux_layer_ids", "[0, 1, 3]")


# ---------------------------------------------------------------------------- JSONL task files
@pytest.mark.parametrize("text, words", [
    ('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "#### 4"\n', ["tasks.jsonl:2", "invalid JSON"]),
    ("", ["no records"]),
    ("\n  \n\n", ["no records"]),
    ('{"question": "1+1?", "answer": "two #### many"}\n', ["tasks.jsonl:1", "not a number"]),
    ('{"question": "1+1?"}\n', ["tasks.jsonl:1", "missing 'answer'"]),
    ('[1, 2]\n', ["tasks.jsonl:1", "JSON object"]),
])
def test_bad_task_file_is_refused(text, words, tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(text)
    rc, err, took = _run_cli(tmp_path, tiny_policy_dir, tiny_head_dir,
                             {"task.source": "jsonl", "task.path": str(tasks)}, capsys)
    _assert_refused(rc, err, took, "task.path", *words)


def test_good_task_file_and_config_pass_the_validator(tmp_path, tiny_policy_dir, tiny_head_dir):
    from trainers.grpo.config import load_train_config

    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"question": "1+1?", "answer": "so #### 2"}\n\n{"prompt": "3*3=", "answer": 9}\n')
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out",
                        task={"source": "jsonl", "path": str(tasks)})
    cfg = load_train_config(path)
    assert cfg.task.path == str(tasks)


def test_relative_out_dir_is_refused_inside_a_ray_job_copy(tmp_path, tiny_policy_dir, tiny_head_dir, capsys,
                                                           monkeypatch):
    """Under `ray job submit --working-dir` the job runs in .../runtime_resources/working_dir_files/...,
    which Ray deletes with the session: a relative out_dir would lose the run."""
    import ray

    from scripts.train import main

    copy = tmp_path / "session_x" / "runtime_resources" / "working_dir_files" / "_ray_pkg_1"
    copy.mkdir(parents=True)
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "out")
    monkeypatch.chdir(copy)
    assert main(["--config", str(path), "--out-dir", "runs/x"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: config field 'run.out_dir': 'runs/x' is relative") and "absolute" in err, err
    assert not ray.is_initialized() and not (copy / "runs").exists()


def test_gpus_the_local_ray_lacks_are_refused_before_ray(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible here")
    rc, err, took = _run_cli(tmp_path, tiny_policy_dir, tiny_head_dir, {"rollout.num_gpus_per_actor": 1}, capsys)
    _assert_refused(rc, err, took, "rollout.num_gpus_per_actor", "need 1; this machine's local Ray has 0")


def test_a_home_relative_out_dir_is_the_home_folder(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    """``out_dir: ~/runs/x`` writes under the home folder (not a folder named "~" in the working
    directory, which the Ray-job guard would have taken for an absolute path)."""
    from trainers.grpo.config import load_train_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, tiny_head_dir, "~/runs/x")
    assert load_train_config(path).run.out_dir == str(tmp_path / "home" / "runs" / "x")


def test_a_task_file_smaller_than_a_step_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    """Each step samples task.prompts_per_step distinct prompts: a file with fewer records would
    give every step fewer prompts without a word."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"question": "1+1?", "answer": "#### 2"}\n{"question": "2+2?", "answer": "#### 4"}\n')
    rc, err, took = _run_cli(tmp_path, tiny_policy_dir, tiny_head_dir, {"task.source": "jsonl", "task.path": str(tasks),
                                                                         "task.prompts_per_step": 3}, capsys)
    _assert_refused(rc, err, took, "task.prompts_per_step", "3 distinct prompts a step", "holds 2 records")
