"""The vLLM plug-in's math without vLLM: vLLM's flattened step layout -> our verifiers and back.

A step is built per request first ([K_r + 1, V] target logits, K_r drafts, q) and then flattened
the way vLLM's model runner hands it to the rejection sampler (rows of each request contiguous,
drafted positions then the bonus position; ``target_logits_indices`` / ``bonus_logits_indices``).
``verify_flat`` must give each request exactly what ``verify_chain`` (sampled drafts) or the
candidate walk (greedy drafts) give that request's own tensors, on the same uniforms.
"""

from __future__ import annotations

import pytest
import torch

from rollout.engine.tree import chain_tree, walk
from rollout.vllm.layout import request_settings
from rollout.vllm.verify import decode_rank, encode_rank, verify_flat
from verifiers import get_rule, verify_chain

V = 12
RULES = [("lossless", {}), ("mars", {"theta": 0.5}), ("overshoot", {"lenience": 0.5}),
         ("overshoot", {"lenience": 0.5, "min_p": 0.2}), ("typical", {}), ("min_p", {"p_base": 0.1})]


def _requests(ks: list[int], seed: int):
    g = torch.Generator().manual_seed(seed)
    reqs = []
    for k in ks:
        target = torch.randn(k + 1, V, generator=g) * 2
        q = torch.softmax(torch.randn(k, V, generator=g) * 2, -1)
        x = torch.multinomial(q, 1, generator=g).squeeze(-1) if k else torch.zeros(0, dtype=torch.long)
        reqs.append((target, q, x))
    return reqs


def _flatten(reqs):
    """vLLM's layout: logits [T + R, V], target / bonus indices, draft ids [T], q [T, V]."""
    logits, tgt_idx, bonus_idx, ids, probs = [], [], [], [], []
    row = 0
    for target, q, x in reqs:
        k = x.shape[0]
        logits.append(target)
        tgt_idx += list(range(row, row + k))
        bonus_idx.append(row + k)
        ids.append(x)
        probs.append(q)
        row += k + 1
    return (torch.cat(logits), torch.tensor(tgt_idx, dtype=torch.int32), torch.tensor(bonus_idx, dtype=torch.int32),
            torch.cat(ids).to(torch.int32), None if probs[0] is None else torch.cat(probs))


