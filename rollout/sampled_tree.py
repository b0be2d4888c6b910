"""Draft trees of sampled candidates (``spec.tree_candidates: sampled``), verified losslessly by
recursive rejection (``verifiers.sampled``).

A node's children are drawn from the head's q at that node without replacement (their draw
order is their rank), so the verifier's law at the node is exactly p. That holds only if the
number of children a node gets never depends on the children's own draws; a budget that kept
the best-scoring drafted nodes, as the EAGLE-2 tree does, would keep a second child more often
when its q is high, and bias the law. So the tree has a fixed **shape**: the rank paths chosen
before drafting, the same in every row and round.

The shape keeps the ``total_tokens`` rank paths (r_1, ..., r_d) of largest value
prod_i rho[r_i], where rho[r] is the chance that the candidate of rank r is the one accepted at
a node. With rho[r] < 1 decreasing in r, the kept set holds every kept node's parent and
lower-ranked siblings. At most ``depth`` levels and ``top_k`` children per node. A call starts
from :data:`RANK_ACCEPT` (the shipped head's rates at T = 1 on held-out prompts: 0.58 for the
first candidate, 0.09 more for a second, 0.05 for a third) and :class:`ShapePlanner` re-plans
the shape from the rates its rounds measured (another head or temperature has other rates).
A round's shape depends only on earlier rounds, so the law at each node stays p.

Drafting runs one head step per level: the root's step gives the first level's q, and the
nodes of level l that have children run in one step at level l (each sees its ancestors'
speculative slots), giving their q.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import torch

from verifiers.sampled import draw_without_replacement

from .tree import Tree, _ancestor_mask, _children

RANK_ACCEPT = (0.58, 0.09, 0.05, 0.03, 0.02)
PRIOR_TRIALS = 50.0  # weight of RANK_ACCEPT in the measured rates, in nodes
REPLAN_ROUNDS = 8  # rounds between re-plans


@dataclass(frozen=True)
class Shape:
    """A tree shape: node 0 is the root; ``parents[i]`` precedes node i, siblings in rank order."""

    parents: tuple[int, ...]
    depths: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.parents)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        kids: list[list[int]] = [[] for _ in self.parents]
        for node, parent in enumerate(self.parents[1:], start=1):
            kids[parent].append(node)
        return tuple(tuple(k) for k in kids)

    @property
    def max_depth(self) -> int:
        return max(self.depths)

    @property
    def top_k(self) -> int:
        return max(len(k) for k in self.children)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Each node's rank among its siblings (the root: 0)."""
        out = [0] * self.size
        for kids in self.children:
            for r, node in enumerate(kids):
                out[node] = r
        return tuple(out)

    def expanded(self, level: int) -> list[int]:
        """Nodes at ``level`` that have children (one head step drafts them all)."""
        return [v for v, d in enumerate(self.depths) if d == level and self.children[v]]


def sampled_shape(total_tokens: int, depth: int, top_k: int, rank_accept=RANK_ACCEPT) -> Shape:
    """The ``total_tokens`` best rank paths (see the module docstring); ties go to the shallower,
    then the lexicographically smaller path. Node order: the spine (every rank first) right after
    the root, then by depth: a round that accepts only first candidates commits a block prefix."""
    rho = [rank_accept[min(r, len(rank_accept) - 1)] for r in range(top_k)]
    if not all(0 < a < 1 for a in rho) or any(a < b for a, b in zip(rho, rho[1:])):
        raise ValueError(f"rank_accept must lie in (0, 1) and not increase with the rank, got {tuple(rho)}")
    heap = [(-rho[0], 1, (0,))]
    kept: list[tuple[int, ...]] = []
    while heap and len(kept) < total_tokens:
        neg, _, path = heapq.heappop(heap)
        kept.append(path)
        if len(path) < depth:
            heapq.heappush(heap, (neg * rho[0], len(path) + 1, path + (0,)))
        if path[-1] + 1 < top_k:
            nxt = path[:-1] + (path[-1] + 1,)
            heapq.heappush(heap, (neg / rho[path[-1]] * rho[path[-1] + 1], len(nxt), nxt))
    paths = [()] + sorted(kept, key=lambda p: (any(p), len(p), p))  # the all-first-ranks spine first
    index = {p: i for i, p in enumerate(paths)}
    return Shape(parents=tuple(-1 if not p else index[p[:-1]] for p in paths), depths=tuple(len(p) for p in paths))


