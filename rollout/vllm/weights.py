"""Weight updates inside vLLM's workers (sent with ``LLM.collective_rpc``).

The policy: the model's own ``load_weights`` takes Hugging Face parameter names (it fuses
q/k/v and gate/up itself). The EAGLE-3 head: the proposer's model ``load_weights`` takes the
names of our EAGLE checkpoint (``midlayer.*``, ``fc``, ``norm``, ``lm_head``, ``d2t``).
Tensors travel by value (pickled when the engine core is another process), which suits the
small models this project runs on CPUs; a GPU cluster would use vLLM's weight-transfer
engine (``init_weight_transfer_engine`` / ``update_weights``) with the same names.
"""

from __future__ import annotations

from pathlib import Path

import torch


def _runner(worker):
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        raise RuntimeError(f"{type(worker).__name__} has no model_runner (unsupported vLLM worker)")
    return runner


def expected_weight_names(model_dir: str | Path, config: dict) -> set[str]:
    """The weight names of the target's checkpoint in ``model_dir`` (safetensors headers, one
    file or an index), plus ``lm_head.weight`` when ``config`` ties it to the embedding: what a
    policy update must send (vLLM's reload leaves any other name as it was)."""
    from rollout.vllm.head import read_config, read_weights

    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_config(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index} has no weight_map")
        names = set(weight_map)
    else:
        names = set()
        for f in sorted(folder.glob("*.safetensors")):
            names.update(read_weights(f, names_only=True))  # a truncated file is reported naming it
    if config.get("tie_word_embeddings", False):
        names.add("lm_head.weight")
    return names


def load_policy_worker(worker, tensors: dict[str, torch.Tensor]) -> int:
    """``collective_rpc``: reload the policy's weights in place (vLLM's layerwise reload: the
    CPU kernels repack weights after loading, so a bare ``load_weights`` cannot be used)."""
    _runner(worker).reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    return len(tensors)


def load_drafter_worker(worker, tensors: dict[str, torch.Tensor]) -> int:
    """``collective_rpc``: reload the EAGLE-3 head's weights into the proposer's model (the
    same layerwise reload, with the draft model's config; the shared embedding is kept)."""
    from vllm.model_executor.model_loader.reload.layerwise import (finalize_layerwise_reload,
                                                                   initialize_layerwise_reload)

    runner = _runner(worker)
    drafter = getattr(runner, "drafter", None)
    if drafter is None or not hasattr(drafter, "model"):
        raise RuntimeError("this vLLM engine has no EAGLE-3 drafter to load weights into")
    model = drafter.model
    initialize_layerwise_reload(model)
    model.load_weights(iter(tensors.items()))
    finalize_layerwise_reload(model, runner.vllm_config.speculative_config.draft_model_config)
    return len(tensors)


def read_head_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of an EAGLE-format head folder (safetensors or pytorch_model.bin, read
    without running code; a truncated or corrupt file is reported naming it), as vLLM's
    ``eagle3`` model loads them (``rollout.vllm.head.vllm_head_tensors``)."""
    from rollout.vllm.head import read_config, read_weights, vllm_head_tensors, weights_file

    file = weights_file(path)
    return vllm_head_tensors(read_weights(file), read_config(Path(path) / "config.json"), file)