def _expected_sampled(rule, reqs, order, temperature, seed, test: str = "rule"):
    """Per group (requests with equal K, in first-appearance order) through verify_chain."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for group in order:
        target = torch.stack([reqs[i][0] for i in group])
        q = torch.stack([reqs[i][1] for i in group])
        x = torch.stack([reqs[i][2] for i in group])
        if x.shape[1] == 0:
            tree = chain_tree(torch.zeros(len(group), dtype=torch.long), x)
            res = walk(rule, tree, target, temperature=temperature, top_k=None, top_p=None, generator=g)
        else:
            res = verify_chain(rule, target, q.log() * temperature, x, temperature=temperature, generator=g, test=test)
        for j, i in enumerate(group):
            out[i] = (res.tokens[j], res.behaviour_logprobs[j], res.target_logprobs[j], res.kinds[j].long())
    return out


@pytest.mark.parametrize("name,params,test", [(name, params, test) for test in ("rule", "law") for name, params in RULES]
                         + [("lossless", {}, "block")])
def test_sampled_drafts_match_verify_chain_per_request(name, params, test):
    """(``test``: VerifierConfig.test, which the plug-in's state hands to verify_flat; ``block``
    for the lossless rule only.)"""
    rule = get_rule(name, **params)
    ks = [3, 2, 3, 0, 2]
    reqs = _requests(ks, seed=7)
    logits, tgt_idx, bonus_idx, ids, probs = _flatten(reqs)
    t = 0.8
    out = verify_flat(rule, ks, logits, tgt_idx, bonus_idx, ids, probs, torch.full((5,), t), None, None,
                      torch.Generator().manual_seed(3), test=test)
    exp = _expected_sampled(rule, reqs, [[0, 2], [1, 4], [3]], t, seed=3, test=test)
    assert out["tokens"].shape == (5, 4) and out["tokens"].dtype == torch.int32
    for i, k in enumerate(ks):
        tok, beh, tgt, kinds = exp[i]
        n = int((tok >= 0).sum())
        assert out["tokens"][i, :n].long().tolist() == tok[:n].tolist()
        assert (out["tokens"][i, n:] == -1).all()
        torch.testing.assert_close(out["behaviour"][i, :n], beh[:n])
        torch.testing.assert_close(out["target"][i, :n], tgt[:n])
        assert out["kinds"][i, :n].tolist() == kinds[:n].tolist()


def test_greedy_drafts_match_the_candidate_walk():
    rule = get_rule("mars", theta=0.5)
    ks = [3, 3, 1]
    reqs = _requests(ks, seed=11)
    logits, tgt_idx, bonus_idx, ids, _ = _flatten(reqs)
    out = verify_flat(rule, ks, logits, tgt_idx, bonus_idx, ids, None, torch.ones(3), None, None,
                      torch.Generator().manual_seed(5))
    g = torch.Generator().manual_seed(5)
    for group in ([0, 1], [2]):
        target = torch.stack([reqs[i][0] for i in group])
        x = torch.stack([reqs[i][2] for i in group])
        res = walk(rule, chain_tree(torch.zeros(len(group), dtype=torch.long), x), target,
                   temperature=1.0, top_k=None, top_p=None, generator=g)
        for j, i in enumerate(group):
            w = x.shape[1] + 1
            assert out["tokens"][i, :w].long().tolist() == res.tokens[j].tolist()
            torch.testing.assert_close(out["behaviour"][i, :w], res.behaviour_logprobs[j])


def test_greedy_temperature_emits_argmax_prefix():
    rule = get_rule("lossless")
    reqs = _requests([3], seed=2)
    target, _, _ = reqs[0]
    x = target[:3].argmax(-1).clone()
    x[2] = (x[2] + 1) % V  # the third draft is wrong
    logits, tgt_idx, bonus_idx, _, _ = _flatten([(target, None, x)])
    out = verify_flat(rule, [3], logits, tgt_idx, bonus_idx, x.to(torch.int32), None, None, None, None,
                      torch.Generator())
    assert out["tokens"][0].tolist() == target.argmax(-1)[:3].tolist() + [-1]
    assert out["kinds"][0].tolist() == [0, 0, 1, -1]
    assert (out["behaviour"][0, :3] == 0).all()


def test_request_settings_decode_vllm_conventions():
    s = request_settings([3, 2, 1], torch.tensor([1.0, 0.0, 0.7]), torch.tensor([V, 5, 0]),
                         torch.tensor([1.0, 0.9, 0.5]), V)
    assert (s[0].temperature, s[0].top_k, s[0].top_p) == (1.0, None, None)
    assert (s[1].temperature, s[1].top_k, s[1].top_p) == (0.0, None, None)  # greedy: no truncation
    assert (s[2].k, s[2].top_k, s[2].top_p) == (1, None, 0.5)


def test_top_k_top_p_groups_use_processed_p():
    rule = get_rule("lossless")
    reqs = _requests([2, 2], seed=4)
    logits, tgt_idx, bonus_idx, ids, probs = _flatten(reqs)
    out = verify_flat(rule, [2, 2], logits, tgt_idx, bonus_idx, ids, probs, torch.ones(2),
                      torch.tensor([3, V]), torch.tensor([1.0, 1.0]), torch.Generator().manual_seed(0))
    top3 = reqs[0][0].topk(3, -1).indices
    n = int((out["tokens"][0] >= 0).sum())
    for j in range(n):
        tok = int(out["tokens"][0, j])
        if int(out["kinds"][0, j]) != 0:  # recovered / bonus come from the top-3-truncated p
            assert tok in top3[j].tolist()


def test_rank_code_round_trip():
    kinds = torch.tensor([0, 1, 2, 0, 1, 2])
    relaxed = torch.tensor([False, False, False, True, True, True])
    ranks = encode_rank(kinds, relaxed)
    assert (ranks < 0).all()
    assert [decode_rank(int(r)) for r in ranks] == [(0, False), (1, False), (2, False), (0, True), (1, True), (2, True)]
    assert decode_rank(1) is None and decode_rank(7) is None
