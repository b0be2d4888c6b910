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


def _batch(trainer, repeated: bool, shapes=SHAPES) -> tuple[RolloutBatch, torch.Tensor]:
    """The batch, and the policy's log-probs of its completions in row order (before the step).
    ``repeated``: rows alternate between the first two prompts (two groups, interleaved)."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(10, 400, (p,), generator=g).tolist() for p, _ in shapes]
    if repeated:
        prompts = [prompts[i % 2] for i in range(len(prompts))]
    outs = [torch.randint(10, 400, (c,), generator=g).tolist() for _, c in shapes]
    n, pw, cw = len(shapes), max(map(len, prompts)), max(c for _, c in shapes)
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


# an empty completion (no token to score) must not change how micro-batches share the step
WITH_EMPTY = [(9, 3), (4, 0), (12, 1), (5, 5), (7, 8), (3, 2)]


@pytest.mark.parametrize("aggregation, mode, repeated, shapes", [
    ("token", "token_tis", False, SHAPES), ("sequence", "seq_tis", False, SHAPES), ("token", "seq_mis", False, SHAPES),
    ("token", "token_tis", True, SHAPES), ("sequence", "seq_mis", True, SHAPES),
    ("sequence", "token_tis", False, WITH_EMPTY), ("token", "token_tis", False, WITH_EMPTY)])
def test_micro_batches_do_not_change_the_step(tmp_path, tiny_policy_dir, aggregation, mode, repeated, shapes):
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.5])
    results = []
    for mb, share in ((len(shapes), False), (2, True), (3, True)):
        trainer = _trainer(tmp_path, tiny_policy_dir, mb, share, grpo={"group_size": 3, "aggregation": aggregation},
                           correction={"mode": mode, "cap": 2.0, "low": 0.5, "high": 2.0})
        grads = {}
        step = trainer.optimizer.step

        def record_and_step(*args, _step=step, _grads=grads, _model=trainer.policy, **kwargs):
            # the gradient, not the weights: Adam's first step is lr * sign(g) where g is ~0
            _grads.update({k: p.grad.clone() for k, p in _model.named_parameters() if p.grad is not None})
            return _step(*args, **kwargs)

        trainer.optimizer.step = record_and_step
        batch, policy_logp = _batch(trainer, repeated, shapes)
        metrics, records = trainer.update(batch, adv)
        for i, rec in enumerate(records):  # each row's pi_old is its own, whichever micro-batch it ran in
            assert rec["policy_logprobs"] == pytest.approx(policy_logp[i, :shapes[i][1]].tolist(), abs=1e-5), i
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


def _record_grads_before_clipping(monkeypatch) -> dict:
    """The policy's gradients as the update leaves them, before clip_grad_norm_ scales them."""
    grads = {}
    clip = torch.nn.utils.clip_grad_norm_

    def record(params, *args, **kwargs):
        params = list(params)
        grads["all"] = [p.grad.clone() if p.grad is not None else None for p in params]
        return clip(params, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", record)
    return grads


def test_the_weights_are_the_policy_over_the_behaviour_logprobs(tmp_path, tiny_policy_dir, monkeypatch):
    """A lossy rollout with no staleness: the rollout-time target log-probs equal the policy's
    (p = pi), the behaviour log-probs do not (P != p). The step's weights are pi_old / P truncated
    at the cap, so its gradient is that of -sum_i A_i sum_t w_it log pi(y_it) / tokens with those
    w (the ratio is 1 at the step), and the logged weights, log ratios and staleness split the
    same way. Weights pi / p would be 1 everywhere here: no correction at all."""
    import copy

    from trainers.grpo.policy import completion_logprobs

    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.5])
    cap = 1.5
    trainer = _trainer(tmp_path, tiny_policy_dir, 3, True, grpo={"group_size": 3, "aggregation": "token"},
                       correction={"mode": "token_tis", "cap": cap})
    batch, policy_logp = _batch(trainer, repeated=True)
    batch.target_logprobs = policy_logp.clone()  # p = pi: no staleness; P != p: a lossy rule
    mask, behaviour = batch.completion_mask, batch.behaviour_logprobs
    # the closed form on a copy of the policy, one forward over all rows
    ref_model = copy.deepcopy(trainer.policy)
    logp, _ = completion_logprobs(ref_model, batch.prompt_lists(), batch.completion_lists(), temperature=1.0)
    w = torch.where(mask, torch.exp(logp.detach() - behaviour).clamp(max=cap), 0.0)
    assert (w[mask] == cap).any() and (w[mask] < 0.9).any()  # truncated and far from 1
    (-(adv[:, None] * w * logp)[mask].sum() / mask.sum()).backward()
    grads = _record_grads_before_clipping(monkeypatch)
    metrics, records = trainer.update(batch, adv)
    for got, ref in zip(grads["all"], ref_model.parameters()):
        if ref.grad is None:
            assert got is None or not got.any()
            continue
        torch.testing.assert_close(got, ref.grad, rtol=1e-4, atol=1e-6)
    assert max(float(p.grad.abs().max()) for p in ref_model.parameters() if p.grad is not None) > 1e-3
    for i, rec in enumerate(records):
        n = int(mask[i].sum())
        assert rec["weights"] == pytest.approx(w[i, :n].tolist(), abs=1e-5), i
        assert rec["behaviour_logprobs"] == pytest.approx(behaviour[i, :n].tolist(), abs=1e-5), i
    log_r = (policy_logp - behaviour)[mask].double()
    assert metrics["log_ratio_mean"] == pytest.approx(float(log_r.mean()), abs=1e-5)
    assert metrics["log_ratio_abs_max"] == pytest.approx(float(log_r.abs().max()), abs=1e-5)
    assert metrics["is_weight_max"] == pytest.approx(cap)
    assert metrics["rollout_vs_trainer_logp_max"] < 1e-4  # pi_old against p, not against P


