"""Draft trees: the EAGLE-2 dynamic tree, its attention mask, and the verification walk.

Vocabulary:
- **node**: a token in the verification block. Node 0 is the **root**, the row's pending
  token (already emitted, not yet run through the target); the other nodes are drafted.
  Nodes are ordered so that every parent precedes its children.
- **depth**: a node's distance from the root; its target position is the row length +
  depth. ``mask [B, N+1, N+1]`` is True where the query node may see the key node (its
  ancestors and itself); None means the block is a plain chain (causal).
- **children**: ``[B, N+1, k]`` node indices of each node's children in draft-score
  order, -1 padded. At a node the verifier examines these children's tokens as its
  deterministic candidates (or, in a tree of sampled candidates, ``rollout.engine.sampled_tree``,
  as candidates drawn from the node's q, in draw order).
- **score**: a drafted node's cumulative draft log-probability (sum along its path).
- **walk**: verification from the root down: at the current node the verifier either
  accepts one child (the walk moves there and emits its token) or emits a recovered
  token (none accepted; the walk ends); at a node without children it emits a bonus
  token sampled from p. Randomness enters only through the generator.

EAGLE-2 dynamic tree (``draft_tree``): the root's top-k draft tokens form level 1; at
each further level the k frontier nodes are expanded in one draft forward, each proposes
its top-k tokens, and the k best of those k*k candidates by score become the next
frontier. All generated nodes are then ranked by score and the best ``total_tokens`` are
verified (a node's score never exceeds its parent's, so the kept set is a tree).

A greedy-drafted chain is the tree with one child per node (``chain_tree``); plain
autoregressive decoding is the root-only tree (``root_tree``): the same walk serves all.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verifiers import TokenKind, verify_candidates
from verifiers.sampled import verify_sampled_candidates


@dataclass
class Tree:
    tokens: torch.Tensor  # [B, N+1] target ids; node 0 = root
    parents: torch.Tensor  # [B, N+1] parent node, -1 for the root
    depths: torch.Tensor  # [B|1, N+1] depth of each node (root 0)
    children: torch.Tensor  # [B|1, N+1, k] child nodes in draft-score order, -1 padded
    mask: torch.Tensor | None  # [B, N+1, N+1] ancestor-or-self; None = causal chain
    max_depth: int
    # sampled trees (rollout.engine.sampled_tree): [B, N+1, Vd] the draft logits each node's children
    # were drawn from, and the head's map to the target vocabulary; None: deterministic candidates
    draft_logits: torch.Tensor | None = None
    to_target: Callable[[torch.Tensor], torch.Tensor] | None = None
    draft_ids: torch.Tensor | None = None  # [Vd] the target id of each draft-vocabulary id

    @property
    def size(self) -> int:
        return self.tokens.shape[1]


def root_tree(root: torch.Tensor) -> Tree:
    """The one-node tree of plain autoregressive decoding; ``root [B]``."""
    dev = root.device
    return Tree(tokens=root[:, None], parents=torch.full((1, 1), -1, device=dev),
                depths=torch.zeros(1, 1, dtype=torch.long, device=dev),
                children=torch.full((1, 1, 1), -1, dtype=torch.long, device=dev), mask=None, max_depth=0)


def chain_tree(root: torch.Tensor, drafts: torch.Tensor) -> Tree:
    """A chain as a tree: ``root [B]`` then ``drafts [B, K]``, each node the next one's parent."""
    k = drafts.shape[1]
    dev = root.device
    nodes = torch.arange(k + 1, device=dev)
    children = torch.where(nodes < k, nodes + 1, -1)[None, :, None]  # [1, K+1, 1]
    return Tree(tokens=torch.cat([root[:, None], drafts], dim=1), parents=(nodes - 1)[None],
                depths=nodes[None], children=children, mask=None, max_depth=k)


