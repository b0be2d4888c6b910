"""A run folder's files are loaded without running code from them: a pickle whose objects would
execute something, put where a checkpoint's state file goes, is refused before anything runs;
a truncated or corrupt file is an error naming it and what to do; a normal save and resume
(policy, AdamW moments, the online head's state) still round-trips (no Ray here)."""

from __future__ import annotations

import pickle
import shutil

import pytest
import torch

from tests.trainers.conftest import model_and_optimizer, write_config
from trainers.grpo.checkpoint import CheckpointError, load_checkpoint, load_state, read_policy, save_checkpoint


class _Payload:
    """Unpickling it would call ``open(marker, "w")``: creating the marker file is the proof
    that code from the file ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _write_payload(path, marker, how: str) -> None:
    """A state file whose every expected key is there, one of them holding the payload; ``how``:
    torch's zip format or its legacy one (a bare pickle stream after a header)."""
    state = {"state": {0: _Payload(marker)}, "param_groups": [], "head": _Payload(marker), "optimizer": {},
             "rounds": 1, "window": []}
    torch.save(state, path, _use_new_zipfile_serialization=how == "zip")


def _refusal(load, marker) -> CheckpointError:
    """The error ``load()`` raises, once checked that no code of the file ran."""
    try:
        load()
    except Exception as err:
        assert not marker.exists(), "code from the file ran"
        assert isinstance(err, CheckpointError), f"not refused with a CheckpointError: {err!r}"
        return err
    assert not marker.exists(), "code from the file ran"
    raise AssertionError("the file was accepted")


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


@pytest.mark.parametrize("how", ["zip", "legacy"])
def test_a_payload_in_place_of_the_optimizer_state_is_refused_and_never_runs(how, tmp_path):
    model, opt = model_and_optimizer()
    path = save_checkpoint(tmp_path, 1, model, opt, {"version": 1})
    marker = tmp_path / "marker"
    _write_payload(path / "optimizer.pt", marker, how)
    fresh, fresh_opt = model_and_optimizer(seed=1)
    err = _refusal(lambda: load_checkpoint(path, fresh, fresh_opt), marker)
    assert err.path == str(path / "optimizer.pt") and "refused: loading them could run code" in str(err)
    assert "--fresh" in str(err) and "weights_only" not in str(err)  # not torch's advice to load it unsafely


@pytest.mark.parametrize("name", ["optimizer.pt", "policy.safetensors", "state.json"])
def test_a_truncated_checkpoint_file_is_an_error_naming_it(name, tmp_path):
    model, opt = model_and_optimizer()
    path = save_checkpoint(tmp_path, 1, model, opt, {"version": 1})
    _truncate(path / name)
    fresh, fresh_opt = model_and_optimizer(seed=1)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path, fresh, fresh_opt)
    msg = str(err.value)
    assert err.value.path == str(path / name) and msg.startswith(f"{path / name}: ")
    assert "earlier checkpoint" in msg and "--fresh" in msg


@pytest.mark.parametrize("content", [b"", b"not a torch file", b"PK\x03\x04 torn"], ids=["empty", "foreign", "torn-zip"])
def test_load_state_names_a_corrupt_file(content, tmp_path):
    bad = tmp_path / "state.pt"
    bad.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"state\.pt: .*(truncated|corrupt)"):
        load_state(bad)
    with pytest.raises(CheckpointError, match=r"missing\.pt: is missing"):
        load_state(tmp_path / "missing.pt")


def test_a_file_of_the_wrong_kind_is_named(tmp_path):
    torch.save([1, 2], tmp_path / "a.pt")
    torch.save({"state": {}}, tmp_path / "b.pt")
    with pytest.raises(CheckpointError, match=r"a\.pt: holds a list"):
        load_state(tmp_path / "a.pt")
    with pytest.raises(CheckpointError, match=r"b\.pt: lacks 'param_groups'"):
        load_state(tmp_path / "b.pt", required=("state", "param_groups"))


def test_the_error_crosses_a_pickle_whole():
    err = CheckpointError("/x/optimizer.pt", "is truncated or corrupt (EOFError)")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is CheckpointError and str(back) == str(err) and back.path == "/x/optimizer.pt"


def test_read_policy_names_a_truncated_weights_file(tmp_path):
    model, opt = model_and_optimizer()
    path = save_checkpoint(tmp_path, 1, model, opt, {"version": 1})
    _truncate(path / "policy.safetensors")
    with pytest.raises(CheckpointError, match=r"policy\.safetensors: is missing, truncated or corrupt"):
        read_policy(path)


