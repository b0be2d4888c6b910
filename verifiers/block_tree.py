"""Block verification of sampled trees: lossless, a block-verified spine with its siblings as spares.

``spec.tree_candidates: sampled`` with ``verifier.test: block`` (lossless rule, T > 0). A sampled
tree's node v has children drawn without replacement from the head's q_v (``rollout.engine.sampled_tree``);
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
``u_sibling = rand(B, W, k)`` (float32; entry (b, d, i): the i-th other child at depth d's stop
node), ``u_final = rand(B)``. W = the tree's depth + 1, k = its most children at a node. Each
walk starts at a new depth, and each depth has at most one stop node, so no uniform is used twice.

The walk is in PyTorch: row by row on the CPU (:func:`walk_row`), and on other devices batched
(:func:`walk_rows`: the rows whose walks start at the same node together; the same tokens, tested),
the vocabulary-sized rows and their sums in the logits' precision, the block weights in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from . import native
from .block import block_weights, stop_probs
from .induced import checked_softmax
from .processing import draft_logits as scale_draft, process_logits, sample_inverse_cdf
from .results import TokenKind
from .sampled import kernel_logits


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
    resid = (w[:k, None].to(p.dtype) * p_at).sub_(q_at).clamp_(min=0).sum(-1).double()
    return w, stop_probs(w[None], resid[None])[0]


def sibling_start(p_s: Tensor, q_s: Tensor, w_n: float, first: int) -> tuple[Tensor, Tensor]:
    """At a spine's stop node s (block weight ``w_n``, its first child's token ``first``): the
    residual R = norm((w_n p_s - q_s)+) that the final token would be drawn from (p_s where it has
    no mass, which only rounding reaches), and q_s without ``first`` (unnormalised)."""
    resid = (w_n * p_s - q_s).clamp(min=0)
    mass = resid.sum()
    resid = resid / mass if float(mass) > 0 else p_s
    rest = q_s.clone()
    rest[first] = 0.0
    return resid, rest


def rejection_step(s: Tensor, rest: Tensor, token: int) -> tuple[float, Tensor]:
    """One candidate drawn from ``rest`` (normalised) tested towards ``s``: (its acceptance
    probability, the state after a rejection, norm((s - q')+), or ``s`` where that is empty)."""
    q_i = rest / rest.sum()
    accept = min(1.0, float(s[token]) / max(float(q_i[token]), torch.finfo(torch.float64).tiny))
    after = (s - q_i).clamp(min=0)
    mass = after.sum()
    return accept, (after / mass if float(mass) > 0 else s)


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


def _zero_q_child() -> ValueError:
    return ValueError("a sampled tree node's child has draft probability 0 at its parent "
                      "(children must be drawn from the parent's q)")


def _at_children(x: Tensor, tokens: Tensor, children: list[list[int]]) -> Tensor:
    """``x [B, N+1, V]`` at each child's token in its parent's row: ``[B, children]``."""
    kids = [c for cs in children for c in cs]
    parents = torch.tensor([i for i, cs in enumerate(children) for _ in cs], device=x.device)
    return x[torch.arange(x.shape[0], device=x.device)[:, None], parents[None], tokens[:, kids].long()]


def _padded(rows: list[list[int]], width: int, device: torch.device | None = None) -> Tensor:
    """``rows`` as a ``[len(rows), width]`` tensor, -1 padded."""
    return torch.tensor([(list(r) + [-1] * width)[:width] for r in rows], device=device)


def _tables(children: list[list[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Per node: its first child (-1 at a leaf) ``[N+1]`` and its other children, in draw order,
    ``[N+1, max(1, k - 1)]`` (-1 padded)."""
    k = max(2, max(len(c) for c in children))
    first = torch.tensor([c[0] if c else -1 for c in children], device=device)
    return first, _padded([c[1:] for c in children], k - 1, device)


def walk_rows(p: Tensor, q: Tensor, tokens: Tensor, children: list[list[int]], depths: list[int],
              u_block: Tensor, u_sibling: Tensor, u_final: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`walk_row` for B rows at once, on their device: p, q ``[B, N+1, V]``, ``tokens [B, N+1]``,
    the uniforms ``[B, W, W]``, ``[B, W, k]``, ``[B]``. The rows whose walks start at the same node
    share its spine and run together; spare children are tried one rank at a time over the rows.
    Returns (tokens [B, W] -1 padded, emitted [B], kinds [B, W] PAD padded, path [B, W])."""
    b, n1, _ = p.shape
    w_max, dev = max(depths) + 1, p.device
    out = torch.full((b, w_max), -1, dtype=torch.long, device=dev)
    kinds = torch.full((b, w_max), int(TokenKind.PAD), dtype=torch.long, device=dev)
    path = torch.zeros(b, w_max, dtype=torch.long, device=dev)
    emitted = torch.zeros(b, dtype=torch.long, device=dev)
    start = torch.zeros(b, dtype=torch.long, device=dev)  # each row's current walk starts here
    active = torch.ones(b, dtype=torch.bool, device=dev)
    depth_of = torch.tensor(depths, device=dev)
    first, spares = _tables(children, dev)
    tiny = torch.finfo(p.dtype).tiny

    def emit(rows: Tensor, token: Tensor, kind: int, node: Tensor | None) -> None:
        pos = emitted[rows]
        out[rows, pos] = token
        kinds[rows, pos] = kind
        if node is not None:  # an accepted node: the next token is drawn from its prediction
            path[rows, pos + 1] = node
        emitted[rows] += 1

    def finish(rows: Tensor, weights: Tensor, kind: int) -> None:
        emit(rows, sample_inverse_cdf(weights, u_final[rows]), kind, None)
        active[rows] = False

    for _ in range(w_max):  # each walk starts deeper than the last
        if not bool(active.any()):
            break
        for node in torch.unique(start[active]).tolist():
            rows = (active & (start == node)).nonzero()[:, 0]
            nodes = spine(children, node)
            k, d0 = len(nodes) - 1, depths[node]
            if k == 0:  # a leaf: its bonus token
                finish(rows, p[rows, node], int(TokenKind.BONUS))
                continue
            at = torch.tensor(nodes, device=dev)
            grid = (rows[:, None], at[None, :-1])
            p_at, q_at = p[grid], q[grid]  # [R, K, V]
            drafts = tokens[rows[:, None], at[None, 1:]].long()  # [R, K]
            p_x, q_x = p_at.gather(2, drafts[..., None])[..., 0], q_at.gather(2, drafts[..., None])[..., 0]
            w = block_weights(p_x, q_x)  # [R, K+1]
            resid = (w[:, :k, None].to(p.dtype) * p_at).sub_(q_at).clamp_(min=0).sum(-1).double()
            h = stop_probs(w, resid)
            steps = torch.arange(k + 1, device=dev)
            n = torch.where(u_block[rows, d0, :k + 1] < h, steps, 0).amax(1)  # [R]
            for j in range(1, k + 1):
                sel = n >= j
                if bool(sel.any()):
                    emit(rows[sel], tokens[rows[sel], nodes[j]].long(), int(TokenKind.ACCEPTED),
                         at[j].expand(int(sel.sum())))
            stop = at[n]  # [R]
            whole = n == k
            if bool(whole.any()):
                finish(rows[whole], p[rows[whole], stop[whole]], int(TokenKind.BONUS))
            part = ~whole
            if not bool(part.any()):
                continue
            r, st, w_n = rows[part], stop[part], w[part, n[part]]
            p_s, q_s = p[r, st], q[r, st]  # [R', V]
            s = (w_n[:, None].to(p.dtype) * p_s - q_s).clamp_(min=0)
            mass = s.sum(-1, keepdim=True)
            s = torch.where(mass > 0, s / mass.clamp(min=tiny), p_s)
            rest = q_s.clone()
            lane = torch.arange(len(r), device=dev)
            rest[lane, tokens[r, first[st]].long()] = 0.0
            taken = torch.full_like(r, -1)  # the accepted spare child, -1: none
            live = torch.ones_like(r, dtype=torch.bool)
            for i in range(spares.shape[1]):
                c = spares[st, i]
                here = live & (c >= 0)
                if not bool(here.any()):
                    break
                t = tokens[r, c.clamp(min=0)].long()
                q_i = rest / rest.sum(-1, keepdim=True)
                ratio = s[lane, t].double() / q_i[lane, t].double().clamp(min=torch.finfo(torch.float64).tiny)
                accept = here & (u_sibling[r, depth_of[st], i] < ratio)
                taken = torch.where(accept, c, taken)
                live &= ~accept
                reject = here & ~accept
                after = (s - q_i).clamp_(min=0)
                mass = after.sum(-1, keepdim=True)
                s = torch.where(reject[:, None] & (mass > 0), after / mass.clamp(min=tiny), s)
                rest[lane, t] = torch.where(here, 0.0, rest[lane, t])
            got = taken >= 0
            if bool(got.any()):
                emit(r[got], tokens[r[got], taken[got]].long(), int(TokenKind.ACCEPTED), taken[got])
                start[r[got]] = taken[got]
            if bool((~got).any()):
                finish(r[~got], s[~got], int(TokenKind.RECOVERED))
    return out, emitted, kinds, path


def walk_each_row(p: Tensor, q: Tensor, tokens: Tensor, children: list[list[int]], depths: list[int],
                  u_block: Tensor, u_sibling: Tensor, u_final: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`walk_rows`' outputs from :func:`walk_row` row by row: faster on the CPU, where a row's
    spine from the root is a view of its rows (the batched walk copies each group's rows)."""
    b, w_max = p.shape[0], max(depths) + 1
    out = torch.full((b, w_max), -1, dtype=torch.long)
    kinds = torch.full((b, w_max), int(TokenKind.PAD), dtype=torch.long)
    path = torch.zeros(b, w_max, dtype=torch.long)
    emitted = torch.zeros(b, dtype=torch.long)
    for row in range(b):
        res = walk_row(p[row], q[row], tokens[row], children, depths, u_block[row], u_sibling[row],
                       float(u_final[row]))
        m = len(res.tokens)
        out[row, :m], kinds[row, :m], path[row, :m] = (torch.tensor(x) for x in (res.tokens, res.kinds, res.path))
        emitted[row] = m
    return out, emitted, kinds, path


def _rows_of(target_logits: Tensor, draft_logits: Tensor, temperature: float, top_k: int | None,
             top_p: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """(z, p, q) [B, N+1, V]: the processed target logits and both laws; a bad row is named."""
    z = process_logits(target_logits, temperature, top_k, top_p)
    p = checked_softmax("target_logits", target_logits, z, temperature)
    q = checked_softmax("draft_logits", draft_logits, scale_draft(draft_logits, temperature), temperature)
    return z, p, q


def _native(target_logits, draft_logits, tokens, children, depths, u_block, u_sibling, u_final, temperature,
            top_k, top_p):
    """The fused C++ walk (``csrc/block_tree.cpp``) on the same uniforms."""
    zt, zd, t = kernel_logits(target_logits, draft_logits, temperature, top_k, top_p)
    table = _padded(children, u_sibling.shape[2])
    try:
        return native.walk_block_tree_native(zt, zd, tokens, table, torch.tensor(depths), u_block, u_sibling, u_final,
                                             t)
    except native.NativeError as err:  # re-checked in PyTorch, which names the row
        with torch.no_grad():
            _rows_of(target_logits, draft_logits, temperature, top_k, top_p)
        if err.status == 4:
            raise _zero_q_child() from None
        raise AssertionError(f"the C++ block-tree walk failed (status {err.status}) on input the PyTorch "
                             "checks accept") from None


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
    has_kids = any(children)
    if int(tokens.min()) < 0 or int(tokens.max()) >= v:
        raise ValueError(f"tokens must be target ids in [0, {v}), got {int(tokens.min())}..{int(tokens.max())}")
    if has_kids and bool((_at_children(draft_logits, tokens, children) == float("-inf")).any()):
        raise _zero_q_child()
    u_block = torch.rand(b, w, w, generator=generator, device=dev, dtype=torch.float64)
    u_sibling = torch.rand(b, w, k, generator=generator, device=dev)
    u_final = torch.rand(b, generator=generator, device=dev)
    if dev.type == "cpu" and native.enabled():
        return _native(target_logits, draft_logits, tokens, children, depths, u_block, u_sibling, u_final,
                       temperature, top_k, top_p)
    with torch.no_grad():
        z, p, q = _rows_of(target_logits, draft_logits, temperature, top_k, top_p)
    if has_kids and bool((_at_children(q, tokens, children) <= 0).any()):  # q underflowed to 0
        raise _zero_q_child()
    walker = walk_each_row if dev.type == "cpu" else walk_rows
    out, emitted, kinds, path = walker(p, q, tokens, children, depths, u_block, u_sibling, u_final)
    steps = torch.arange(w, device=dev)
    on_path = z[torch.arange(b, device=dev)[:, None], path].float()  # [B, W, V]: the rows the tokens came from
    logp = on_path.gather(2, out.clamp(min=0)[..., None])[..., 0] - torch.logsumexp(on_path, -1)
    return out, emitted, logp.masked_fill(steps >= emitted[:, None], 0.0), kinds, path
