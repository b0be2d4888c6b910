"""Trees of sampled candidates (rollout/engine/sampled_tree.py): the fixed shape, and the drafted tree
against cache-free recomputations (every node's draft logits are its path's, every child was
drawn from its parent's q, distinct siblings, the ancestor mask)."""

from __future__ import annotations

import pytest
import torch
from test_engine_draft import reference_draft_logits
from test_engine_utils import single_thread, tiny_target, trained_head  # noqa: F401

from rollout.engine.runner import ModelRunner
from rollout.engine.sampled_tree import Shape, draft_sampled_tree, draft_steps, sampled_shape


def paths(shape: Shape) -> list[tuple[int, ...]]:
    """Each node's rank path (root: ())."""
    out: list[tuple[int, ...]] = [()]
    for node in range(1, shape.size):
        parent = shape.parents[node]
        out.append(out[parent] + (shape.children[parent].index(node),))
    return out


def test_shape_keeps_the_best_rank_paths():
    rho = (0.6, 0.1, 0.05)
    shape = sampled_shape(8, 6, 3, rho)
    value = {p: torch.tensor([rho[r] for r in p]).prod().item() for p in paths(shape)[1:]}
    # the spine to depth 5 (0.6^5 = 0.078) and the three paths worth 0.1 / 0.06 / 0.06
    assert set(value) == {(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0), (1,), (0, 1), (1, 0)}
    assert all(shape.parents[i] < i for i in range(1, shape.size))
    spine = shape.max_depth + 1
    assert list(shape.depths[:spine]) == list(range(spine)), "the spine comes first"
    assert list(shape.depths[spine:]) == sorted(shape.depths[spine:])
    assert shape.expanded(0) == [0] and draft_steps(shape) == 5


def test_shape_limits_and_chain():
    chain = sampled_shape(5, 5, 1)
    assert chain.parents == (-1, 0, 1, 2, 3, 4) and chain.top_k == 1
    wide = sampled_shape(12, 2, 4, (0.5, 0.4, 0.3, 0.2))
    assert wide.max_depth <= 2 and wide.top_k <= 4 and wide.size == 13
    assert len(wide.children[0]) == 4
    with pytest.raises(ValueError, match="rank_accept"):
        sampled_shape(4, 3, 2, (0.1, 0.5))


@pytest.fixture(scope="module")
def models(single_thread):
    target = tiny_target(vocab=64, seed=7)
    return target, trained_head(target, draft_vocab=40, seed=8)


def test_drafted_nodes_match_recomputation(models):
    target, head = models
    prompts = [[4, 9, 1, 30, 2], [17, 5]]
    shape = sampled_shape(9, 4, 3, (0.5, 0.3, 0.2))
    runner = ModelRunner(target, head)
    with torch.inference_mode():
        first = runner.start(prompts, capacity=64).argmax(-1)
        runner.set_first_tokens(first)
        tree = draft_sampled_tree(runner, runner.pending, shape, 1.0, torch.Generator().manual_seed(0))
    assert tree.tokens.shape == (2, shape.size) and tree.draft_logits.shape == (2, shape.size, 40)
    for b, prompt in enumerate(prompts):
        seq = prompt + [int(first[b])]
        tokens = tree.tokens[b].tolist()
        for node in range(shape.size):
            kids = shape.children[node]
            assert [c for c in tree.children.expand(2, -1, -1)[b, node].tolist() if c >= 0] == list(kids)
            path, up = [], node
            while up > 0:
                path.insert(0, tokens[up])
                up = shape.parents[up]
            ancestors = {node} | {n for n in range(shape.size) if _is_ancestor(shape, n, node)}
            assert set(tree.mask[b, node].nonzero()[:, 0].tolist()) == ancestors
            if not kids:
                continue
            ref = reference_draft_logits(target, head, seq, path)
            torch.testing.assert_close(tree.draft_logits[b, node], ref, atol=1e-4, rtol=1e-4)
            child_tokens = [tokens[c] for c in kids]
            assert len(set(child_tokens)) == len(kids), "siblings are distinct"
            assert set(child_tokens) <= set(runner.draft_ids.tolist())


def _is_ancestor(shape: Shape, a: int, node: int) -> bool:
    while node > 0:
        node = shape.parents[node]
        if node == a:
            return True
    return False


def test_shape_planner_counts_trials_and_accepts_by_rank():
    """observe: every node a row's walk reached counts a trial for each of its candidates' ranks;
    the node the walk moved to counts an acceptance for its rank."""
    from rollout.engine.sampled_tree import ShapePlanner

    planner = ShapePlanner(5, 4, 2)
    shape = planner.shape
    second = shape.children[0][1]  # the root's rank-1 child
    spine1 = shape.children[0][0]
    # row 0: root -> its second child, then a recovered token there (2 tokens);
    # row 1: root -> first child -> recovered (2 tokens); row 2: nothing accepted (1 token)
    path = torch.tensor([[0, second, 0, 0, 0], [0, spine1, 0, 0, 0], [0, 0, 0, 0, 0]])
    planner.observe(path, [2, 2, 1])
    kids = [len(shape.children[v]) for v in (0, second, 0, spine1, 0)]
    assert planner.trials == [sum(k > 0 for k in kids), sum(k > 1 for k in kids)]
    assert planner.accepts == [1.0, 1.0]


def test_shape_planner_replans_from_measured_rates(monkeypatch):
    """A head whose second candidates are never accepted gets a chain after enough rounds; one
    whose first candidates always are gets the deepest spine; rates never increase with rank."""
    from rollout.engine import sampled_tree
    from rollout.engine.sampled_tree import ShapePlanner

    planner = ShapePlanner(6, 6, 3)
    assert len(planner.shape.children[0]) > 1  # the default rates give the root siblings
    for _ in range(sampled_tree.REPLAN_ROUNDS * 10):  # every round: the current shape's spine accepted
        spine = [0]
        while planner.shape.children[spine[-1]]:
            spine.append(planner.shape.children[spine[-1]][0])
        planner.observe(torch.tensor([spine + [0] * (8 - len(spine))]), [len(spine)])
    rates = planner.rates()
    # (once the shape is a chain no node tries a second candidate: that rate stops moving)
    assert rates[0] > 0.9 and rates[1] < sampled_tree.RANK_ACCEPT[1] and list(rates) == sorted(rates, reverse=True)
    assert planner.shape.parents == sampled_shape(6, 6, 1).parents  # a chain of 6
    assert planner.rounds == sampled_tree.REPLAN_ROUNDS * 10
