"""Block verification of sampled trees (``verifiers/block_tree.py``): its implementations
against each other. The law itself is checked in ``test_block_tree.py``.

- a tree whose nodes each have one child is block verification of the chain, token for token;
- the batched PyTorch walk (on CUDA too, marker ``gpu``) and the C++ kernel equal the row-by-row walk on
  the same uniforms;
- bad input is refused.
"""

from __future__ import annotations

import math

import pytest
import torch
from verifier_cases import on_devices

from verifiers.block_tree import verify_block_tree, walk_row


def test_one_child_per_node_is_block_verification_of_the_chain():
    """A chain (one child a node) walks as ``verify_chain(..., test='block')`` on the same uniforms."""
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 4, 50
    target = torch.randn(b, k + 1, v, generator=g) * 2
    draft = torch.randn(b, k + 1, v, generator=g) * 2
    probs = torch.softmax(draft[:, :k], -1)
    drafts = torch.stack([torch.multinomial(probs[:, j], 1, generator=g)[:, 0] for j in range(k)], 1)
    tokens = torch.cat([torch.zeros(b, 1, dtype=torch.long), drafts], 1)
    children = [[j + 1] for j in range(k)] + [[]]
    depths = list(range(k + 1))
    state = g.get_state()
    out, emitted, logp, kinds, _ = verify_block_tree(target, draft, tokens, children, depths, temperature=1.0,
                                                     top_k=None, top_p=None, generator=g)
    # the chain verifier draws u_block [B, K+1] then u_final [B]; rebuild those from our uniforms
    g.set_state(state)
    u_block = torch.rand(b, k + 1, k + 1, generator=g, dtype=torch.float64)[:, 0]
    torch.rand(b, k + 1, 1, generator=g)
    u_final = torch.rand(b, generator=g)
    from verifiers import block

    ref_tokens, ref_n, ref_lp = block._rows(target, draft[:, :k], drafts, u_block, u_final, 1.0, None, None)
    assert torch.equal(emitted, ref_n + 1)
    for row in range(b):
        m = int(emitted[row])
        assert out[row, :m].tolist() == ref_tokens[row, :m].tolist()
        assert torch.allclose(logp[row, :m], ref_lp[row, :m].float(), atol=1e-5)


def test_bad_input_is_refused():
    g = torch.Generator().manual_seed(0)
    target, draft = torch.randn(1, 3, 5), torch.randn(1, 3, 5)
    tokens = torch.tensor([[0, 1, 2]])
    children, depths = [[1, 2], [], []], [0, 1, 1]
    with pytest.raises(ValueError, match="temperature"):
        verify_block_tree(target, draft, tokens, children, depths, temperature=0.0, top_k=None, top_p=None,
                          generator=g)
    with pytest.raises(ValueError, match=r"\[B, N\+1, V\]"):
        verify_block_tree(target, draft[:, :2], tokens, children, depths, temperature=1.0, top_k=None,
                          top_p=None, generator=g)
    hole = draft.clone()
    hole[0, 0, 2] = -math.inf
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_block_tree(target, hole, tokens, children, depths, temperature=1.0, top_k=None, top_p=None,
                          generator=g)
    bad = target.clone()
    bad[0, 1, 3] = math.nan
    with pytest.raises(ValueError, match="target_logits"):
        verify_block_tree(bad, draft, tokens, children, depths, temperature=1.0, top_k=None, top_p=None,
                          generator=g)


@on_devices(cpu_backends=("torch",))  # the walk is PyTorch code on every device: one CPU run
@pytest.mark.parametrize("total,depth,top_k", [(8, 5, 3), (10, 4, 4)])
def test_batched_walk_equals_the_row_by_row_walk(total, depth, top_k, device):
    """``walk_rows`` (the rows grouped by the node their walk starts at; the walk other devices
    take) on ``device`` against ``walk_row`` on the CPU, the plain loop of the module docstring,
    on the same uniforms: the same tokens, kinds and paths."""
    from rollout.engine.sampled_tree import sampled_shape
    from verifiers.block_tree import walk_rows
    from verifiers.sampled import draw_without_replacement

    shape = sampled_shape(total, depth, top_k)
    children, depths = [list(c) for c in shape.children], list(shape.depths)
    g = torch.Generator().manual_seed(total)
    b, v, n1 = 300, 40, shape.size
    draft = torch.randn(b, n1, v, generator=g, dtype=torch.float64) * 2
    target = draft + torch.randn(b, n1, v, generator=g, dtype=torch.float64) * 0.7
    tokens = torch.zeros(b, n1, dtype=torch.long)
    for node, kids in enumerate(children):
        if kids:
            tokens[:, kids] = draw_without_replacement(draft[:, node][:, None], len(kids), 1.0, g)[:, 0]
    p, q = torch.softmax(target, -1), torch.softmax(draft, -1)
    w = max(depths) + 1
    u_block = torch.rand(b, w, w, generator=g, dtype=torch.float64)
    u_sibling = torch.rand(b, w, top_k, generator=g, dtype=torch.float64)
    u_final = torch.rand(b, generator=g)
    out, emitted, kinds, path = (x.cpu() for x in walk_rows(*(t.to(device) for t in (p, q, tokens)), children, depths,
                                                            *(t.to(device) for t in (u_block, u_sibling, u_final))))
    spares = 0
    for row in range(b):
        ref = walk_row(p[row], q[row], tokens[row], children, depths, u_block[row], u_sibling[row],
                       float(u_final[row]))
        m = len(ref.tokens)
        assert int(emitted[row]) == m
        assert out[row, :m].tolist() == ref.tokens and kinds[row, :m].tolist() == ref.kinds
        assert path[row, :m].tolist() == ref.path
        spares += any(shape.ranks[node] > 0 for node in ref.path)
    assert spares > 20  # rows whose walk went through a spare child


@pytest.mark.parametrize("b,v,temperature,top_p", [(200, 60, 1.0, None), (3, 49152, 0.8, None), (40, 300, 1.0, 0.9)])
def test_the_cpp_walk_equals_the_pytorch_walk(b, v, temperature, top_p):
    """The fused walk (``csrc/block_tree.cpp``) and the PyTorch one on the same uniforms: the same
    tokens, kinds and paths, log-probs to float32 rounding; at the shipped vocabulary size too."""
    from rollout.engine.sampled_tree import sampled_shape
    from verifiers import native
    from verifiers.sampled import draw_without_replacement

    shape = sampled_shape(8, 5, 3)
    children, depths = [list(c) for c in shape.children], list(shape.depths)
    g = torch.Generator().manual_seed(v)
    n1 = shape.size
    draft = torch.randn(b, n1, v, generator=g) * 2
    target = draft + torch.randn(b, n1, v, generator=g) * 0.7
    tokens = torch.zeros(b, n1, dtype=torch.long)
    for node, kids in enumerate(children):
        if kids:
            tokens[:, kids] = draw_without_replacement(draft[:, node][:, None], len(kids), temperature, g)[:, 0]
    outs = []
    for use in (True, False):
        with native.forced(use):
            outs.append(verify_block_tree(target, draft, tokens, children, depths, temperature=temperature, top_k=None,
                                          top_p=top_p, generator=torch.Generator().manual_seed(1)))
    (t1, e1, l1, k1, p1), (t2, e2, l2, k2, p2) = outs
    assert torch.equal(e1, e2) and torch.equal(t1, t2) and torch.equal(k1, k2) and torch.equal(p1, p2)
    assert torch.allclose(l1, l2, atol=2e-4)
    assert float((e1 - 1).double().mean()) > 0.5 and bool((p1 > 0).any())
