"""Drafter training objectives ("ce", "tv") and fine-tuning from a trained head (``init: head``)."""

import dataclasses

import pytest
import torch

from rollout.config import ConfigError, from_dict, load_yaml
from rollout.eagle3 import save_eagle3
from scripts.train_drafter import initial_head
from tests.trainers.drafter.test_drafter import make_head, tiny_data, tiny_target
from trainers.drafter.data import collate
from trainers.drafter.train import DrafterConfig, train_drafter
from trainers.drafter.ttt import estimated_tau, ttt_acceptance, ttt_forward, ttt_loss


def _slow_per_step(head, batch, steps: int, score) -> list[float]:
    """Mean of ``score(r, k, hidden)`` per step, position by position: the draft at column ``col``
    of step s (its hidden state ``hidden``) against the target at position k = col + 1 + s of row r,
    over the positions that predict a response token (``score`` returns None to leave one out)."""
    means = []
    for s, (first, hidden) in enumerate(ttt_forward(head, batch, steps)):
        values = [score(r, col + 1 + s, hidden[r, col - first]) for r in range(batch.tokens.shape[0])
                  for col in range(first, batch.tokens.shape[1] - 1)
                  if col + 1 + s < batch.tokens.shape[1] and batch.lossable[r, col + 1 + s]]
        values = [v for v in values if v is not None]
        means.append(sum(values) / len(values))
    return means


def _slow_acceptance(head, batch, steps: int, scale: float) -> list[float]:
    """Mean T = 1 acceptance per step from first principles: the target's softmax over its full
    vocabulary (from the final hidden), the draft's over its own, the overlap sum_v min(p, q) at
    the draft ids."""
    emb = head.embed_tokens.weight

    def overlap(r, k, hidden):
        p = torch.softmax(batch.final[r, k] @ emb.T, -1)[head.target_ids]
        q = torch.softmax(scale * head.logits_from_hidden(hidden), -1)
        return float(torch.minimum(p, q).sum())

    return _slow_per_step(head, batch, steps, overlap)


def _head_and_batch():
    """A trained tiny head and a batch of its 8 training answers."""
    target = tiny_target(init_range=0.3)
    data = tiny_data(target, n=8)
    return make_head(target, data).eval(), collate(data, list(range(8)))


def test_tv_loss_is_one_minus_the_acceptance_it_reports():
    head, batch = _head_and_batch()
    with torch.no_grad():
        loss, per_step = ttt_loss(head, batch, 3, 0.8, "tv", scale=1.3)
        slow = _slow_acceptance(head, batch, 3, 1.3)
        acc = ttt_acceptance(head, batch, 3, scales=(1.3,))
    assert per_step == pytest.approx([1 - a for a in slow], abs=1e-5)
    assert [float(a) for a in acc["acc_t1"][0] / acc["count"]] == pytest.approx(slow, abs=1e-5)
    assert float(loss) == pytest.approx(sum(0.8**s * (1 - a) for s, a in enumerate(slow)), abs=1e-5)
    with torch.no_grad():  # the cross-entropy term adds exactly ce_weight x the "ce" loss
        mixed, mixed_steps = ttt_loss(head, batch, 3, 0.8, "tv", ce_weight=0.25, scale=1.3)
        ce, _ = ttt_loss(head, batch, 3, 0.8, "ce")
    assert mixed_steps == per_step
    assert float(mixed) == pytest.approx(float(loss) + 0.25 * float(ce), rel=1e-5)


def test_tv_training_raises_t1_acceptance(tmp_path):
    """Both objectives from the same start, the same batches: each raises the chain acceptance
    at T = 1, and the heads differ (the objective reaches the loop)."""
    target = tiny_target(init_range=0.3)
    data = tiny_data(target, n=16)
    batch = collate(data, list(range(16)))

    def est_tau(head) -> float:
        with torch.no_grad():
            acc = ttt_acceptance(head, batch, 3)
        return estimated_tau(acc["acc_t1"][0] / acc["count"])

    start = est_tau(make_head(target, data))
    heads, taus = {}, {}
    for objective in ("ce", "tv"):
        heads[objective] = head = make_head(target, data)
        cfg = DrafterConfig(draft_vocab_size=120, batch_size=8, epochs=20, lr=3e-3, warmup_steps=2, ttt_steps=3,
                            out_dir=str(tmp_path / objective), objective=objective)
        train_drafter(cfg, head, data, progress=False, log=lambda *_: None)
        taus[objective] = est_tau(head)
    assert min(taus.values()) > start + 0.1, (start, taus)
    assert not torch.equal(heads["ce"].fc.weight, heads["tv"].fc.weight)


