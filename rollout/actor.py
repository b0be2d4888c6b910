"""The rollout actor: a thin Ray wrapper around a rollout backend.

Vocabulary:
- **shard**: the part of a step's rollout requests handed to one actor. It carries the
  request ids (``"<step>/<prompt>/<sample>"``), the prompt token ids and a seed derived
  from the step and the shard index, so a shard re-run on another actor (after a failure)
  gives the same completions.
- **policy version**: the number of optimizer steps behind the weights an actor holds.
  Every result is tagged with the version that produced it; the driver refuses stale ones.

:class:`RolloutWorker` is plain Python (tested without Ray) around the backend that
``WorkerSpec.backend`` names (``rollout.backend``); :func:`remote_actor_class` returns the
Ray actor class built from it. A shard's result is the backend's ``RolloutBatch``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from rollout.backend import WorkerSpec, build_backend
from rollout.outputs import RolloutBatch

__all__ = ["RolloutWorker", "Shard", "ShardResult", "WorkerSpec", "read_head_files", "remote_actor_class"]


@dataclass(frozen=True)
class Shard:
    shard_id: int
    request_ids: tuple[str, ...]
    prompts: tuple[tuple[int, ...], ...]
    seed: int

    def __post_init__(self) -> None:
        if len(self.request_ids) != len(self.prompts):
            raise ValueError(f"shard {self.shard_id}: {len(self.request_ids)} ids for {len(self.prompts)} prompts")


@dataclass
class ShardResult:
    """One shard's rollouts (rows in the shard's request order) and where they came from."""

    shard_id: int
    request_ids: tuple[str, ...]
    batch: RolloutBatch
    actor_pid: int

    @property
    def policy_version(self) -> int:
        return self.batch.policy_version


class RolloutWorker:
    """Holds one backend (the policy copy and its EAGLE-3 head); generates shards."""

    def __init__(self, spec: WorkerSpec, head_files: Mapping[str, bytes] | None = None):
        """``head_files``: the head's folder as files (:func:`read_head_files`), drafted with
        instead of ``spec.drafter_path`` (which then need not exist on this node)."""
        torch.set_num_threads(spec.threads)
        self.spec = spec
        if head_files is None:
            self.backend = build_backend(spec)
            return
        with _head_folder(head_files) as folder:
            self.backend = build_backend(dataclasses.replace(spec, drafter_path=folder))

    @property
    def version(self) -> int:
        return self.backend.version

    def set_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Load new policy weights in place; returns the version now held."""
        return self.backend.set_weights(state_dict, version)

    def load_drafter_files(self, files: Mapping[str, bytes]) -> None:
        """Re-load the EAGLE-3 head shipped as its folder's files (:func:`read_head_files`): they
        are written to a folder of this process's own, loaded, and removed. So an actor on a node
        that cannot see the driver's folder (a run's ``<out_dir>/drafter`` on the trainer's disk)
        drafts with the same head."""
        with _head_folder(files) as folder:
            self.backend.load_drafter(folder)

    def generate(self, shard: Shard) -> ShardResult:
        batch = self.backend.generate([list(p) for p in shard.prompts], sampling=self.spec.sampling,
                                      spec=self.spec.spec, verifier=self.spec.verifier, seed=shard.seed)
        return ShardResult(shard.shard_id, shard.request_ids, batch, os.getpid())

    def next_token_logits(self, prompts: list[list[int]]) -> torch.Tensor:
        """The backend's raw next-token logits [N, V] (a weight-sync check)."""
        return self.backend.next_token_logits(prompts)

    def head_weights(self) -> dict[str, torch.Tensor] | None:
        """The EAGLE-3 head's weights as this actor drafts with them (a drafter-sync check);
        None without a head."""
        head = getattr(self.backend, "head", None)
        return None if head is None else {k: v.detach().cpu() for k, v in head.state_dict().items()}

    def ping(self) -> tuple[int, float]:
        return os.getpid(), time.time()


def read_head_files(path: str | Path) -> dict[str, bytes]:
    """The files of an EAGLE-3 head folder (its plain files; the folder holds no subfolders), to
    ship to actors through Ray's object store (:meth:`RolloutWorker.load_drafter_files`)."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"no EAGLE-3 head folder at {folder}")
    files = {f.name: f.read_bytes() for f in sorted(folder.iterdir()) if f.is_file()}
    if "config.json" not in files:
        raise FileNotFoundError(f"no EAGLE-3 head at {folder} (no config.json)")
    return files


@contextlib.contextmanager
def _head_folder(files: Mapping[str, bytes]):
    """A folder of this process's own holding ``files`` while the block runs (a backend reads the
    head's weights into memory as it loads it), removed after."""
    folder = Path(tempfile.mkdtemp(prefix="honest-rollouts-head-"))
    try:
        for name, data in files.items():
            (folder / Path(name).name).write_bytes(data)
        yield str(folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def remote_actor_class(num_cpus: float, num_gpus: float = 0.0):
    """The Ray actor class for RolloutWorker (restarts are the pool's job, not Ray's)."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)(RolloutWorker)
