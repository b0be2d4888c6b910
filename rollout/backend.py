"""One rollout interface: what every engine offers the actor, the trainer and the TRL plug-in.

Vocabulary:
- **backend**: an engine that completes token-id prompts under given sampling,
  speculation and verifier settings and returns a :class:`rollout.outputs.RolloutBatch`
  (the one shape that leaves a backend). ``hf`` is our own speculative engine
  (``rollout.engine.engine``); ``vllm`` is vLLM with our verifier (``rollout.vllm``).
- **policy version**: the number of optimizer steps behind the weights a backend holds;
  every batch it returns carries it.
- **worker spec**: everything needed to build a backend in another process (picklable,
  validated configs); ``build_backend`` picks the class from ``spec.backend``.

A backend built over a model object that the trainer also holds (``HFBackend.from_model``,
the TRL plug-in on one machine) shares its parameters: ``set_weights(None, version)``
then moves only the version, and the weights are never stale.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from rollout.models import TargetConfig
from rollout.outputs import RolloutBatch
from rollout.params import SamplingParams, SpecConfig, VerifierConfig

#: The one backend registry: name -> "module:class", imported on first use (vLLM is an optional
#: extra). Each module also defines ``check_options(options)``, which loads no model (vLLM's
#: imports no vLLM).
BACKENDS: dict[str, str] = {"hf": "rollout.engine.backend:HFBackend", "vllm": "rollout.vllm.backend:VLLMBackend"}


@runtime_checkable
class RolloutBackend(Protocol):
    """Generate rollouts with exact behaviour log-probs; take new weights; report the version."""

    name: str

    @property
    def version(self) -> int: ...

    def generate(self, prompts: list[list[int]], *, sampling: SamplingParams, spec: SpecConfig,
                 verifier: VerifierConfig, seed: int) -> RolloutBatch: ...

    def set_weights(self, state_dict: Mapping[str, torch.Tensor] | None, version: int) -> int: ...

    def load_drafter(self, path: str) -> None: ...


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a process needs to build its backend (picklable, validated configs).

    backend: a key of ``BACKENDS``; backend_options: keyword options only that backend
    reads (e.g. vLLM's ``kv_cache_memory_bytes``).
    """

    target: TargetConfig
    drafter_path: str | None
    sampling: SamplingParams
    spec: SpecConfig
    verifier: VerifierConfig
    threads: int = 2
    device: str = "cpu"
    backend: str = "hf"
    backend_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown rollout backend {self.backend!r} (allowed: {', '.join(BACKENDS)})")


def backend_class(name: str) -> type:
    """The class registered under ``name``; a missing optional package is named."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r} (allowed: {', '.join(BACKENDS)})")
    module, cls = BACKENDS[name].split(":")
    try:
        return getattr(importlib.import_module(module), cls)
    except ImportError as err:
        raise ImportError(f"rollout backend {name!r} cannot be imported ({err}); "
                          f"for 'vllm' install the extra: pip install -e '.[vllm]'") from err


def check_backend_options(name: str, options: Mapping) -> None:
    """The ``backend_options`` of backend ``name``, names and values, checked where a config is
    read (before any actor or model): its module's ``check_options`` (vLLM's imports no vLLM)."""
    if name not in BACKENDS:
        raise ValueError(f"unknown rollout backend {name!r} (allowed: {', '.join(BACKENDS)})")
    importlib.import_module(BACKENDS[name].split(":")[0]).check_options(options)


def build_backend(spec: WorkerSpec) -> RolloutBackend:
    """Build the backend ``spec.backend`` names, from the spec alone (in any process)."""
    return backend_class(spec.backend).from_spec(spec)
