"""Draft trees of sampled candidates (``spec.tree_candidates: sampled``), verified by recursive
rejection (``verifiers.sampled``) towards p (lossless) or a lossy rule's chain law P_R(p, q), or
with ``verifier.test: block`` (lossless) the first-child spine as a block (``verifiers.block_tree``,
:func:`walk_block`).

A node's children are drawn from the head's q at that node without replacement (their draw
order is their rank), so the verifier's law at the node is exactly p (P_R). That holds only if the
number of children a node gets never depends on the children's own draws; a budget that kept
the best-scoring drafted nodes, as the EAGLE-2 tree does, would keep a second child more often
when its q is high, and bias the law. So each round's tree has a **shape** fixed before its
draws: the rank paths it keeps, the same in every row.

The shape keeps the ``total_tokens`` rank paths (r_1, ..., r_d) of largest value
prod_i rho[r_i], where rho[r] is the chance that the candidate of rank r is the one accepted at
a node. With rho[r] < 1 decreasing in r, the kept set holds every kept node's parent and
lower-ranked siblings. At most ``depth`` levels and ``top_k`` children per node. A call starts
from :data:`RANK_ACCEPT` (the shipped head's rates at T = 1 on held-out prompts: 0.58 for the
first candidate, 0.09 more for a second, 0.05 for a third) and :class:`ShapePlanner` re-plans
the shape from the rates its rounds measured (another head or temperature has other rates).
A round's shape depends only on earlier rounds, so the law at each node stays p (P_R).

Drafting runs one head step per level: the root's step gives the first level's q, and the
nodes of level l that have children run in one step at level l (each sees its ancestors'
speculative slots), giving their q.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import cached_property

import torch

from verifiers import TokenKind, native
from verifiers.block_tree import verify_block_tree
from verifiers.checks import raise_if_bad_rows
from verifiers.sampled import draw_without_replacement, kernel_logits

from .tree import Tree, WalkResult, _ancestor_mask, _children, record_level

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

    @cached_property
    def _layouts(self) -> dict:
        return {}

    def layout(self, device: torch.device) -> dict:
        """The shape's tensors on ``device``, made once: ``parents [1, N+1]``, ``depths [1, N+1]``,
        ``children [1, N+1, K]``, ``mask [N+1, N+1]`` (ancestor-or-self) and per drafted level
        ``(nodes, visible [1, f, S] or None)``, the nodes a head step runs and the earlier
        speculative slots each sees."""
        key = str(device)
        if key not in self._layouts:
            parents = torch.tensor(self.parents, device=device)[None]
            mask = _ancestor_mask(parents, self.max_depth)[0]
            levels, slots = [], []
            for level in range(1, self.max_depth):
                nodes = self.expanded(level)
                if not nodes:
                    break
                levels.append((nodes, mask[nodes][:, slots][None] if slots else None))
                slots += nodes
            self._layouts[key] = {"parents": parents, "depths": torch.tensor(self.depths, device=device)[None],
                                  "children": _children(parents, self.top_k), "mask": mask, "levels": levels}
        return self._layouts[key]


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
    lay = shape.layout(dev)
    for level, (nodes, visible) in enumerate(lay["levels"], start=1):
        tokens = runner.draft_ids[ids[:, nodes]]  # [B, f]
        hidden = torch.stack([out_hidden[shape.parents[v]] for v in nodes], dim=1)  # [B, f, H]
        step = runner.draft_step(tokens, hidden, level, None if visible is None else visible.expand(b, -1, -1))
        for j, v in enumerate(nodes):
            out_hidden[v] = step.hidden[:, j]
        draw(nodes, step.logits)
    tokens = torch.cat([root[:, None], runner.draft_ids[ids[:, 1:]]], dim=1)
    return Tree(tokens=tokens, parents=lay["parents"].expand(b, -1), depths=lay["depths"], children=lay["children"],
                mask=lay["mask"][None].expand(b, -1, -1), max_depth=shape.max_depth, draft_logits=node_logits,
                to_target=runner.head.to_target_logits, draft_ids=runner.draft_ids)


def fused_walk_usable(tree: Tree, rule, device: torch.device) -> bool:
    """Whether :func:`walk_sampled` can verify ``tree`` (a sampled tree, a rule with a kernel id,
    the C++ verifier on the CPU); else ``rollout.engine.tree.walk`` does, node level by node level."""
    return (tree.draft_logits is not None and tree.draft_ids is not None and device.type == "cpu"
            and native.enabled() and native.supports(rule))


def walk_sampled(rule, tree: Tree, target_logits: torch.Tensor, *, temperature: float, top_k: int | None,
                 top_p: float | None, generator: torch.Generator, record: list | None = None) -> WalkResult:
    """``rollout.engine.tree.walk`` over a sampled tree in one C++ call (``verifiers/csrc/sampled_tree.cpp``,
    ``hr_walk_sampled``): each row's walk runs the same node step as ``verify_sampled_candidates``
    (recursive rejection towards p, or a lossy rule's P_R; a leaf's bonus token from p). Its
    randomness differs from the level-by-level walk's: ``u_accept = rand(B, W, K)``, then
    ``u_final = rand(B, W)`` per round, entry (row, level) used at the row's node of that level.
    The kernel writes the kinds as ``TokenKind`` values (-1 padding). See :func:`fused_walk_usable`
    for when it applies."""
    b = target_logits.shape[0]
    w, k = tree.max_depth + 1, tree.children.shape[-1]
    dev = target_logits.device
    u_accept = torch.rand(b, w, k, generator=generator, device=dev)
    u_final = torch.rand(b, w, generator=generator, device=dev)
    z, zd, t = kernel_logits(target_logits, tree.draft_logits, temperature, top_k, top_p)
    try:
        tokens, logp, target, kinds, path, emitted = native.walk_sampled_native(
            rule, z, zd, tree.draft_ids, tree.tokens, tree.children[0], u_accept, u_final, t)
    except native.NativeError as err:
        if err.status == 4:
            raise RuntimeError("internal error: a sampled tree node has a child its q gives probability 0") from None
        name, rows = ("target_logits", target_logits) if err.status == 1 else ("draft logits", tree.draft_logits)
        stat = torch.where(err.bad_rows.bool()[:, None], float("nan"), 0.0).expand(b, rows.shape[1])
        raise_if_bad_rows(name, rows, stat, temperature)
        raise AssertionError("the C++ walk flagged a bad row that has none") from None
    if record is not None:
        _record_walk(record, tree, target_logits, emitted, path)
    relaxed = (kinds == int(TokenKind.ACCEPTED)) & (logp > target)  # P_R(y) > p(y) for an accepted child
    return WalkResult(tokens=tokens, num_emitted=emitted, behaviour_logprobs=logp, target_logprobs=target,
                      kinds=kinds, relaxed=relaxed, path=path)


def _record_walk(record: list, tree: Tree, target_logits: torch.Tensor, emitted: torch.Tensor,
                 path: torch.Tensor) -> None:
    """:func:`record_level` for every level a whole-tree walk reached (``emitted [B]``, ``path [B, W]``)."""
    for level in range(tree.max_depth + 1):
        rows = (emitted > level).nonzero()[:, 0]
        if len(rows) == 0:
            break
        record_level(record, level, rows, path[rows, level], target_logits, tree)


def walk_block(rule, tree: Tree, target_logits: torch.Tensor, *, temperature: float, top_k: int | None,
               top_p: float | None, generator: torch.Generator, record: list | None = None) -> WalkResult:
    """``verifier.test: block`` on a sampled tree (lossless rule, T > 0): the spine of first
    children verified as a block, the other children tried where it stops
    (``verifiers.block_tree``, which draws the round's uniforms). Every emitted token's behaviour
    and target log-prob is log p(y). The debug ``record`` is :func:`record_level`'s."""
    assert getattr(rule, "name", None) == "lossless", rule
    kids = tree.children[0].tolist()
    children = [[c for c in row if c >= 0] for row in kids]
    depths = tree.depths[0].tolist()
    draft = tree.to_target(tree.draft_logits)
    tokens, emitted, logp, kinds, path = verify_block_tree(target_logits, draft, tree.tokens, children, depths,
                                                           temperature=temperature, top_k=top_k, top_p=top_p,
                                                           generator=generator)
    if record is not None:
        _record_walk(record, tree, target_logits, emitted, path)
    return WalkResult(tokens=tokens, num_emitted=emitted, behaviour_logprobs=logp, target_logprobs=logp.clone(),
                      kinds=kinds, relaxed=torch.zeros(kinds.shape, dtype=torch.bool, device=kinds.device), path=path)


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
    return 1 + len(shape.layout(torch.device("cpu"))["levels"])
