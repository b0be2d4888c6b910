"""Errors about a head shipped to the actors name the user's folder, not an actor's temporary
copy of it (removed by then): a folder that cannot be a head is refused on the driver before it
is shipped (``check_head_folder``, at pool start and in ``load_drafter``), and a head the actor's
backend refuses (another target) is reported with the folder it was read from."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from test_actor_pool_faults import fake_pool, write_head

from rollout.backend import WorkerSpec
from rollout.config import ConfigError
from rollout.eagle3 import HeadMismatchError, default_head_path
from rollout.models import TargetConfig
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from rollout.ray.actor import RolloutWorker, check_head_folder, read_head_files
from rollout.ray.actor_pool import RolloutPool
from rollout.vllm.head import check_head

HEAD = default_head_path()


def _no_config(f: Path) -> None:
    (f / "config.json").unlink()


def _config(text: str):
    return lambda f: (f / "config.json").write_text(text)


def _weights(tensors: dict | None = None, raw: bytes | None = None):
    def change(f: Path) -> None:
        if raw is not None:
            (f / "model.safetensors").write_bytes(raw)
        elif tensors is None:
            (f / "model.safetensors").unlink()
        else:
            save_file(tensors, str(f / "model.safetensors"))
    return change


BROKEN = {
    "no config": (_no_config, "no config.json"),
    "config not JSON": (_config("{"), "does not read as JSON"),
    "config not a mapping": (_config("[]"), "not a mapping"),
    "config without layer fields": (_config('{"vocab_size": 32}'), "no hidden_size, intermediate_size"),
    "no weights": (_weights(), "no weights in"),
    "weights not safetensors": (_weights(raw=b"not a safetensors file"), "model.safetensors does not read"),
    "not an EAGLE-3 head": (_weights({"lm_head.weight": torch.zeros(2, 2)}), "no fc.weight"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_load_drafter_refuses_a_folder_that_is_no_head_naming_it_before_shipping(case, tmp_path):
    change, match = BROKEN[case]
    pool = fake_pool(2, {})
    good = write_head(tmp_path / "good")
    pool.load_drafter(str(good))
    bad = write_head(tmp_path / "bad")
    change(bad)
    with pytest.raises((FileNotFoundError, ValueError), match=re.escape(str(bad))) as err:
        pool.load_drafter(str(bad))
    assert err.match(match)
    assert [a.calls.get("load_drafter_files") for a in pool.actors] == [1, 1]  # nothing shipped
    assert pool._drafter_ref == read_head_files(good) and pool._drafter_origin == str(good)
    with pytest.raises(FileNotFoundError, match=re.escape(f"no EAGLE-3 head folder at {tmp_path / 'gone'}")):
        pool.load_drafter(str(tmp_path / "gone"))


def test_the_pool_refuses_a_spec_head_that_is_no_head_before_ray_starts(tmp_path, monkeypatch):
    import ray

    monkeypatch.setattr(ray, "put", lambda value: pytest.fail("the head was shipped"))
    bad = write_head(tmp_path / "bad")
    (bad / "model.safetensors").unlink()
    spec = WorkerSpec(target=TargetConfig(), drafter_path=str(bad), sampling=SamplingParams(),
                      spec=SpecConfig(mode="chain"), verifier=VerifierConfig())
    with pytest.raises(FileNotFoundError, match=re.escape(f"no weights in {bad}")):
        RolloutPool(spec, 1)


def test_heads_in_both_formats_pass_the_driver_checks(tmp_path):
    check_head_folder(HEAD)
    layer = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "vocab_size": 32}
    spec_format = write_head(tmp_path / "speculators")
    (spec_format / "config.json").write_text(json.dumps({"speculators_model_type": "eagle3",
                                                         "transformer_layer_config": layer}))
    check_head_folder(spec_format)
    bin_format = write_head(tmp_path / "bin")
    (bin_format / "model.safetensors").unlink()
    torch.save({"fc.weight": torch.zeros(8, 24)}, bin_format / "pytorch_model.bin")
    check_head_folder(bin_format)


def test_a_head_for_another_target_is_named_by_the_folder_it_was_shipped_from(tiny_policy_dir, own_tmp):
    """The shipped head (hidden size 576) on the tiny policy (64): ``load_eagle3`` refuses it,
    naming the folder it loads, the actor's own copy; the error names the origin instead."""
    spec = WorkerSpec(target=TargetConfig(path=str(tiny_policy_dir)), drafter_path=None, sampling=SamplingParams(),
                      spec=SpecConfig(mode="chain", num_draft_tokens=2), verifier=VerifierConfig(), threads=1)
    files = read_head_files(HEAD)
    with pytest.raises(HeadMismatchError, match=re.escape(f"{HEAD}: hidden size mismatch")) as err:
        RolloutWorker(dataclasses.replace(spec, drafter_path="/not/on/this/node"), files, str(HEAD))
    assert "honest-rollouts-head-" not in str(err.value)
    worker = RolloutWorker(spec)
    with pytest.raises(HeadMismatchError, match=re.escape(f"{HEAD}: hidden size mismatch")) as err:
        worker.load_drafter_files(files, str(HEAD))
    assert "honest-rollouts-head-" not in str(err.value)
    assert list(own_tmp.iterdir()) == []  # the actor's copies are removed


def test_an_error_that_names_no_folder_gets_a_note_naming_the_origin(tmp_path, own_tmp):
    """vLLM's check says "head for another target: ..." without a folder: a note names it."""

    class Backend:
        def load_drafter(self, folder):
            check_head(folder, {"vocab_size": 32000, "hidden_size": 576, "num_hidden_layers": 30})

    worker = RolloutWorker.__new__(RolloutWorker)
    worker.backend = Backend()
    origin = shutil.copytree(HEAD, tmp_path / "runs" / "drafter")
    with pytest.raises(ConfigError, match="head for another target") as err:
        worker.load_drafter_files(read_head_files(origin), str(origin))
    assert err.value.__notes__ == [f"(loading the EAGLE-3 head shipped from {origin})"]
    assert list(own_tmp.iterdir()) == []
