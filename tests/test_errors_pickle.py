"""The project's errors cross a pickle whole (Ray sends an actor's exception to the driver so):
the same type, message and fields, not Ray's UnserializableException."""

from __future__ import annotations

import pickle

import pytest

from rollout.config import ConfigError, ConfigFileError
from trainers.grpo.guards import NonFiniteError


@pytest.mark.parametrize("err, fields", [
    (ConfigError("spec.mode", "unknown mode 'x'", allowed=("off", "chain")), {"field": "spec.mode"}),
    (ConfigFileError("/tmp/c.yaml", "not a mapping"), {"field": "/tmp/c.yaml"}),
    (NonFiniteError(7, "drafter loss", "nan; lower drafter_training.lr"), {"step": 7, "quantity": "drafter loss"}),
])
def test_errors_survive_a_pickle(err, fields):
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is type(err) and str(back) == str(err) and back.args == err.args
    for name, value in fields.items():
        assert getattr(back, name) == value
