"""The TRL plug-in refuses a policy sharded over processes (DeepSpeed ZeRO-3, FSDP) before training
starts, naming what to use instead: the rollouts need each process's full weights. accelerate's
state is faked here (neither runs on this CPU machine); the check reads only that state."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from rollout.config import ConfigError
from tests.trainers.trl.trl_fixtures import make_trainer

pytest.importorskip("trl")


@pytest.mark.parametrize("state, found", [
    (SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=3), fsdp_plugin=None), "DeepSpeed ZeRO-3"),
    (SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=2), fsdp_plugin=None), None),
    (SimpleNamespace(deepspeed_plugin=SimpleNamespace(zero_stage=1), fsdp_plugin=None), None),
    (SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=SimpleNamespace(fsdp_version=2)), "FSDP2"),
    (SimpleNamespace(deepspeed_plugin=None, fsdp_plugin=None), None),
])
def test_sharded_training_is_read_from_accelerates_state(state, found):
    from trainers.trl.trainer import sharded_training

    assert sharded_training(state) == found


def test_a_real_accelerate_state_is_not_sharded(tmp_path, tiny_policy_dir, tiny_head_dir):
    from trainers.trl.trainer import sharded_training

    trainer = make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=1)
    assert sharded_training(trainer.accelerator.state) is None


def test_fsdp_is_refused_before_training(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    from accelerate.state import AcceleratorState

    from trainers.trl.rollouts import SpeculativeRollouts

    fsdp = SimpleNamespace(fsdp_version=2, activation_checkpointing=False, state_dict_type="FULL_STATE_DICT")
    monkeypatch.setattr(AcceleratorState, "fsdp_plugin", property(lambda self: fsdp, lambda self, value: None),
                        raising=False)
    bound = []
    monkeypatch.setattr(SpeculativeRollouts, "bind", lambda self, trainer: bound.append(trainer))
    with pytest.raises(ConfigError) as err:
        make_trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=1)
    assert err.value.field == "GRPOConfig.fsdp" and "FSDP2" in str(err.value)
    assert "DDP" in str(err.value) and "ZeRO-2" in str(err.value)
    assert bound == []  # refused before the rollouts were built
