"""The "block" drafter objective: the joint acceptance of each prefix of a chain (closed form,
slow reference, training, config)."""

import itertools

import pytest
import torch

from rollout.config import ConfigError, from_dict, load_yaml
from tests.trainers.drafter.test_drafter import make_head, tiny_data, tiny_target
from trainers.drafter.data import DrafterDataConfig, collate
from trainers.drafter.train import DrafterConfig, evaluate, train_drafter
from trainers.drafter.ttt import (estimated_block_tau, joint_overlap, next_log_ratio, ttt_acceptance, ttt_forward,
                                  ttt_loss)


def _tables(vocab: int, draft: list[int], depth: int, seed: int):
    """Autoregressive laws over ``vocab`` tokens: P(. | prefix) over all of them, Q(. | prefix) over
    the ``draft`` ids only (zero elsewhere), for every prefix shorter than ``depth``."""
    g = torch.Generator().manual_seed(seed)
    p, q = {}, {}
    for n in range(depth):
        for prefix in itertools.product(range(vocab), repeat=n):
            p[prefix] = torch.softmax(2 * torch.randn(vocab, generator=g, dtype=torch.float64), -1)
            qd = torch.softmax(2 * torch.randn(len(draft), generator=g, dtype=torch.float64), -1)
            q[prefix] = torch.zeros(vocab, dtype=torch.float64).index_copy(0, torch.tensor(draft), qd)
    return p, q


def _joint(table, path) -> float:
    out = 1.0
    for i, x in enumerate(path):
        out *= float(table[tuple(path[:i])][x])
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_mean_over_sampled_prefixes_is_the_joint_overlap(seed):
    """sum over x_1..x_s+1 of min(P, Q), by enumeration, against E_{x_1..x_s ~ P} of
    joint_overlap(p_s, q_s, log r) with r carried by next_log_ratio, every prefix weighted by its
    probability under P (exact, no sampling). Token 2 is outside the draft vocabulary."""
    vocab, draft, depth = 4, [0, 1, 3], 3
    p, q = _tables(vocab, draft, depth, seed)
    ids_of = {v: draft.index(v) if v in draft else -1 for v in range(vocab)}
    for s in range(depth):
        brute = sum(min(_joint(p, x), _joint(q, x)) for x in itertools.product(range(vocab), repeat=s + 1))
        prefixes = list(itertools.product(range(vocab), repeat=s))
        log_ratio = None
        for u in range(s):  # carry r along every prefix at once
            log_q = torch.stack([q[x[:u]][draft].log() for x in prefixes])  # [N, Vd]
            log_p = torch.tensor([float(p[x[:u]][x[u]].log()) for x in prefixes], dtype=torch.float64)
            ids = torch.tensor([ids_of[x[u]] for x in prefixes])
            log_ratio = next_log_ratio(log_ratio, log_q, log_p, ids)
        overlap = joint_overlap(torch.stack([p[x][draft] for x in prefixes]),
                                torch.stack([q[x][draft] for x in prefixes]), log_ratio)
        weights = torch.tensor([_joint(p, x) for x in prefixes], dtype=torch.float64)
        assert float((weights * overlap).sum()) == pytest.approx(brute, abs=1e-12)
        if s == 0:
            assert brute == pytest.approx(float(torch.minimum(p[()], q[()]).sum()), abs=1e-12)
    # the joint overlap of two tokens is not the product of the per-token ones (what token-level
    # verification accepts): the objective differs from "tv" past the first step
    per_token = float(torch.minimum(p[()], q[()]).sum())
    two = sum(min(_joint(p, x), _joint(q, x)) for x in itertools.product(range(vocab), repeat=2))
    assert two != pytest.approx(per_token * per_token, abs=1e-3)


def _slow_block(head, batch, steps: int, scale: float) -> list[float]:
    """1 - mean joint overlap per step from first principles, chain by chain: for each response
    position a chain starts at, the target's and the draft's softmaxes per step (as
    test_drafter_objective's reference builds them), the ratio r of the sampled tokens' draft and
    target probabilities before the step, sum_v min(p_v, r q_v)."""
    emb = head.embed_tokens.weight
    outs = ttt_forward(head, batch, steps)
    draft_ids = head.target_ids.tolist()
    width = batch.tokens.shape[1]
    totals, counts = [0.0] * steps, [0] * steps
    for r in range(batch.tokens.shape[0]):
        for col in range(width - 1):
            if not batch.lossable[r, col + 1]:
                continue  # a chain starts where the target predicts a response token
            ratio = 1.0
            for s, (first, hidden) in enumerate(outs):
                k = col + 1 + s  # the target position step s is scored against
                if k >= width or not batch.lossable[r, k] or col < first:
                    break
                p_all = torch.softmax(batch.final[r, k] @ emb.T, -1)
                q = torch.softmax(scale * head.logits_from_hidden(hidden[r, col - first]), -1)
                totals[s] += float(torch.minimum(p_all[head.target_ids], ratio * q).sum())
                counts[s] += 1
                x = int(batch.tokens[r, k + 1])  # the token the target sampled there
                qx = float(q[draft_ids.index(x)]) if x in draft_ids else 0.0
                ratio *= qx / float(p_all[x])
    return [1 - t / n for t, n in zip(totals, counts)]


