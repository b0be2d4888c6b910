"""A TRL run with our rollouts in every process of ``accelerate launch --num_processes N``
(``test_trl_multiprocess.py`` launches it).

    accelerate launch --multi_gpu --num_processes 2 tests/trainers/trl/trl_multiprocess_run.py CONFIG PROBE_DIR

Trains the run config CONFIG the way ``scripts.train_trl`` does (``trainers.trl.run.run``),
with a mixin that records, in each process and for each generation: the optimizer step, a
digest of the weights the rollouts generated with (the backend's model) and every process's
digest (``torch.distributed.all_gather_object``), the prompts and completions, TRL's
importance ratios and the difference between the log-probs TRL divides by and our behaviour
log-probs, and the process's own rollout metrics. After training each process writes them,
with its log history, to ``PROBE_DIR/process<rank>.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository, as pytest sees it


def weights_digest(model) -> str:
    """SHA-256 over the model's state dict (names, shapes, dtypes and bytes, in order)."""
    import torch

    h = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        t = tensor.detach().cpu().contiguous()
        h.update(f"{name}{tuple(t.shape)}{t.dtype}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Probe:
    """Mixed into the run's trainer (``run(cfg, mixins=(Probe,))``)."""

    def _generate_and_score_completions(self, inputs):
        import torch.distributed as dist

        out = super()._generate_and_score_completions(inputs)
        rollouts = self.rollouts
        batch = rollouts.last_batch
        digest = weights_digest(rollouts.backend.target.model)  # what this generation ran on
        digests = [None] * dist.get_world_size()
        dist.all_gather_object(digests, digest)
        mask = out["completion_mask"].bool()
        ratios = self.importance_ratios(out)[mask]
        behaviour = batch.behaviour_logprobs[batch.completion_mask]
        relaxed = (batch.relaxed & batch.completion_mask).sum() / batch.completion_mask.sum().clamp(min=1)
        records = getattr(self, "probe_records", [])
        records.append({
            "step": int(self.state.global_step), "seed": rollouts.call_seed(rollouts.state_dict()["generations"] - 1),
            "digest": digest, "digests": digests, "prompt_ids": batch.prompt_lists(),
            "completion_ids": batch.completion_lists(), "ratio_max_deviation": float((ratios - 1).abs().max()),
            "logprob_max_difference": float((out["sampling_per_token_logps"][mask] - behaviour).abs().max()),
            "tau": float(batch.tau), "relaxed_fraction": float(relaxed),
        })
        self.probe_records = records
        return out

    def train(self, *args, **kwargs):
        import torch

        result = super().train(*args, **kwargs)
        rank = self.accelerator.process_index
        report = {"process_index": rank, "num_processes": self.accelerator.num_processes,
                  "torch_threads": torch.get_num_threads(), "records": getattr(self, "probe_records", []),
                  "log_history": self.state.log_history}
        Path(os.environ["PROBE_DIR"], f"process{rank}.json").write_text(json.dumps(report))
        return result


def main(argv: list[str]) -> int:
    config, probe_dir = argv
    os.environ["PROBE_DIR"] = probe_dir
    from trainers.trl.config import load_trl_config
    from trainers.trl.run import run

    run(load_trl_config(config), mixins=(Probe,))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