def test_adamw_state_round_trips_through_the_safe_loader(tmp_path):
    model, opt = model_and_optimizer()
    path = save_checkpoint(tmp_path, 1, model, opt, {"version": 1})
    raw = load_state(path / "optimizer.pt", required=("state", "param_groups"))
    assert raw["param_groups"][0]["betas"] == opt.param_groups[0]["betas"]
    fresh, fresh_opt = model_and_optimizer(seed=1)
    load_checkpoint(path, fresh, fresh_opt)
    for a, b in zip(opt.state_dict()["state"].values(), fresh_opt.state_dict()["state"].values()):
        assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
        assert torch.equal(a["step"], b["step"])
    for name, v in model.state_dict().items():
        assert torch.equal(v, fresh.state_dict()[name]), name


class _StubPool:
    def __init__(self, *args, **kwargs):
        pass

    def set_weights(self, state, version):
        pass

    def shutdown(self):
        pass


def _head_trainer(tmp_path, policy, head, out_dir):
    """A factory of GRPO trainers (the rollout pool a stub) whose head trains with the policy."""
    from trainers.grpo.config import load_train_config
    from trainers.grpo.loop import GRPOTrainer

    path = write_config(tmp_path / "c.yaml", policy, head, out_dir, run={"steps": 3},
                        rollout={"verifier": {"name": "lossless", "params": {}}},
                        drafter_training={"every": 1, "lr": 3e-3, "updates": 2, "batch_size": 2})
    return lambda: GRPOTrainer(load_train_config(path))


@pytest.fixture(scope="module")
def head_run(tiny_policy_dir, tiny_head_dir, tmp_path_factory):
    """A run whose head trained one round, checkpointed at step 1, and its trainer (built once)."""
    root = tmp_path_factory.mktemp("head_run")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("trainers.grpo.loop.RolloutPool", _StubPool)
        full = _head_trainer(root, tiny_policy_dir, tiny_head_dir, root / "run")()
        full.start()
        g = torch.Generator().manual_seed(0)
        seqs = [torch.randint(5, 400, (12 + i,), generator=g).tolist() for i in range(3)]
        full.drafter.train_round(0, seqs, [5, 6, 7])
        full.version = 1
        full.save(1)
        full.logger.close()
    return full, root / "run"


@pytest.fixture
def saved_head_run(head_run, tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    """A copy of ``head_run``'s folder for one test: the trainer that saved it, the checkpoint
    folder, and a factory of trainers resuming from it."""
    full, run = head_run
    shutil.copytree(run, tmp_path / "run")
    monkeypatch.setattr("trainers.grpo.loop.RolloutPool", _StubPool)
    make = _head_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, tmp_path / "run")
    return full, tmp_path / "run" / "checkpoints" / "step_000001", make


def test_the_head_state_round_trips_through_a_resume(saved_head_run):
    full, ckpt, make = saved_head_run
    resumed = make()
    resumed.start()
    resumed.logger.close()
    assert (resumed.start_step, resumed.version, resumed.drafter.rounds) == (1, 1, 1)
    for name, v in full.drafter.head.state_dict().items():
        assert torch.equal(v, resumed.drafter.head.state_dict()[name]), name
    a, b = full.drafter.optimizer.state_dict()["state"], resumed.drafter.optimizer.state_dict()["state"]
    assert a and a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k]["exp_avg_sq"], b[k]["exp_avg_sq"]), k
    assert [w.kinds for w in resumed.drafter.window] == [w.kinds for w in full.drafter.window]
    for w, v in zip(resumed.drafter.window, full.drafter.window):
        assert torch.equal(w.features, v.features) and torch.equal(w.tokens, v.tokens)


@pytest.mark.parametrize("how", ["zip", "legacy"])
def test_a_payload_in_place_of_the_head_state_is_refused_and_never_runs(how, saved_head_run):
    _, ckpt, make = saved_head_run
    marker = ckpt.parent / "marker"
    _write_payload(ckpt / "drafter_training.pt", marker, how)
    err = _refusal(lambda: make().start(), marker)
    assert err.path == str(ckpt / "drafter_training.pt") and "refused: loading them could run code" in str(err)


def test_a_truncated_head_state_is_an_error_naming_it(saved_head_run):
    _, ckpt, make = saved_head_run
    _truncate(ckpt / "drafter_training.pt")
    with pytest.raises(CheckpointError) as err:
        make().start()
    assert err.value.path == str(ckpt / "drafter_training.pt")
    assert "truncated or corrupt" in str(err.value) and "--fresh" in str(err.value)