def draft_tree(runner, root: torch.Tensor, depth: int, top_k: int, total_tokens: int) -> Tree:
    """Draft an EAGLE-2 dynamic tree for every row with the runner's head (draft step 0
    included); ``root [B]`` are the pending tokens."""
    k = top_k
    step0 = runner.draft_root()
    logits, hidden = step0.logits, step0.hidden  # [B, Vd], [B, H]
    b = logits.shape[0]
    score, ids = torch.log_softmax(logits, -1).topk(k, dim=-1)  # [B, k], descending
    gen_score, gen_ids = [score], [ids]
    gen_parent = [torch.full((b, k), -1, dtype=torch.long, device=logits.device)]
    gen_depth = [1] * k
    frontier = (torch.arange(k, device=logits.device).expand(b, k), ids, score)  # gen index, draft id, score
    f_hidden = hidden[:, None].expand(b, k, hidden.shape[-1])
    visible = None  # [B, k, S]: earlier speculative slots each frontier node sees
    offset = k
    for level in range(1, depth):
        f_gen, f_ids, f_score = frontier
        step = runner.draft_step(runner.draft_ids[f_ids], f_hidden, level, visible)
        lg, hd = step.logits, step.hidden  # [B, k, Vd], [B, k, H]
        s2, i2 = torch.log_softmax(lg, -1).topk(k, dim=-1)  # [B, k, k]
        cand_score = (f_score[:, :, None] + s2).reshape(b, k * k)
        gen_score.append(cand_score)
        gen_ids.append(i2.reshape(b, k * k))
        gen_parent.append(f_gen[:, :, None].expand(b, k, k).reshape(b, k * k))
        gen_depth += [level + 1] * (k * k)
        top_s, top_i = cand_score.topk(k, dim=-1)  # next frontier
        parent_local = top_i // k  # [B, k] which frontier node proposed it
        frontier = (offset + top_i, gen_ids[-1].gather(1, top_i), top_s)
        f_hidden = hd.gather(1, parent_local[:, :, None].expand(b, k, hd.shape[-1]))
        own = torch.nn.functional.one_hot(parent_local, k).bool()  # [B, k, k]: the parent's new slot
        visible = own if visible is None else torch.cat([visible.gather(
            1, parent_local[:, :, None].expand(b, k, visible.shape[-1])), own], dim=2)
        offset += k * k
    all_score, all_ids, all_parent = torch.cat(gen_score, 1), torch.cat(gen_ids, 1), torch.cat(gen_parent, 1)
    depth_of = torch.tensor(gen_depth, device=logits.device)
    return _select(root, runner.draft_ids, all_score, all_ids, all_parent, depth_of, total_tokens, k)


def _select(root, draft_ids, score, ids, parent, depth_of, n: int, k: int) -> Tree:
    """Keep the ``n`` best generated nodes (stable: a parent ranks before its children)."""
    b, g = score.shape
    n = min(n, g)
    keep = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n]
    keep = keep.sort(dim=1).values  # generation order: parents before children
    node_of = torch.full((b, g), -1, dtype=torch.long, device=score.device)
    node_of.scatter_(1, keep, torch.arange(1, n + 1, device=score.device).expand(b, n))
    par_gen = parent.gather(1, keep)
    par_node = torch.where(par_gen >= 0, node_of.gather(1, par_gen.clamp(min=0)), 0)  # [B, n]
    parents = torch.cat([torch.full((b, 1), -1, dtype=torch.long, device=score.device), par_node], 1)
    depths = torch.cat([torch.zeros(b, 1, dtype=torch.long, device=score.device), depth_of[keep]], 1)
    tokens = torch.cat([root[:, None], draft_ids[ids.gather(1, keep)]], 1)
    return Tree(tokens=tokens, parents=parents, depths=depths, children=_children(parents, k),
                mask=_ancestor_mask(parents, int(depths.max())), max_depth=int(depths.max()))


