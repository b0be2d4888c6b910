"""The draft side of the engine against cache-free recomputations: the draft logits of
every chain position, the nodes of an EAGLE-2 tree, and the tree's structure."""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import PROMPTS, single_thread, tiny_target, trained_head  # noqa: F401

from rollout.engine.engine import Engine
from rollout.engine.runner import ModelRunner
from rollout.engine.tree import draft_tree
from rollout.params import SamplingParams, SpecConfig


@pytest.fixture(scope="module")
def models(single_thread):
    target = tiny_target(vocab=64, seed=7)
    return target, trained_head(target, draft_vocab=40, seed=8)


def reference_draft_logits(target, head, seq: list[int], path: list[int]) -> torch.Tensor:
    """Draft logits [Vd] after the committed sequence ``seq`` (its last token pending) and
    the speculative tokens ``path``, recomputed from scratch: pairs (x_{j+1}, f_j) at
    positions j, then each path token with the previous output hidden."""
    n = len(seq) - 1
    with torch.no_grad():
        feats = target(torch.tensor([seq]), use_cache=False).features  # [1, n+1, 3H]
        mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
        d = head(torch.tensor([seq[1:]]), feats[:, :n], torch.arange(n)[None], mask)
        logits, hidden, past = d.logits[:, -1:], d.hidden[:, -1:], d.kv
        for s, tok in enumerate(path, start=1):
            mask = torch.ones(1, 1, past[0].shape[2] + 1, dtype=torch.bool)
            d = head(torch.tensor([[tok]]), hidden, torch.tensor([[n - 1 + s]]), mask, past)
            logits, hidden, past = d.logits, d.hidden, d.kv
    return logits[0, 0]


def test_chain_draft_logits_match_recomputation(models):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=(3,))
    res = engine.generate(PROMPTS * 2, sampling, SpecConfig(mode="chain", num_draft_tokens=4), seed=4, debug=True)
    checked = 0
    for rec in res.debug:
        if rec.draft_logits is None:
            continue
        comp = res.completions[rec.row]
        start = rec.index - rec.step_position
        seq = comp.prompt_ids + comp.completion_ids[:start]
        ref = head.to_target_logits(reference_draft_logits(target, head, seq, comp.completion_ids[start:rec.index]))
        finite = torch.isfinite(ref)
        assert torch.equal(finite, torch.isfinite(rec.draft_logits))
        torch.testing.assert_close(rec.draft_logits[finite], ref[finite], atol=1e-4, rtol=1e-4)
        checked += 1
    assert checked > 40 and any(r.step_position >= 2 for r in res.debug if r.draft_logits is not None)


@pytest.mark.parametrize("depth,top_k,total", [(3, 3, 10), (4, 2, 7), (2, 4, 20)])
def test_tree_nodes_are_top_k_children_of_their_parents(models, depth, top_k, total):
    target, head = models
    prompts = [[4, 9, 1, 30, 2], [17, 5]]
    runner = ModelRunner(target, head)
    with torch.inference_mode():
        first = runner.start(prompts, capacity=64).argmax(-1)
        runner.set_first_tokens(first)
        tree = draft_tree(runner, runner.pending, depth, top_k, total)
    assert tree.tokens.shape == (2, total + 1)
    for b, prompt in enumerate(prompts):
        seq = prompt + [int(first[b])]
        parents, tokens = tree.parents[b].tolist(), tree.tokens[b].tolist()
        assert parents[0] == -1 and tokens[0] == seq[-1]
        for i in range(1, total + 1):
            path, node = [], parents[i]
            assert 0 <= node < i, "parents precede children"
            while node > 0:
                path.insert(0, tokens[node])
                node = parents[node]
            assert int(tree.depths[b, i]) == len(path) + 1
            ref = reference_draft_logits(target, head, seq, path)
            allowed = runner.draft_ids[ref.topk(top_k).indices].tolist()
            assert tokens[i] in allowed
            ancestors = {i}
            node = parents[i]
            while node >= 0:
                ancestors.add(node)
                node = parents[node]
            assert set(tree.mask[b, i].nonzero()[:, 0].tolist()) == ancestors
        for i in range(total + 1):
            kids = [c for c in tree.children[b, i].tolist() if c >= 0]
            assert kids == [c for c in range(total + 1) if parents[c] == i]


def test_tree_with_one_child_per_node_is_the_greedy_chain(models):
    target, head = models
    engine = Engine(target, head, num_threads=1)
    sampling = SamplingParams(temperature=0.5, max_new_tokens=30)
    chain = engine.generate(PROMPTS, sampling, SpecConfig(mode="chain", num_draft_tokens=4, draft_sampling="greedy"),
                            seed=9)
    tree = engine.generate(PROMPTS, sampling, SpecConfig(mode="tree", depth=4, top_k=1, total_tokens=4), seed=9)
    for a, b in zip(chain.completions, tree.completions):
        assert a.completion_ids == b.completion_ids
        assert a.step_emitted == b.step_emitted
    assert chain.tau > 1.05  # some drafts accepted: the equality covers multi-token rounds


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_drafts_follow_q(temperature):
    """sample_draft draws from q = softmax(scaled logits / T): chi-square over 60k draws per row,
    never an id with q = 0, the same draws for the same seed, any leading shape."""
    from scipy.stats import chisquare

    from rollout.engine.draft_sampling import sample_draft
    from verifiers.processing import draft_logits

    g = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(3, 2, 12, generator=g)
    logits[0, 0, 5] = logits[1, 1, 0] = logits[2, 0, 11] = float("-inf")  # q = 0, first and last ids too
    n = 60_000
    draws = sample_draft(logits[None].expand(n, -1, -1, -1), temperature, False, torch.Generator().manual_seed(1))
    assert draws.shape == (n, 3, 2)
    again = sample_draft(logits[None].expand(n, -1, -1, -1), temperature, False, torch.Generator().manual_seed(1))
    assert torch.equal(draws, again)
    q = torch.softmax(draft_logits(logits, temperature), -1).double()
    for b in range(3):
        for t in range(2):
            counts = torch.bincount(draws[:, b, t], minlength=12).double()
            assert bool((counts[q[b, t] == 0] == 0).all())
            keep = q[b, t] > 0
            assert chisquare(counts[keep], n * q[b, t][keep] / q[b, t][keep].sum()).pvalue > 1e-4


def test_greedy_and_cold_drafts_are_the_argmax():
    from rollout.engine.draft_sampling import sample_draft

    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_draft(logits, 1.0, True, g), logits.argmax(-1))
    assert torch.equal(sample_draft(logits, 0.0, False, g), logits.argmax(-1))
