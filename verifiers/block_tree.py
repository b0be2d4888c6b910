"""Block verification of sampled trees: lossless, a block-verified spine with its siblings as spares.

``spec.tree_candidates: sampled`` with ``verifier.test: block`` (lossless rule, T > 0). A sampled
tree's node v has children drawn without replacement from the head's q_v (``rollout.sampled_tree``);
its **spine** from a node is the chain of first children down to a leaf. The walk from a node:

1. Block verification (:mod:`.block`) of the spine from the node, drafts x_0..x_{K-1} (the spine's
   tokens), p_j and q_j at the spine's nodes: it accepts n drafts, with the running weight w_n.
2. n = K: the bonus token ~ p at the spine's leaf. Otherwise, at the spine's n-th node s, block
   verification would draw the final token from the residual ``R = norm((w_n p_s - q_s)+)``.
   Here that draw is made by recursive rejection of s's other children c_1, c_2, ... (drawn
   after x_n without replacement) towards R: with ``q'`` = q_s without x_n and the children
   tested so far, renormalised, accept c_i with probability min(1, R(c_i) / q'(c_i)), else
   R <- norm((R - q')+). If none is accepted, the final token ~ R.
3. An accepted child c starts a new walk from c (step 1), with a fresh weight.

Why the emitted sequence follows p: given the spine's drafts and that block verification stopped
at n, block verification's final token is a draw from R that depends on nothing else (which is
how the block rule makes its output follow p). Given x_n, s's other children are draws from q_s
without x_n, so the recursive rejection of step 2 emits a token whose law is exactly R, whatever
x_n and the deeper drafts are: the round's tokens up to and including that one have block
verification's law. An accepted child's subtree was drafted given that child only, so the walk
from it is a fresh lossless walk, and so on. So, as for block-verified chains, **every emitted
token's behaviour log-prob is log p(y)**. ``tests/verifiers/test_block_tree.py`` checks it
exactly: it enumerates every tree of a small vocabulary and shape and every outcome of its walk,
and one round continued by sampling from p gives p's law of every sequence.

With one child per node this is block verification of the chain; with one level it is recursive
rejection of sampled candidates. A node-by-node walk (``verifiers.sampled``) tests each first
child on its own; here the spine is judged as a block, so a later draft whose ratio is above 1
can rescue an earlier one whose ratio is below 1.

Randomness per call, in this order from ``generator``: ``u_block = rand(B, W, W)`` (float64; entry
(b, d, j): the test of a prefix of j spine drafts of the walk that starts at depth d),
``u_sibling = rand(B, W, k)`` (float64; entry (b, d, i): the i-th other child at depth d's stop
node), ``u_final = rand(B)``. W = the tree's depth + 1, k = its most children at a node. Each
walk starts at a new depth, and each depth has at most one stop node, so no uniform is used twice.

The walk is per row in PyTorch: the vocabulary-sized rows in the logits' precision, every sum and
weight in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .block import block_weights, stop_probs
from .induced import checked_softmax
from .processing import draft_logits as scale_draft, process_logits, sample_inverse_cdf
from .results import TokenKind


@dataclass
class RowWalk:
    """One row's round: ``tokens`` emitted (accepted children, then the final token), ``path`` the
    nodes whose outputs were used (the root, then each accepted node), ``kinds`` per token."""

    tokens: list[int]
    path: list[int]
    kinds: list[int]


def spine(children: list[list[int]], node: int) -> list[int]:
    """``node``, then first children down to a leaf."""
    out = [node]
    while children[out[-1]]:
        out.append(children[out[-1]][0])
    return out


def spine_stops(p: Tensor, q: Tensor, tokens: Tensor, nodes: list[int]) -> tuple[Tensor, Tensor]:
    """Block verification's (w [K+1], h [K+1], float64) along the spine ``nodes`` (K + 1 of them):
    p, q [N+1, V] per node, ``tokens [N+1]`` each node's token (node j+1's is draft x_j)."""
    k = len(nodes) - 1
    if k == 0:  # a leaf: its bonus token
        return torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.float64)
    consecutive = nodes == list(range(nodes[0], nodes[0] + k + 1))  # the root's spine: a view, not a copy
    at = slice(nodes[0], nodes[0] + k) if consecutive else torch.tensor(nodes[:-1], dtype=torch.long)
    p_at, q_at = p[at], q[at]
    drafts = tokens[nodes[1:]].long()
    steps = torch.arange(k)
    p_x, q_x = p_at[steps, drafts], q_at[steps, drafts]
    w = block_weights(p_x[None], q_x[None])[0]
    resid = (w[:k, None].to(p.dtype) * p_at).sub_(q_at).clamp_(min=0).sum(-1, dtype=torch.float64)
    return w, stop_probs(w[None], resid[None])[0]


def sibling_start(p_s: Tensor, q_s: Tensor, w_n: float, first: int) -> tuple[Tensor, Tensor]:
    """At a spine's stop node s (block weight ``w_n``, its first child's token ``first``): the
    residual R = norm((w_n p_s - q_s)+) that the final token would be drawn from (p_s where it has
    no mass, which only rounding reaches), and q_s without ``first`` (unnormalised)."""
    resid = (w_n * p_s - q_s).clamp(min=0)
    mass = float(resid.sum(dtype=torch.float64))
    resid = resid / mass if mass > 0 else p_s
    rest = q_s.clone()
    rest[first] = 0.0
    return resid, rest


def rejection_step(s: Tensor, rest: Tensor, token: int) -> tuple[float, Tensor]:
    """One candidate drawn from ``rest`` (normalised) tested towards ``s``: (its acceptance
    probability, the state after a rejection, norm((s - q')+), or ``s`` where that is empty)."""
    q_i = rest / float(rest.sum(dtype=torch.float64))
    accept = min(1.0, float(s[token]) / max(float(q_i[token]), torch.finfo(torch.float64).tiny))
    after = (s - q_i).clamp(min=0)
    mass = float(after.sum(dtype=torch.float64))
    return accept, (after / mass if mass > 0 else s)


def walk_row(p: Tensor, q: Tensor, tokens: Tensor, children: list[list[int]], depths: list[int],
             u_block: Tensor, u_sibling: Tensor, u_final: float) -> RowWalk:
    """The walk of the module docstring for one row: p, q [N+1, V] (q_v: the law node v's
    children were drawn from), ``tokens [N+1]``, ``children`` per node in draw order, ``depths``,
    ``u_block [W, W]``, ``u_sibling [W, k]``, ``u_final``."""
    out = RowWalk(tokens=[], path=[0], kinds=[])
    node = 0
    while True:
        nodes = spine(children, node)
        k, d0 = len(nodes) - 1, depths[node]
        w, h = spine_stops(p, q, tokens, nodes)
        steps = torch.arange(k + 1)
        n = int(torch.where(u_block[d0, :k + 1] < h, steps, 0).max())
        for v in nodes[1:n + 1]:
            out.tokens.append(int(tokens[v]))
            out.path.append(v)
            out.kinds.append(int(TokenKind.ACCEPTED))
        stop = nodes[n]
        if n == k:
            out.tokens.append(int(sample_inverse_cdf(p[stop][None], torch.tensor([u_final]))[0]))
            out.kinds.append(int(TokenKind.BONUS))
            return out
        kids = children[stop]
        s, rest = sibling_start(p[stop], q[stop], float(w[n]), int(tokens[kids[0]]))
        accepted = None
        for i, c in enumerate(kids[1:]):
            t = int(tokens[c])
            a, after = rejection_step(s, rest, t)
            if float(u_sibling[depths[stop], i]) < a:
                accepted = c
                break
            s = after
            rest[t] = 0.0
        if accepted is None:
            out.tokens.append(int(sample_inverse_cdf(s[None], torch.tensor([u_final]))[0]))
            out.kinds.append(int(TokenKind.RECOVERED))
            return out
        out.tokens.append(int(tokens[accepted]))
        out.path.append(accepted)
        out.kinds.append(int(TokenKind.ACCEPTED))
        node = accepted


def verify_block_tree(target_logits: Tensor, draft_logits: Tensor, tokens: Tensor, children: list[list[int]],
                      depths: list[int], *, temperature: float, top_k: int | None, top_p: float | None,
                      generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Walk B sampled trees of one shape (module docstring): ``target_logits [B, N+1, V]`` (row of
    node v: the target's prediction after v), ``draft_logits [B, N+1, V]`` over the target
    vocabulary (row v: what v's children were drawn from; -inf outside the draft vocabulary),
    ``tokens [B, N+1]`` target ids (node 0: the root), ``children`` per node in draw order,
    ``depths`` per node. Returns (tokens [B, W] -1 padded, emitted [B], log p [B, W] (the
    behaviour log-prob: 0 padded), kinds [B, W] (``TokenKind``, PAD padded), path [B, W])."""
    if temperature <= 0:
        raise ValueError("block verification of a sampled tree needs temperature > 0")
    b, n1, v = target_logits.shape
    if draft_logits.shape != (b, n1, v) or tokens.shape != (b, n1):
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)} and tokens {tuple(tokens.shape)} must be "
                         f"[B, N+1, V] and [B, N+1] for target_logits {tuple(target_logits.shape)}")
    w, k = max(depths) + 1, max(1, max(len(c) for c in children))
    dev = target_logits.device
    u_block = torch.rand(b, w, w, generator=generator, device=dev, dtype=torch.float64).cpu()
    u_sibling = torch.rand(b, w, k, generator=generator, device=dev, dtype=torch.float64).cpu()
    u_final = torch.rand(b, generator=generator, device=dev).cpu()
    with torch.no_grad():
        z = process_logits(target_logits, temperature, top_k, top_p)
        p = checked_softmax("target_logits", target_logits, z, temperature)  # names a bad row
        zq = scale_draft(draft_logits, temperature)
        q = checked_softmax("draft_logits", draft_logits, zq, temperature)
    inner = [i for i, c in enumerate(children) if c]
    kid_ids = tokens[:, [c for i in inner for c in children[i]]].long()
    parent_rows = torch.tensor([i for i in inner for _ in children[i]], dtype=torch.long, device=dev)
    if bool((q[:, parent_rows].gather(2, kid_ids[..., None].to(dev))[..., 0] <= 0).any()):
        raise ValueError("a sampled tree node's child has draft probability 0 at its parent "
                         "(children must be drawn from the parent's q)")
    out_tokens = torch.full((b, w), -1, dtype=torch.long)
    out_logp = torch.zeros(b, w)
    kinds = torch.full((b, w), int(TokenKind.PAD), dtype=torch.long)
    path = torch.zeros(b, w, dtype=torch.long)
    emitted = torch.zeros(b, dtype=torch.long)
    p_cpu, q_cpu, z_cpu, tokens_cpu = p.cpu(), q.cpu(), z.cpu(), tokens.cpu()
    for row in range(b):
        res = walk_row(p_cpu[row], q_cpu[row], tokens_cpu[row], children, depths, u_block[row],
                       u_sibling[row], float(u_final[row]))
        m = len(res.tokens)
        out_tokens[row, :m] = torch.tensor(res.tokens)
        kinds[row, :m] = torch.tensor(res.kinds)
        path[row, :m] = torch.tensor(res.path)
        emitted[row] = m
        ends = torch.tensor(res.path)  # the node whose prediction each token was drawn from
        logp = torch.log_softmax(z_cpu[row, ends].float(), -1)  # [m, V]: the rows the tokens came from
        out_logp[row, :m] = logp[torch.arange(m), torch.tensor(res.tokens)]
    return out_tokens.to(dev), emitted.to(dev), out_logp.to(dev), kinds.to(dev), path.to(dev)
