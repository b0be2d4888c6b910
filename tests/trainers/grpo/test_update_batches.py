"""The GRPO update splits a batch into micro-batches that pad least, and rows of a micro-batch
that repeat a prompt share its forward. The gradient is a sum over micro-batches, so neither
may change the step: the same batch through one micro-batch with every row run whole, and
through micro-batches of 2 and 3 with prompts shared, gives the same gradient, loss and
statistics, for token and sequence aggregation and per-token and per-sequence weights.
(The rollout pool is a stub here: the test isolates the update.)"""

from __future__ import annotations

import pytest
import torch

from rollout.outputs import RolloutBatch
from tests.trainers.conftest import write_config
from trainers.grpo.config import load_train_config

# rows in an order that length sorting changes: (prompt length, completion length)
SHAPES = [(9, 3), (4, 7), (12, 1), (5, 5), (7, 8), (3, 2)]


class _NoPool:
    def set_weights(self, state, version):
        pass


def _trainer(tmp_path, policy_dir, micro_batch, share_prompts=True, **sections):
    from trainers.grpo.loop import GRPOTrainer

    name = f"mb{micro_batch}{'s' if share_prompts else ''}"
    path = write_config(tmp_path / f"{name}.yaml", policy_dir, None, tmp_path / name,
                        optim={"lr": 1e-3, "micro_batch": micro_batch, "share_prompts": share_prompts},
                        rollout={"spec": {"mode": "off"}}, **sections)
    trainer = GRPOTrainer(load_train_config(path))
    trainer.pool = _NoPool()
    return trainer


def _batch(trainer, repeated: bool) -> tuple[RolloutBatch, torch.Tensor]:
    """The batch, and the policy's log-probs of its completions in row order (before the step).
    ``repeated``: rows alternate between the first two prompts (two groups, interleaved)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 400, (p,), generator=g).tolist() for p, _ in SHAPES]
    if repeated:
        prompts = [prompts[i % 2] for i in range(len(prompts))]
    outs = [torch.randint(10, 400, (c,), generator=g).tolist() for _, c in SHAPES]
    n, pw, cw = len(SHAPES), max(map(len, prompts)), max(c for _, c in SHAPES)
    prompt_ids, prompt_mask = torch.zeros(n, pw, dtype=torch.long), torch.zeros(n, pw, dtype=torch.bool)
    completion_ids, mask = torch.zeros(n, cw, dtype=torch.long), torch.zeros(n, cw, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, outs)):
        prompt_ids[i, :len(p)], prompt_mask[i, :len(p)] = torch.tensor(p), True
        completion_ids[i, :len(c)], mask[i, :len(c)] = torch.tensor(c), True
    with torch.no_grad():  # behaviour log-probs near the policy's, so the weights vary around 1
        policy = trainer._logprobs(trainer.policy, prompts, outs, cw)
    behaviour = torch.where(mask, policy + 0.3 * torch.randn(n, cw, generator=g), torch.zeros(()))
    return RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                        completion_mask=mask, behaviour_logprobs=behaviour, target_logprobs=behaviour.clone(),
                        kinds=torch.zeros(n, cw, dtype=torch.int8), relaxed=torch.zeros(n, cw, dtype=torch.bool),
                        finish_reasons=["length"] * n, tau=1.0), policy


@pytest.mark.parametrize("aggregation, mode, repeated", [("token", "token_tis", False), ("sequence", "seq_tis", False),
                                                         ("token", "seq_mis", False), ("token", "token_tis", True),
                                                         ("sequence", "seq_mis", True)])
def test_micro_batches_do_not_change_the_step(tmp_path, tiny_policy_dir, aggregation, mode, repeated):
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.5])
    results = []
    for mb, share in ((len(SHAPES), False), (2, True), (3, True)):
        trainer = _trainer(tmp_path, tiny_policy_dir, mb, share, grpo={"group_size": 3, "aggregation": aggregation},
                           correction={"mode": mode, "cap": 2.0, "low": 0.5, "high": 2.0})
        grads = {}
        step = trainer.optimizer.step

        def record_and_step(*args, _step=step, _grads=grads, _model=trainer.policy, **kwargs):
            # the gradient, not the weights: Adam's first step is lr * sign(g) where g is ~0
            _grads.update({k: p.grad.clone() for k, p in _model.named_parameters() if p.grad is not None})
            return _step(*args, **kwargs)

        trainer.optimizer.step = record_and_step
        batch, policy_logp = _batch(trainer, repeated)
        metrics, records = trainer.update(batch, adv)
        for i, rec in enumerate(records):  # each row's pi_old is its own, whichever micro-batch it ran in
            assert rec["policy_logprobs"] == pytest.approx(policy_logp[i, :SHAPES[i][1]].tolist(), abs=1e-5), i
        assert len(grads) > 10 and max(g.abs().max() for g in grads.values()) > 1e-3  # a real step
        results.append((metrics, records, grads))
    (m1, r1, w1) = results[0]
    for m2, r2, w2 in results[1:]:
        for key in ("loss", "grad_norm", "is_ess", "is_weight_mean", "kl_k3", "clip_frac"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
        for a, b in zip(r1, r2):  # the records stay in the batch's row order
            assert a["completion_ids"] == b["completion_ids"]
            assert a["policy_logprobs"] == pytest.approx(b["policy_logprobs"], abs=1e-5)
        assert w1.keys() == w2.keys()
        for name in w1:
            torch.testing.assert_close(w2[name], w1[name], rtol=1e-4, atol=1e-6, msg=name)
