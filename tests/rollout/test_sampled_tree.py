"""Trees of sampled candidates (rollout/sampled_tree.py): the fixed shape, and the drafted tree
against cache-free recomputations (every node's draft logits are its path's, every child was
drawn from its parent's q, distinct siblings, the ancestor mask)."""

from __future__ import annotations

import pytest
import torch
from test_engine_draft import reference_draft_logits
from test_engine_utils import single_thread, tiny_target, trained_head  # noqa: F401

from rollout.runner import ModelRunner
from rollout.sampled_tree import Shape, draft_sampled_tree, draft_steps, sampled_shape


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