def test_block_loss_matches_a_slow_reference_and_starts_as_tv():
    target = tiny_target(init_range=0.3)
    data = tiny_data(target, n=8)
    head = make_head(target, data).eval()
    batch = collate(data, list(range(8)))
    assert not bool(head.t2d[batch.tokens[batch.lossable]].all())  # some sampled tokens lie outside
    with torch.no_grad():
        loss, per_step = ttt_loss(head, batch, 4, 0.9, "block", scale=1.3)
        slow = _slow_block(head, batch, 4, 1.3)
        tv_loss, tv_steps = ttt_loss(head, batch, 4, 0.9, "tv", scale=1.3)
        acc = ttt_acceptance(head, batch, 4, scales=(1.0, 1.3), block=True)
        alone = ttt_acceptance(head, batch, 4, scales=(1.0,), block=True)  # each scale as if alone
    assert torch.allclose(acc["acc_block"][0], alone["acc_block"][0], atol=1e-5)
    assert torch.equal(acc["count_block"], alone["count_block"])
    assert per_step == pytest.approx(slow, abs=1e-5)
    assert float(loss) == pytest.approx(sum(0.9**s * v for s, v in enumerate(slow)), abs=1e-5)
    assert per_step[0] == pytest.approx(tv_steps[0], abs=1e-6)  # step 0: r = 1, the T = 1 overlap
    assert all(abs(b - t) > 1e-3 for b, t in zip(per_step[1:], tv_steps[1:]))  # a joint, not a per-token overlap
    block = acc["acc_block"][1] / acc["count_block"]
    assert [float(a) for a in block] == pytest.approx([1 - v for v in slow], abs=1e-5)
    assert estimated_block_tau(block) == pytest.approx(1 + sum(1 - v for v in slow), abs=1e-4)


def test_block_gradients_are_finite_with_tokens_outside_the_draft_vocabulary():
    target = tiny_target(init_range=0.3)
    data = tiny_data(target, n=8)
    head = make_head(target, data, vd=60)  # half the vocabulary: many sampled tokens outside
    batch = collate(data, list(range(8)))
    loss, _ = ttt_loss(head, batch, 4, 1.0, "block", scale=1.0)
    loss.backward()
    grads = [p.grad for p in head.parameters() if p.grad is not None]
    assert grads and all(bool(torch.isfinite(g).all()) for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)


def test_block_training_raises_the_joint_acceptance(tmp_path):
    target = tiny_target(init_range=0.3)
    data = tiny_data(target, n=16)
    cfg = DrafterConfig(draft_vocab_size=120, batch_size=8, epochs=20, lr=3e-3, warmup_steps=2, ttt_steps=3,
                        step_weight=1.0, out_dir=str(tmp_path / "block"), objective="block",
                        data=DrafterDataConfig(greedy_fraction=0.0))
    head = make_head(target, data)
    before = evaluate(head, data, cfg, torch.device("cpu"))["arithmetic"]["est_tau_block"]
    train_drafter(cfg, head, data, progress=False, log=lambda *_: None)
    after = evaluate(head, data, cfg, torch.device("cpu"))["arithmetic"]
    assert after["est_tau_block"] > before + 0.1, (before, after)


def test_block_objective_needs_sampled_responses():
    with pytest.raises(ConfigError, match="data.greedy_fraction"):
        DrafterConfig(objective="block")  # the default data answers a quarter greedily
    assert DrafterConfig(objective="block", data=DrafterDataConfig(greedy_fraction=0.0)).objective == "block"
    cfg = from_dict(DrafterConfig, load_yaml("configs/drafter_finetune_block.yaml"))
    assert (cfg.objective, cfg.data.greedy_fraction, cfg.step_weight, cfg.init_head) == ("block", 0.0, 1.0, "default")