def test_init_head_starts_from_the_saved_head(tmp_path):
    target = tiny_target()
    data = tiny_data(target, n=6)
    saved = make_head(target, data)
    with torch.no_grad():
        saved.fc.weight.add_(0.5)  # not what a fresh head would be
    saved.cfg = dataclasses.replace(saved.cfg, logit_scale=1.25)
    save_eagle3(saved, tmp_path / "head")
    cfg = DrafterConfig(draft_vocab_size=120, init="head", init_head=str(tmp_path / "head"))
    head = initial_head(cfg, target, data, "cpu")
    assert torch.equal(head.target_ids, saved.target_ids) and head.cfg.logit_scale == 1.25
    for k, v in saved.state_dict().items():
        assert torch.equal(v, head.state_dict()[k]), k
    assert head.training
    fresh = initial_head(dataclasses.replace(cfg, init="random", init_head=None), target, data, "cpu")
    assert not torch.equal(fresh.fc.weight, saved.fc.weight)
    with pytest.raises(ConfigError, match="draft_vocab_size.*120"):
        initial_head(dataclasses.replace(cfg, draft_vocab_size=100), target, data, "cpu")


@pytest.mark.parametrize("fields, field", [
    ({"init": "head"}, "init_head"),
    ({"init_head": "default"}, "init_head"),
    ({"init": "heads", "init_head": "default"}, "init"),
    ({"objective": "kl"}, "objective"),
    ({"ce_weight": 0.1}, "ce_weight"),
    ({"objective": "tv", "ce_weight": -1.0}, "ce_weight"),
    ({"objective": "tv", "ce_weight": float("inf")}, "ce_weight"),
])
def test_bad_objective_and_init_fields_are_named(fields, field):
    with pytest.raises(ConfigError, match=field):
        DrafterConfig(**fields)
    assert DrafterConfig(init="head", init_head="default", objective="tv", ce_weight=0.1).objective == "tv"


def test_finetune_config_loads():
    cfg = from_dict(DrafterConfig, load_yaml("configs/drafter_finetune.yaml"))
    assert (cfg.init, cfg.init_head, cfg.objective, cfg.draft_vocab_size) == ("head", "default", "tv", 8192)


def _slow_ce(head, batch, steps: int) -> list[float]:
    """Mean soft cross-entropy per step from first principles: the target's softmax renormalised
    over the draft vocabulary (from the final hidden) against the draft's log-softmax, at the
    positions whose target argmax is a draft token."""
    emb = head.embed_tokens.weight[head.target_ids]
    in_draft = set(head.target_ids.tolist())

    def cross_entropy(r, k, hidden):
        if int(batch.argmax[r, k]) not in in_draft:
            return None
        p = torch.softmax(batch.final[r, k] @ emb.T, -1)
        return float(-(p * torch.log_softmax(head.logits_from_hidden(hidden), -1)).sum())

    return _slow_per_step(head, batch, steps, cross_entropy)


def test_ce_loss_matches_a_slow_reference():
    head, batch = _head_and_batch()
    with torch.no_grad():
        loss, per_step = ttt_loss(head, batch, 3, 0.8, "ce")
        slow = _slow_ce(head, batch, 3)
    # some scored-looking positions are left out because their argmax is outside the draft vocabulary
    lossable = batch.lossable[:, 1:] & (batch.argmax[:, 1:] >= 0)
    assert not bool(head.t2d[batch.argmax[:, 1:].clamp(min=0)][lossable].all())
    assert per_step == pytest.approx(slow, rel=1e-5)
    assert float(loss) == pytest.approx(sum(0.8**s * v for s, v in enumerate(slow)), rel=1e-5)


def test_t0_acceptance_compares_target_ids_with_the_targets_argmax():
    """``acc_t0``: the share of scored positions where the draft's argmax, mapped from its draft id to
    the target's id, is the target's argmax: equal to the position-by-position count (the draft
    vocabulary here is a subset, so draft ids and target ids differ)."""
    head, batch = _head_and_batch()
    assert not torch.equal(head.target_ids, torch.arange(len(head.target_ids)))
    with torch.no_grad():  # the target's argmax made the draft's at every other column of step 0: hits to count
        (_, hidden), = ttt_forward(head, batch, 1)
        guess = head.target_ids[head.logits_from_hidden(hidden).argmax(-1)]  # [B, T]: predicts position col + 1
        shown = batch.argmax[:, 1:]
        shown[:, ::2] = torch.where(shown[:, ::2] >= 0, guess[:, ::2], shown[:, ::2])

    def hit(r, k, hidden):
        return float(int(head.target_ids[head.logits_from_hidden(hidden).argmax(-1)]) == int(batch.argmax[r, k]))

    with torch.no_grad():
        acc = ttt_acceptance(head, batch, 3)
        slow = _slow_per_step(head, batch, 3, hit)
    assert (acc["acc_t0"] / acc["count"]).tolist() == pytest.approx(slow, abs=1e-6)
    assert slow[0] > 0.3
