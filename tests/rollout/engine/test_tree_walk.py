"""``rollout.engine.tree.walk`` on hand-built trees (no model): every emitted token's kind, path and
behaviour log-prob follow the candidate procedure at the node it was emitted from (the closed
form ``induced_candidates`` there; a leaf's bonus token: P = p)."""

from __future__ import annotations

import pytest
import torch

from rollout.engine.tree import Tree, _ancestor_mask, _children, chain_tree, walk
from verifiers import TokenKind, get_rule, induced_candidates, target_logprobs


def _check_walk(rule, tree: Tree, logits: torch.Tensor, temperature: float) -> torch.Tensor:
    res = walk(rule, tree, logits, temperature=temperature, top_k=None, top_p=None,
               generator=torch.Generator().manual_seed(0))
    b = logits.shape[0]
    children = tree.children.expand(b, -1, -1)
    for r in range(b):
        n = int(res.num_emitted[r])
        node = 0
        for level in range(n):
            assert int(res.path[r, level]) == node
            kids = children[r, node]
            cands = torch.where(kids >= 0, tree.tokens[r].gather(0, kids.clamp(min=0)), -1)
            y = int(res.tokens[r, level])
            P = induced_candidates(rule, logits[r, node][None], cands[None], temperature=temperature)[0]
            assert float(res.behaviour_logprobs[r, level]) == pytest.approx(float(P[y].log()), abs=1e-5)
            p = target_logprobs(logits[r, node], temperature)
            assert float(res.target_logprobs[r, level]) == pytest.approx(float(p[y]), abs=1e-5)
            hit = ((cands == y) & (kids >= 0)).nonzero()
            if level < n - 1:  # an accepted child: the walk moves there
                assert int(res.kinds[r, level]) == TokenKind.ACCEPTED and len(hit) == 1
                node = int(kids[hit[0, 0]])
            elif (kids < 0).all():  # a leaf: the bonus token
                assert int(res.kinds[r, level]) == TokenKind.BONUS
            else:  # every candidate rejected: a recovered token from the fallback
                assert int(res.kinds[r, level]) == TokenKind.RECOVERED
        assert (res.kinds[r, n:] == TokenKind.PAD).all() and (res.tokens[r, n:] == -1).all()
    return res.kinds


@pytest.mark.parametrize("rule", [get_rule("lossless"), get_rule("mars", theta=0.8),
                                  get_rule("overshoot", lenience=0.5)], ids=["lossless", "mars", "overshoot"])
def test_chain_tree_walk_kinds_and_logprobs(rule):
    g = torch.Generator().manual_seed(1)
    b, k, v = 48, 2, 6
    logits = torch.randn(b, k + 1, v, generator=g) + 6  # positive: MARS relaxes somewhere
    drafts = logits[:, :k].argmax(-1)  # likely accepted: some rows reach the leaf
    drafts[::3, 0] = (drafts[::3, 0] + 1) % v
    tree = chain_tree(torch.zeros(b, dtype=torch.long), drafts)
    kinds = _check_walk(rule, tree, logits, 0.8)
    for kind in (TokenKind.ACCEPTED, TokenKind.RECOVERED, TokenKind.BONUS):
        assert (kinds == kind).any(), kind


def test_branching_tree_walk_kinds_and_logprobs():
    """Root with children 1, 2; node 1 with child 3; nodes 2 and 3 leaves."""
    parents = torch.tensor([[-1, 0, 0, 1]])
    b, v = 64, 5
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(b, 4, v, generator=g) * 1.5
    tokens = torch.stack([torch.zeros(b, dtype=torch.long), torch.full((b,), 1), torch.full((b,), 3),
                          torch.randint(0, v, (b,), generator=g)], 1)
    tree = Tree(tokens=tokens, parents=parents.expand(b, -1), depths=torch.tensor([[0, 1, 1, 2]]),
                children=_children(parents, 2), mask=_ancestor_mask(parents, 2).expand(b, -1, -1), max_depth=2)
    kinds = _check_walk(get_rule("lossless"), tree, logits, 1.0)
    for kind in (TokenKind.ACCEPTED, TokenKind.RECOVERED, TokenKind.BONUS):
        assert (kinds == kind).any(), kind


def test_sampled_tree_walk_flags_and_logprobs():
    """``walk_sampled`` (the fused walk of a sampled tree, here built by hand with the identity
    draft vocabulary) towards MARS's chain law: log P(y) is log P_R(y) at the node it was emitted
    from (p at a leaf), and ``relaxed`` marks exactly the accepted tokens with P_R(y) > p(y)."""
    from rollout.engine.sampled_tree import fused_walk_usable, walk_sampled
    from verifiers import native
    from verifiers.processing import draft_probs, target_probs
    from verifiers.sampled import chain_law, draw_without_replacement

    if not native.enabled():
        pytest.skip("the fused C++ verifier is not built")
    rule = get_rule("mars", theta=0.8)
    parents = torch.tensor([[-1, 0, 0, 1]])
    b, v = 64, 6
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(b, 4, v, generator=g) + 6
    draft = logits + torch.randn(b, 4, v, generator=g)
    tokens = torch.zeros(b, 4, dtype=torch.long)
    tokens[:, 1:3] = draw_without_replacement(draft[:, 0], 2, 1.0, g)
    tokens[:, 3] = draw_without_replacement(draft[:, 1], 1, 1.0, g)[:, 0]
    tree = Tree(tokens=tokens, parents=parents.expand(b, -1), depths=torch.tensor([[0, 1, 1, 2]]),
                children=_children(parents, 2), mask=_ancestor_mask(parents, 2).expand(b, -1, -1), max_depth=2,
                draft_logits=draft, to_target=lambda t: t, draft_ids=torch.arange(v))
    assert fused_walk_usable(tree, rule, logits.device)
    res = walk_sampled(rule, tree, logits, temperature=1.0, top_k=None, top_p=None,
                       generator=torch.Generator().manual_seed(0))
    for r in range(b):
        for level in range(int(res.num_emitted[r])):
            node, y = int(res.path[r, level]), int(res.tokens[r, level])
            p = target_probs(logits[r, node][None], 1.0)
            has_kids = bool((tree.children[0, node] >= 0).any())
            law = chain_law(rule, logits[r, node][None], p, draft_probs(draft[r, node][None], 1.0))[0] if has_kids \
                else p[0]
            assert float(res.behaviour_logprobs[r, level]) == pytest.approx(float(law[y].log()), abs=1e-5)
            accepted = int(res.kinds[r, level]) == TokenKind.ACCEPTED
            assert bool(res.relaxed[r, level]) == (accepted and float(law[y]) > float(p[0, y]) * (1 + 1e-6))
    recovered_above_p = (res.kinds == TokenKind.RECOVERED) & (res.behaviour_logprobs > res.target_logprobs)
    assert res.relaxed.any() and recovered_above_p.any()
