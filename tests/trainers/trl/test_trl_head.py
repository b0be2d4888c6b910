"""The TRL plug-in's EAGLE-3 head and checkpoints, with a real TRL GRPOTrainer on the tiny random
policy (CPU): the head re-loaded or trained between steps, an evaluation not trained on, the
head's state and the generation seeds kept in checkpoints (written whole, before TRL's) and
restored on resume."""

from __future__ import annotations

import os

import pytest
import torch

from rollout.config import ConfigError
from rollout.params import SpecConfig
from tests.trainers.trl.trl_fixtures import make_trainer
from trainers.grpo.online_drafter import OnlineDrafterConfig

trl = pytest.importorskip("trl")


def test_draft_head_is_reloaded_between_steps(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    from rollout.engine.backend import HFBackend

    loads = []
    original = HFBackend.load_drafter
    monkeypatch.setattr(HFBackend, "load_drafter", lambda self, path: (loads.append(path), original(self, path)))
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=3, reload_every=1)
    assert len(loads) == 1  # built with the head
    first = trainer.rollouts.backend.head
    trainer.train()
    assert loads == [str(tiny_head_dir)] * 3  # re-read before the generations of steps 2 and 3
    assert trainer.rollouts.backend.head is not first


def test_draft_head_trains_with_the_policy_and_resumes(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    from rollout.engine.backend import HFBackend
    from rollout.eagle3 import load_eagle3

    loads = []
    original = HFBackend.load_drafter
    monkeypatch.setattr(HFBackend, "load_drafter", lambda self, path: (loads.append(path), original(self, path)))
    online = {"every": 1, "lr": 3e-3, "updates": 2, "batch_size": 4}
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=3, drafter_training=online,
                       save_strategy="steps", save_steps=2)
    initial = {k: v.clone() for k, v in trainer.rollouts.backend.head.state_dict().items()}
    trainer.train()
    export = str(tmp_path / "out" / "drafter")
    # trained after steps 1 and 2 (the latter before checkpoint-2 is written) and after step 3, before
    # the final checkpoint: each checkpoint holds the head the next generation drafts with
    assert loads == [str(tiny_head_dir), export, export, export]
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    held = trainer.rollouts.backend.head.state_dict()
    shipped = load_eagle3(export, trainer.rollouts.drafter.target).state_dict()
    assert any(not torch.equal(v, initial[k]) for k, v in held.items())
    for name, v in held.items():  # the backend drafts with the head trained here
        assert torch.equal(v, shipped[name]), name
    logged = [h for h in trainer.state.log_history if "speculative/drafter_est_tau" in h]
    assert len(logged) == 3 and all(h["speculative/drafter_est_tau"] >= 1 for h in logged), trainer.state.log_history
    assert "train_runtime" in logged[-1]  # the last round (at the final checkpoint) in TRL's final log
    saved = torch.load(tmp_path / "out" / "checkpoint-2" / "drafter_training.pt", weights_only=True)
    assert saved["trained_step"] == 2 and saved["rounds"] == 2
    trainer.rollouts.close()
    resumed = make_trainer(tmp_path / "r", tiny_policy_dir, tiny_head_dir, steps=2, drafter_training=online)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))  # nothing left to train
    assert resumed.rollouts.trained_step == 2 and resumed.rollouts.drafter.rounds == 2
    for name, v in resumed.rollouts.drafter.head.state_dict().items():
        assert torch.equal(v, saved["head"][name]), name
    assert loads[-1] == str(tmp_path / "r" / "out" / "drafter")  # the restored head is the one drafting