def _ancestor_mask(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """[B, T, T]: node i sees node j iff j is i or an ancestor of i."""
    b, t = parents.shape
    eye = torch.eye(t, dtype=torch.bool, device=parents.device).expand(b, t, t)
    par = parents.clamp(min=0)[:, :, None].expand(b, t, t)
    mask = eye
    for _ in range(max_depth):
        mask = eye | mask.gather(1, par)
    return mask


def _children(parents: torch.Tensor, k: int) -> torch.Tensor:
    """[B, T, k] children of each node in node order (= draft-score order among siblings)."""
    b, t = parents.shape
    dev = parents.device
    is_child = parents[:, :, None] == torch.arange(t, device=dev)[None, None, :]  # [B, child, parent]
    rank = is_child.long().cumsum(1).gather(2, parents.clamp(min=0)[:, :, None])[:, :, 0] - 1  # [B, T]
    children = torch.full((b, t * k), -1, dtype=torch.long, device=dev)
    flat = parents[:, 1:] * k + rank[:, 1:]
    children.scatter_(1, flat, torch.arange(1, t, device=dev).expand(b, t - 1))
    return children.view(b, t, k)


@dataclass
class WalkResult:
    """Per row: ``tokens/behaviour_logprobs/target_logprobs/kinds/relaxed [B, W]`` (W =
    max depth + 1; entries past ``num_emitted`` are padding), ``num_emitted [B]`` emitted
    tokens, ``path [B, W]`` the nodes whose output was used (root + accepted nodes). The
    fields are those of ``verifiers.ChainResult`` plus ``path``."""

    tokens: torch.Tensor
    num_emitted: torch.Tensor
    behaviour_logprobs: torch.Tensor
    target_logprobs: torch.Tensor
    kinds: torch.Tensor
    relaxed: torch.Tensor
    path: torch.Tensor


def record_level(record: list, level: int, rows: torch.Tensor, nodes: torch.Tensor, target_logits: torch.Tensor,
                 tree: Tree) -> None:
    """Debug records of one level of a sampled tree's walk (``rows [n]`` at ``nodes [n]``): the
    rows at a node with children carry its draft logits over the target vocabulary (their law is
    the rule's chain law at that q), the rows at a leaf none (a bonus token: p)."""
    inner = tree.children[0][:, 0] >= 0  # [N+1]: the nodes with children (one shape for every row)
    for has in (True, False):
        pick = (inner[nodes] == has).nonzero()[:, 0]
        if len(pick):
            r, nd = rows[pick], nodes[pick]
            drafts = tree.to_target(tree.draft_logits[r, nd]) if has else None
            record.append((level, r, target_logits[r, nd], None, drafts))


def walk(rule, tree: Tree, target_logits: torch.Tensor, *, temperature: float, top_k: int | None,
         top_p: float | None, generator: torch.Generator, record: list | None = None) -> WalkResult:
    """Verify ``tree`` against ``target_logits [B, N+1, V]`` (row of node i = the target's
    prediction after node i), level by level over the rows still walking.

    record: when a list, gets ``(level, rows [n], logits [n, V], candidates [n, k], None)`` per
        level; in a sampled tree ``(level, rows, logits, None, draft logits [n, V] or None)``
        (:func:`record_level`: the law there is the rule's chain law at q).
    """
    b, _, v = target_logits.shape
    w = tree.max_depth + 1
    dev = target_logits.device
    out = WalkResult(tokens=torch.full((b, w), -1, dtype=torch.long, device=dev),
                     num_emitted=torch.zeros(b, dtype=torch.long, device=dev),
                     behaviour_logprobs=torch.zeros(b, w, dtype=torch.float32, device=dev),
                     target_logprobs=torch.zeros(b, w, dtype=torch.float32, device=dev),
                     kinds=torch.full((b, w), int(TokenKind.PAD), dtype=torch.long, device=dev),
                     relaxed=torch.zeros(b, w, dtype=torch.bool, device=dev),
                     path=torch.zeros(b, w, dtype=torch.long, device=dev))
    rows = torch.arange(b, device=dev)
    node = torch.zeros(b, dtype=torch.long, device=dev)  # current node of each walking row
    children = tree.children.expand(b, -1, -1)
    for level in range(w):
        kids = children[rows, node]  # [n, k]
        cand = torch.where(kids >= 0, tree.tokens[rows].gather(1, kids.clamp(min=0)), -1)
        logits = target_logits[rows, node]  # [n, V]
        if tree.draft_logits is None:
            res = verify_candidates(rule, logits, cand, temperature=temperature, top_k=top_k, top_p=top_p,
                                    generator=generator)
        else:
            res = verify_sampled_candidates(rule, logits, tree.to_target(tree.draft_logits[rows, node]), cand,
                                            temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
        acc = res.accepted_index >= 0
        kind = torch.where(acc, int(TokenKind.ACCEPTED),
                           torch.where(cand[:, 0] >= 0, int(TokenKind.RECOVERED), int(TokenKind.BONUS)))
        out.tokens[rows, level] = res.tokens
        out.behaviour_logprobs[rows, level] = res.behaviour_logprobs
        out.target_logprobs[rows, level] = res.target_logprobs
        out.kinds[rows, level] = kind
        out.relaxed[rows, level] = res.relaxed
        out.path[rows, level] = node
        out.num_emitted[rows] += 1
        if record is not None and tree.draft_logits is None:
            record.append((level, rows, logits, cand, None))
        elif record is not None:
            record_level(record, level, rows, node, target_logits, tree)
        keep = acc.nonzero()[:, 0]
        if keep.numel() == 0:
            break
        node = kids[keep].gather(1, res.accepted_index[keep][:, None])[:, 0]
        rows = rows[keep]
    return out
