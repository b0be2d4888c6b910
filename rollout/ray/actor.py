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
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from rollout.backend import WorkerSpec, build_backend
from rollout.eagle3_io import _normalise, read_eagle3_config
from rollout.outputs import RolloutBatch
from rollout.vllm.head import WEIGHT_FILES  # the weight files rollout.eagle3_io and vLLM read (no vLLM import)

__all__ = ["RolloutWorker", "Shard", "ShardResult", "WorkerSpec", "check_head_folder", "read_head_files",
           "remote_actor_class"]


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

    def __init__(self, spec: WorkerSpec, head_files: Mapping[str, bytes] | None = None,
                 head_origin: str | None = None):
        """``head_files``: the head's folder as files (:func:`read_head_files`), drafted with
        instead of ``spec.drafter_path`` (which then need not exist on this node);
        ``head_origin``: the folder they were read from, named in load errors instead of this
        actor's temporary copy."""
        torch.set_num_threads(spec.threads)
        self.spec = spec
        if head_files is None:
            self.backend = build_backend(spec)
            return
        with _head_folder(head_files, head_origin) as folder:
            self.backend = build_backend(dataclasses.replace(spec, drafter_path=folder))

    @property
    def version(self) -> int:
        return self.backend.version

    def set_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> int:
        """Load new policy weights in place; returns the version now held."""
        return self.backend.set_weights(state_dict, version)

    def load_drafter_files(self, files: Mapping[str, bytes], origin: str | None = None) -> None:
        """Re-load the EAGLE-3 head shipped as its folder's files (:func:`read_head_files`): they
        are written to a folder of this process's own, loaded, and removed. So an actor on a node
        that cannot see the driver's folder (a run's ``<out_dir>/drafter`` on the trainer's disk)
        drafts with the same head. ``origin``: the folder the files were read from (named in
        load errors)."""
        with _head_folder(files, origin) as folder:
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


def check_head_folder(path: str | Path) -> None:
    """Refuse, naming ``path``, a folder that cannot hold an EAGLE-3 head: no folder, no
    ``config.json``, a config that does not read (JSON, the layer fields ``rollout.eagle3_io``
    needs), no weights file, safetensors weights whose header does not read or has no
    ``fc.weight``. The checks that need no target, made on the driver before the files are
    shipped; whether the head fits the target is each actor's backend's check."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"no EAGLE-3 head folder at {folder}")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"no EAGLE-3 head at {folder} (no config.json)")
    try:
        raw = read_eagle3_config(folder)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"EAGLE-3 head at {folder}: config.json does not read as JSON ({err})") from err
    if not isinstance(raw, dict):
        raise ValueError(f"EAGLE-3 head at {folder}: config.json holds a {type(raw).__name__}, not a mapping")
    fields, _, _ = _normalise(raw, {})
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
               if fields.get(k) is None]
    if missing:
        raise ValueError(f"EAGLE-3 head at {folder}: config.json has no {', '.join(missing)}")
    weights = [folder / f for f in WEIGHT_FILES if (folder / f).is_file()]
    if not weights:
        raise FileNotFoundError(f"no weights in {folder} (expected one of {', '.join(WEIGHT_FILES)})")
    if weights[0].name == "model.safetensors":  # the header only (a .bin is read only by unpickling it)
        try:
            with safe_open(str(weights[0]), framework="pt") as f:
                names = set(f.keys())
        except Exception as err:
            raise ValueError(f"EAGLE-3 head at {folder}: model.safetensors does not read ({err})") from err
        if "fc.weight" not in names:
            raise ValueError(f"EAGLE-3 head at {folder}: no fc.weight in model.safetensors (not an EAGLE-3 head?)")


def read_head_files(path: str | Path) -> dict[str, bytes]:
    """The files of an EAGLE-3 head folder (its plain files; the folder holds no subfolders), to
    ship to actors through Ray's object store (:meth:`RolloutWorker.load_drafter_files`), after
    :func:`check_head_folder`."""
    check_head_folder(path)
    return {f.name: f.read_bytes() for f in sorted(Path(path).iterdir()) if f.is_file()}


@contextlib.contextmanager
def _head_folder(files: Mapping[str, bytes], origin: str | None = None):
    """A folder of this process's own holding ``files`` while the block runs (a backend reads the
    head's weights into memory as it loads it), removed after. An error raised in the block
    names ``origin``, where the files came from, instead of this folder (which is gone)."""
    folder = Path(tempfile.mkdtemp(prefix="honest-rollouts-head-"))
    try:
        for name, data in files.items():
            (folder / Path(name).name).write_bytes(data)
        yield str(folder)
    except Exception as err:
        if origin is not None:
            _name_origin(err, str(folder), str(origin))
        raise
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _name_origin(err: Exception, folder: str, origin: str) -> None:
    """Put ``origin`` in place of ``folder`` in ``err``'s message; a message that names neither
    (e.g. vLLM's check "head for another target: ...") gets a note naming ``origin``."""
    err.args = tuple(a.replace(folder, origin) if isinstance(a, str) else a for a in err.args)
    if isinstance(err, OSError):
        for attr in ("filename", "filename2"):
            if isinstance(getattr(err, attr), str):
                setattr(err, attr, getattr(err, attr).replace(folder, origin))
    if origin not in str(err):
        err.add_note(f"(loading the EAGLE-3 head shipped from {origin})")


def remote_actor_class(num_cpus: float, num_gpus: float = 0.0):
    """The Ray actor class for RolloutWorker (restarts are the pool's job, not Ray's)."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=0, max_task_retries=0)(RolloutWorker)