def draft_sampled_tree(runner, root: torch.Tensor, shape: Shape, temperature: float,
                       generator: torch.Generator) -> Tree:
    """Draft ``shape`` for every row with the runner's head; ``root [B]`` are the pending
    tokens. The tree carries each node's draft logits (``Tree.draft_logits``) for the verifier."""
    step = runner.draft_root()
    b, vd = step.logits.shape
    dev = step.logits.device
    ids = torch.zeros(b, shape.size, dtype=torch.long, device=dev)  # draft-vocabulary ids
    node_logits = step.logits.new_zeros(b, shape.size, vd)  # what each node's children were drawn from
    out_hidden = {0: step.hidden}

    def draw(nodes: list[int], logits: torch.Tensor) -> None:  # logits [B, len(nodes), Vd]
        most = max(len(shape.children[v]) for v in nodes)
        drawn = draw_without_replacement(logits, most, temperature, generator)  # [B, f, most]
        if bool((drawn < 0).any()):
            raise RuntimeError("the draft head's q has fewer tokens with probability > 0 than the tree's top_k")
        for j, v in enumerate(nodes):
            kids = list(shape.children[v])
            ids[:, kids] = drawn[:, j, :len(kids)]
        node_logits[:, nodes] = logits

    draw([0], step.logits[:, None])
    slots: list[int] = []  # nodes in the speculative cache, in step order
    anc = _ancestor_mask(torch.tensor(shape.parents, device=dev)[None], shape.max_depth)[0]  # [N+1, N+1]
    for level in range(1, shape.max_depth):
        nodes = shape.expanded(level)
        if not nodes:
            break
        tokens = runner.draft_ids[ids[:, nodes]]  # [B, f]
        hidden = torch.stack([out_hidden[shape.parents[v]] for v in nodes], dim=1)  # [B, f, H]
        visible = anc[nodes][:, slots][None].expand(b, -1, -1) if slots else None  # [B, f, S]
        step = runner.draft_step(tokens, hidden, level, visible)
        for j, v in enumerate(nodes):
            out_hidden[v] = step.hidden[:, j]
        draw(nodes, step.logits)
        slots += nodes
    parents = torch.tensor(shape.parents, device=dev)[None]
    tokens = torch.cat([root[:, None], runner.draft_ids[ids[:, 1:]]], dim=1)
    return Tree(tokens=tokens, parents=parents.expand(b, -1),
                depths=torch.tensor(shape.depths, device=dev)[None], children=_children(parents, shape.top_k),
                mask=anc[None].expand(b, -1, -1), max_depth=shape.max_depth, draft_logits=node_logits,
                to_target=runner.head.to_target_logits)


class ShapePlanner:
    """A call's sampled-tree shape, re-planned every :data:`REPLAN_ROUNDS` rounds from the
    acceptance measured so far: per rank r, ``trials[r]`` counts the nodes the walk reached that
    had a rank-r candidate and ``accepts[r]`` those where it was the one accepted. The rates
    (accepts + PRIOR_TRIALS x RANK_ACCEPT) / (trials + PRIOR_TRIALS), made non-increasing in r,
    replace RANK_ACCEPT in :func:`sampled_shape`."""

    def __init__(self, total_tokens: int, depth: int, top_k: int):
        self.total_tokens, self.depth, self.top_k = total_tokens, depth, top_k
        self.trials = [0.0] * top_k
        self.accepts = [0.0] * top_k
        self.rounds = 0
        self.shape = sampled_shape(total_tokens, depth, top_k)

    def rates(self) -> tuple[float, ...]:
        prior = [RANK_ACCEPT[min(r, len(RANK_ACCEPT) - 1)] for r in range(self.top_k)]
        out, ceiling = [], 0.99
        for r in range(self.top_k):
            rate = (self.accepts[r] + PRIOR_TRIALS * prior[r]) / (self.trials[r] + PRIOR_TRIALS)
            ceiling = min(ceiling, max(rate, 1e-3))
            out.append(ceiling)
        return tuple(out)

    def observe(self, path: torch.Tensor, counts: list[int]) -> None:
        """Count one round of the current shape: ``path [B, W]`` the nodes whose outputs each row
        used (``WalkResult.path``), ``counts`` the tokens each row emitted."""
        shape = self.shape
        for row, n in zip(path.tolist(), counts):
            for level in range(n):
                kids = shape.children[row[level]]
                for r in range(len(kids)):
                    self.trials[r] += 1
                if level + 1 < n:
                    self.accepts[shape.ranks[row[level + 1]]] += 1
        self.rounds += 1
        if self.rounds % REPLAN_ROUNDS == 0:
            self.shape = sampled_shape(self.total_tokens, self.depth, self.top_k, self.rates())


def draft_steps(shape: Shape) -> int:
    """Head steps one round of ``shape`` runs (the root's included)."""
    return 1 + sum(1 for level in range(1, shape.max_depth) if shape.expanded(level))