def test_an_evaluation_is_not_the_heads_training_batch(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    """With num_iterations 2 one generation serves steps 1 and 2, and the evaluation after step 1
    generates in between: the round after step 2 still trains on the training generation."""
    from trainers.grpo.online_drafter import OnlineDrafter
    from trainers.trl.rollouts import SpeculativeRollouts

    generations, trained = [], []
    call, train_on_batch = SpeculativeRollouts.__call__, OnlineDrafter.train_on_batch

    def generating(self, prompts, trainer):
        out = call(self, prompts, trainer)
        generations.append((trainer.model.training, self.last_batch))
        return out

    monkeypatch.setattr(SpeculativeRollouts, "__call__", generating)
    monkeypatch.setattr(OnlineDrafter, "train_on_batch",
                        lambda self, step, batch: (trained.append(batch), train_on_batch(self, step, batch))[1])
    evals = [[{"role": "user", "content": f"Name {i + 2} colours."}] for i in range(2)]
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=2, eval_prompts=evals,
                       drafter_training={"every": 1, "updates": 1, "batch_size": 4}, num_iterations=2,
                       eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    trainer.train()
    modes = [training for training, _ in generations]
    assert modes[:2] == [True, False] and True not in modes[1:], modes  # one training generation, then evaluations
    assert len(trained) == 2 and all(b is generations[0][1] for b in trained)
    assert trainer.rollouts.last_batch is generations[-1][1]  # the metrics still describe the evaluation's


def test_generation_seeds_continue_after_a_resume(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    """The rollouts' generation count is checkpointed (without a trained head too): a resumed run
    draws the seeds the uninterrupted one drew, not its first steps' again."""
    import json

    from rollout.engine.backend import HFBackend

    seeds = []
    original = HFBackend.generate
    monkeypatch.setattr(HFBackend, "generate",
                        lambda self, *a, **kw: (seeds.append(kw["seed"]), original(self, *a, **kw))[1])
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=3, save_strategy="steps", save_steps=2)
    trainer.train()
    uninterrupted, seeds[:] = list(seeds), []
    assert len(set(uninterrupted)) == 3
    ckpt = tmp_path / "out" / "checkpoint-2"
    assert json.loads((ckpt / "speculative_rollouts.json").read_text()) == {"generations": 2}
    resumed = make_trainer(tmp_path / "r", tiny_policy_dir, tiny_head_dir, steps=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert seeds == uninterrupted[2:]


def test_a_resume_reports_a_trained_head_it_lacks_or_does_not_use(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    online = {"every": 1, "updates": 1, "batch_size": 4}
    make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=1, drafter_training=online, save_strategy="steps",
             save_steps=1).train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    capsys.readouterr()
    make_trainer(tmp_path / "a", tiny_policy_dir, tiny_head_dir, steps=1).train(resume_from_checkpoint=str(ckpt))
    out = capsys.readouterr().out
    assert ("note: checkpoint-1 holds the head trained so far (drafter_training.pt); with drafter_training.every 0 "
            f"the rollouts draft with the configured head ({tiny_head_dir}) instead") in out, out
    assert "warning" not in out
    (ckpt / "drafter_training.pt").unlink()
    (ckpt / "speculative_rollouts.json").unlink()
    resumed = make_trainer(tmp_path / "b", tiny_policy_dir, tiny_head_dir, steps=1, drafter_training=online)
    resumed.train(resume_from_checkpoint=str(ckpt))
    out = capsys.readouterr().out
    assert ("warning: checkpoint-1 holds no trained head (drafter_training.pt): drafter_training starts again from "
            f"the configured head ({tiny_head_dir})") in out, out
    assert "warning: checkpoint-1 holds no speculative_rollouts.json: the generation seeds start again" in out
    assert resumed.rollouts.trained_step == 0 and "note" not in out


def test_our_checkpoint_state_is_written_whole_and_before_trls(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    """A kill inside TRL's checkpoint leaves ours complete; a failed write keeps the previous file."""
    from trl import GRPOTrainer

    from trainers.grpo.checkpoint import CheckpointWriteError

    class Killed(Exception):
        pass

    def killed(self, model, trial):
        raise Killed

    monkeypatch.setattr(GRPOTrainer, "_save_checkpoint", killed)
    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=1, save_strategy="steps", save_steps=1,
                       drafter_training={"every": 1, "updates": 1, "batch_size": 4})
    with pytest.raises(Killed):
        trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    assert sorted(p.name for p in ckpt.iterdir()) == ["drafter_training.pt", "speculative_rollouts.json"]
    saved = torch.load(ckpt / "drafter_training.pt", weights_only=True)
    assert saved["trained_step"] == 1

    def torn(obj, f, *args, **kwargs):
        with open(f, "wb") if isinstance(f, (str, os.PathLike)) else f as out:
            out.write(b"torn")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(CheckpointWriteError, match="disk full"):  # the folder, there before, is not removed
        trainer._save_checkpoint(trainer.model, None)
    monkeypatch.undo()
    again = torch.load(ckpt / "drafter_training.pt", weights_only=True)  # the previous file, whole
    assert again["trained_step"] == 1 and again["rounds"] == saved["rounds"]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "object"])
def test_a_damaged_head_state_is_reported_naming_the_file(tmp_path, tiny_policy_dir, tiny_head_dir, damage):
    """drafter_training.pt is read with weights_only=True: a torn or foreign file, or one holding an
    object (whose loading could run code), stops the resume with an error naming the file."""
    from pathlib import PurePosixPath

    from trainers.grpo.checkpoint import CheckpointError

    online = {"every": 1, "updates": 1, "batch_size": 4}
    make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=1, drafter_training=online, save_strategy="steps",
                 save_steps=1).train()
    path = tmp_path / "out" / "checkpoint-1" / "drafter_training.pt"
    assert torch.load(path, weights_only=True)["trained_step"] == 1  # as saved: tensors and plain containers
    if damage == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    elif damage == "garbage":
        path.write_bytes(b"not a checkpoint")
    else:
        torch.save({"head": {}, "trained_step": 1, "where": PurePosixPath("x")}, path)
    resumed = make_trainer(tmp_path / "r", tiny_policy_dir, tiny_head_dir, steps=1, drafter_training=online)
    with pytest.raises(CheckpointError, match="truncated or corrupt|not a file of tensors and plain containers") as err:
        resumed.train(resume_from_checkpoint=str(path.parent))
    assert str(err.value).startswith(f"{path}: ")


def test_head_training_and_reloading_are_exclusive():
    from trainers.trl import RolloutSettings

    with pytest.raises(ConfigError, match="drafter_reload_every") as err:
        RolloutSettings(drafter_reload_every=1, drafter_training=OnlineDrafterConfig(every=1))
    assert err.value.field == "drafter_reload_every"
    with pytest.raises(ConfigError) as err:
        RolloutSettings(spec=SpecConfig(mode="off"), drafter_training=OnlineDrafterConfig(every=1))
    assert err.value.field == "drafter_training.every"
