"""The TRL plug-in's backend choice: 'vllm' is accepted (chain / off), refused with tree mode
or an unknown name, naming the setting. The vLLM run itself is in the vllm-marked tests."""

from __future__ import annotations

import pytest

from rollout.config import ConfigError
from rollout.params import SpecConfig
from trainers.trl.rollouts import RolloutSettings


def test_vllm_backend_is_accepted_with_chain():
    s = RolloutSettings(backend="vllm", backend_options={"kv_cache_memory_bytes": 1 << 29})
    assert s.backend == "vllm" and s.backend_options["kv_cache_memory_bytes"] == 1 << 29


def test_tree_mode_and_unknown_backend_are_refused():
    with pytest.raises(ConfigError, match="spec.mode"):
        RolloutSettings(backend="vllm", spec=SpecConfig(mode="tree"))
    with pytest.raises(ConfigError, match="backend"):
        RolloutSettings(backend="sglang")


def test_local_hf_rollouts_refuse_backend_options():
    """placement local + hf runs over the trainer's own model: a weights rounding (or any other
    option) would be silently ignored, so it is refused, naming the field."""
    from rollout.models import TargetConfig

    with pytest.raises(ConfigError, match="backend_options.*'weights'.*placement 'ray'"):
        RolloutSettings(backend_options={"weights": "bfloat16"})
    s = RolloutSettings(placement="ray", target=TargetConfig(), backend_options={"weights": "bfloat16"})
    assert s.backend_options == {"weights": "bfloat16"}