def test_the_kl_reference_stays_the_initial_policy(tmp_path, tiny_policy_dir):
    """With kl_coef > 0 the k3 term pulls towards the policy the run started from: two updates
    move the policy, never the reference."""
    trainer = _trainer(tmp_path, tiny_policy_dir, 3, True, grpo={"group_size": 3, "kl_coef": 0.1})
    initial = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    adv = torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.5])
    for _ in range(2):
        batch, _ = _batch(trainer, repeated=True)
        trainer.update(batch, adv)
    ref = trainer.reference.state_dict()
    assert all(torch.equal(ref[k], v) for k, v in initial.items())
    assert any(not torch.equal(trainer.policy.state_dict()[k], v) for k, v in initial.items())
    assert not any(p.requires_grad for p in trainer.reference.parameters())


class _StubPool(_NoPool):
    """Returns one-token completions in the order asked; records the request ids."""

    stats = type("Stats", (), {"restarts": 0})()

    def __init__(self):
        self.ids = []

    def generate(self, ids, prompts, seed):
        self.ids.append(list(ids))
        n, width = len(prompts), max(map(len, prompts))
        prompt_ids, prompt_mask = torch.zeros(n, width, dtype=torch.long), torch.zeros(n, width, dtype=torch.bool)
        for i, p in enumerate(prompts):
            prompt_ids[i, :len(p)], prompt_mask[i, :len(p)] = torch.tensor(p), True
        ones = torch.ones(n, 1, dtype=torch.bool)
        batch = RolloutBatch(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                             completion_ids=torch.arange(10, 10 + n).view(n, 1), completion_mask=ones,
                             behaviour_logprobs=torch.full((n, 1), -1.0), target_logprobs=torch.full((n, 1), -1.0),
                             kinds=torch.zeros(n, 1, dtype=torch.int8), relaxed=~ones, finish_reasons=["length"] * n,
                             tau=1.0, timings={"tokens": float(n)})
        return batch, None


@pytest.mark.parametrize("scale_std", [False, True])
def test_a_step_centres_rewards_within_each_prompts_group(tmp_path, tiny_policy_dir, monkeypatch, scale_std):
    """Rollouts come back prompt-major (prompt i's G rows together); each row's advantage is its
    reward minus its own group's mean (divided by that group's unbiased std with scale_std)."""
    rewards = [1.0, 0.0, 2.0, 5.0, 5.0, 8.0]  # prompt 0's three rows, then prompt 1's
    pending = list(rewards)
    monkeypatch.setattr("trainers.grpo.loop.answer_reward", lambda text, answer, cfg=None: pending.pop(0))
    trainer = _trainer(tmp_path, tiny_policy_dir, 3, True, grpo={"group_size": 3, "scale_std": scale_std},
                       task={"prompts_per_step": 2})
    trainer.pool = _StubPool()
    trainer.logger = type("Logger", (), {"log_rollouts": lambda self, step, records: None})()
    seen = []
    monkeypatch.setattr(trainer, "update", lambda batch, adv: (seen.append(adv.clone()),
                                                               ({}, [{} for _ in range(len(batch))]))[1])
    metrics = trainer.step(0)
    assert trainer.pool.ids == [["0/0/0", "0/0/1", "0/0/2", "0/1/0", "0/1/1", "0/1/2"]]
    want = torch.tensor([0.0, -1.0, 1.0, -1.0, -1.0, 2.0])  # [1, 0, 2] - 1, [5, 5, 8] - 6
    if scale_std:
        want = want / torch.tensor([1.0, 1.0, 1.0, 3 ** 0.5, 3 ** 0.5, 3 ** 0.5])  # unbiased stds 1 and sqrt(3)
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], want, rtol=1e-5, atol=1e-6)
    assert metrics["reward_mean"] == pytest.approx(sum(rewards) / 6)
    assert metrics["groups_zero_std_frac"] == 0.0


def test_the_step_clips_the_gradient_to_the_configured_norm(tmp_path, tiny_policy_dir):
    """optim.grad_clip bounds the norm of the gradient the optimizer steps with; the logged
    grad_norm is the norm before clipping."""
    import dataclasses

    trainer = _trainer(tmp_path, tiny_policy_dir, 3, True, grpo={"group_size": 3})
    trainer.cfg = dataclasses.replace(trainer.cfg, optim=dataclasses.replace(trainer.cfg.optim, grad_clip=1e-3))
    norms = []
    step = trainer.optimizer.step

    def record_and_step(*args, **kwargs):
        grads = [p.grad for p in trainer.policy.parameters() if p.grad is not None]
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))))
        return step(*args, **kwargs)

    trainer.optimizer.step = record_and_step
    batch, _ = _batch(trainer, repeated=True)
    metrics, _ = trainer.update(batch, torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.5]))
    assert metrics["grad_norm"] > 0.01  # well above the bound: clipping bites
    assert norms == [pytest.approx(1e-3, rel=1e-3)]
