"""Block verification of sampled trees (``verifiers/block_tree.py``).

- exactness by enumeration: over a 4-token vocabulary with a target and a draft that depend on
  the whole prefix, every tree of a 6-node shape drafted without replacement, and every outcome
  of its walk (the block stop, each spare child's test, the final token), one round continued by
  sampling from p gives p's law of every sequence. Two plausible mistakes break it (spares tested
  towards p's residual, or drawn as if from q with the spine's child still in it);
- the walk, on its uniforms, matches the enumerated law of a round on a fixed tree (Monte Carlo),
  and the batched entry on trees drafted from the tables gives p's law of the first tokens;
- a walk from a spare child reads its own depth's uniforms.
The implementations against each other, and bad input: ``test_block_tree_backends.py``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_verifiers_montecarlo import assert_matches

from verifiers import TokenKind, target_probs
from verifiers.block_tree import spine_stops, verify_block_tree, walk_row
from verifiers.processing import draft_probs

V = 4
# node: 0 root; 1, 2 its children; 3, 4 node 1's; 5 node 2's; 6 node 3's
CHILDREN = [[1, 2], [3, 4], [5], [6], [], [], []]
DEPTHS = [0, 1, 1, 2, 2, 2, 3]
PARENTS = [-1, 0, 0, 1, 1, 2, 3]
DEPTH = max(DEPTHS)


def _tables(seed: int, top_k: int | None = None):
    """Logits of p and q after every prefix of up to DEPTH tokens; the draft never proposes token
    3 after the empty prefix (q = 0 there)."""
    g = torch.Generator().manual_seed(seed)
    tables = {}
    for length in range(DEPTH + 1):
        for prefix in itertools.product(range(V), repeat=length):
            target, draft = torch.randn(V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5
            if not prefix:
                draft[3] = -math.inf
            tables[prefix] = (target, draft)
    p = {pre: _unit(target_probs(t, 1.0, top_k)) for pre, (t, _) in tables.items()}
    q = {pre: _unit(draft_probs(d, 1.0)) for pre, (_, d) in tables.items()}
    return tables, p, q


def _unit(x: torch.Tensor) -> list[float]:
    x = x.double() / x.double().sum()
    return [float(v) for v in x]


def _prefixes(tokens: list[int]) -> list[tuple[int, ...]]:
    """Each node's prefix (the tokens on its path, root excluded)."""
    out = [()]
    for node in range(1, len(tokens)):
        out.append(out[PARENTS[node]] + (tokens[node],))
    return out


def _trees(q):
    """Every assignment of tokens to the shape, children drawn without replacement from their
    parent's q, with its probability: (tokens [N+1] (root 0), probability)."""
    n = len(PARENTS)
    options = []

    def fill(node_tokens, prob):
        todo = [v for v in range(n) if v and node_tokens[v] is None]
        if not todo:
            options.append((list(node_tokens), prob))
            return
        parent = PARENTS[todo[0]]
        kids = CHILDREN[parent]
        prefix = _prefixes_partial(node_tokens, parent)
        law = q[prefix]
        for draw in itertools.permutations(range(V), len(kids)):
            pr, left = prob, 1.0
            for t in draw:
                pr *= law[t] / left if left > 0 else 0.0
                left -= law[t]
            if pr == 0:
                continue
            nxt = list(node_tokens)
            for kid, t in zip(kids, draw):
                nxt[kid] = t
            fill(nxt, pr)

    fill([0] + [None] * (n - 1), 1.0)
    return options


def _prefixes_partial(node_tokens, node):
    path = []
    while node > 0:
        path.append(node_tokens[node])
        node = PARENTS[node]
    return tuple(reversed(path))


def _spine(node):
    out = [node]
    while CHILDREN[out[-1]]:
        out.append(CHILDREN[out[-1]][0])
    return out


def _round_law(p, q, tokens, variant: str = "right") -> dict[tuple[int, ...], float]:
    """The law of one round's emitted tokens on one tree, from the walk's formulas written out in
    plain floats. ``variant``: ``right``; ``p_residual``: spares tested towards norm((p - q)+);
    ``keep_first``: spares treated as draws from q with the spine's child still in it."""
    pre = _prefixes(tokens)
    law: dict[tuple[int, ...], float] = {}

    def emit(seq, weights, mass):
        total = sum(weights)
        for y in range(V):
            if weights[y] > 0:
                law[seq + (y,)] = law.get(seq + (y,), 0.0) + mass * weights[y] / total

    def walk(node, mass):
        nodes = _spine(node)
        k = len(nodes) - 1
        ps, qs = [p[pre[v]] for v in nodes], [q[pre[v]] for v in nodes]
        xs = [tokens[v] for v in nodes[1:]]
        w = [1.0]
        for j in range(k):
            w.append(min(1.0, w[-1] * ps[j][xs[j]] / qs[j][xs[j]]))
        h = []
        for j in range(k):
            r = sum(max(w[j] * a - b, 0.0) for a, b in zip(ps[j], qs[j]))
            h.append(1.0 if r + 1 - w[j] <= 0 else r / (r + 1 - w[j]))
        h.append(w[k])
        none_longer = 1.0
        for n in range(k, -1, -1):
            here = mass * none_longer * h[n]
            none_longer *= 1 - h[n]
            if here == 0:
                continue
            stop = nodes[n]
            if n == k:
                emit(pre[stop], ps[n], here)
                continue
            weight = 1.0 if variant == "p_residual" else w[n]
            s = [max(weight * a - b, 0.0) for a, b in zip(ps[n], qs[n])]
            total = sum(s)
            s = [v / total for v in s] if total > 0 else list(ps[n])
            rest = list(qs[n])
            if variant != "keep_first":
                rest[xs[n]] = 0.0
            for c in CHILDREN[stop][1:]:
                t = tokens[c]
                qi = [v / sum(rest) for v in rest]
                a = min(1.0, s[t] / qi[t])
                walk(c, here * a)
                here *= 1 - a
                after = [max(u - v, 0.0) for u, v in zip(s, qi)]
                total = sum(after)
                s = [v / total for v in after] if total > 0 else s
                rest[t] = 0.0
            emit(pre[stop], s, here)

    walk(0, 1.0)
    return law


def _p_of(p, seq) -> float:
    return math.prod(p[seq[:i]][seq[i]] for i in range(len(seq)))


def _continued_law_error(p, law) -> float:
    """max over sequences s of up to DEPTH + 1 tokens of |Pr(one round, then sampling from p,
    starts with s) - p(s)|."""
    worst = 0.0
    for length in range(1, DEPTH + 2):
        for seq in itertools.product(range(V), repeat=length):
            got = sum(mass for out, mass in law.items() if len(out) >= length and out[:length] == seq)
            got += sum(law.get(seq[:i], 0.0) / _p_of(p, seq[:i]) * _p_of(p, seq)
                       for i in range(1, length) if _p_of(p, seq[:i]) > 0)
            worst = max(worst, abs(got - _p_of(p, seq)))
    return worst


def _mixed_law(p, q, variant: str = "right"):
    law: dict[tuple[int, ...], float] = {}
    for tokens, prob in _trees(q):
        for seq, mass in _round_law(p, q, tokens, variant).items():
            law[seq] = law.get(seq, 0.0) + prob * mass
    return law


@pytest.mark.parametrize("seed,top_k", [(0, None), (1, None), (2, 2)])
def test_enumeration_one_round_continued_by_p_is_p(seed, top_k):
    _, p, q = _tables(seed, top_k)
    law = _mixed_law(p, q)
    assert abs(sum(law.values()) - 1) < 1e-12
    assert _continued_law_error(p, law) < 1e-12
    assert max(len(s) for s in law) == DEPTH + 1  # deep paths are reached


def test_enumeration_with_three_candidates_at_the_root(monkeypatch):
    """Another shape: three children at the root (two spares; q has three tokens there, so the last
    spare's q' is a point mass), each of the first two with one child."""
    module = __import__(__name__, fromlist=["_"])
    for name, value in [("CHILDREN", [[1, 2, 3], [4], [5], [], [], []]), ("PARENTS", [-1, 0, 0, 0, 1, 2]),
                        ("DEPTHS", [0, 1, 1, 1, 2, 2]), ("DEPTH", 2)]:
        monkeypatch.setattr(module, name, value)
    for seed in (4, 5):
        _, p, q = _tables(seed)
        law = _mixed_law(p, q)
        assert _continued_law_error(p, law) < 1e-12
        assert _continued_law_error(p, _mixed_law(p, q, "keep_first")) > 1e-4


@pytest.mark.parametrize("variant", ["p_residual", "keep_first"])
def test_enumeration_fails_for_plausible_mistakes(variant):
    """The check above can fail: spares tested towards p's own residual, or drawn as if the
    spine's child were still in q, break it."""
    _, p, q = _tables(0)
    assert _continued_law_error(p, _mixed_law(p, q, variant)) > 1e-4


def _row_inputs(tables, tokens):
    pre = _prefixes(tokens)
    target = torch.stack([tables[pre[v]][0] for v in range(len(tokens))]).double()
    draft = torch.stack([tables[pre[v]][1] for v in range(len(tokens))]).double()
    return target, draft


def test_walk_matches_the_enumerated_law_of_a_tree():
    """walk_row on random uniforms, one fixed tree: the emitted sequences' frequencies match the
    law enumerated above (every sequence a category)."""
    tables, p, q = _tables(1)
    tokens, _ = max(_trees(q), key=lambda t: t[1])
    law = _round_law(p, q, tokens)
    seqs = sorted(law)
    target, draft = _row_inputs(tables, tokens)
    pt, qt = torch.softmax(target, -1), torch.softmax(draft, -1)
    g = torch.Generator().manual_seed(5)
    w = DEPTH + 1
    n = 20000
    ub = torch.rand(n, w, w, generator=g, dtype=torch.float64)
    us = torch.rand(n, w, 2, generator=g, dtype=torch.float64)
    uf = torch.rand(n, generator=g)
    index = {s: i for i, s in enumerate(seqs)}
    hits = torch.tensor([index[tuple(walk_row(pt, qt, torch.tensor(tokens), CHILDREN, DEPTHS, ub[i], us[i],
                                              float(uf[i])).tokens)] for i in range(n)])
    assert_matches(hits, torch.tensor([law[s] for s in seqs]))


def _draft_trees(tables, n: int, g: torch.Generator) -> torch.Tensor:
    """n trees of the shape drafted from the q table, children without replacement: tokens [n, N+1]."""
    tokens = torch.zeros(n, len(PARENTS), dtype=torch.long)
    for row in range(n):
        for parent, kids in enumerate(CHILDREN):
            if kids:
                prefix = _prefixes_partial([int(t) for t in tokens[row]], parent)
                probs = draft_probs(tables[prefix][1], 1.0)
                tokens[row, kids] = torch.multinomial(probs, len(kids), replacement=False, generator=g)
    return tokens


def check_rounds_follow_p(p, out, emitted, logp, kinds, path, g: torch.Generator) -> None:
    """Rounds of block-verified trees (CPU tensors) against the tables' p: the first token's law is
    p after the empty prefix, the first two tokens' (a round of one token continued by p) p's; the
    log-probs are log p, the kinds and paths consistent."""
    n = out.shape[0]
    assert_matches(out[:, 0], torch.tensor(p[()]))
    two = emitted >= 2
    pairs = out[two, 0] * V + out[two, 1]
    # a round that emitted one token is continued by p, as the next round would
    cont = torch.tensor([torch.multinomial(torch.tensor(p[(int(t),)]), 1, generator=g).item() for t in out[~two, 0]])
    all_pairs = torch.cat([pairs, out[~two, 0] * V + cont])
    expected = torch.tensor([p[()][a] * p[(a,)][b] for a in range(V) for b in range(V)])
    assert_matches(all_pairs, expected)
    for row in range(0, n, 97):
        m = int(emitted[row])
        for i in range(m):
            seq = tuple(int(t) for t in out[row, :i])
            assert logp[row, i].item() == pytest.approx(math.log(p[seq][int(out[row, i])]), abs=1e-5)
        assert int(kinds[row, m - 1]) in (int(TokenKind.BONUS), int(TokenKind.RECOVERED))
        assert all(int(k) == int(TokenKind.ACCEPTED) for k in kinds[row, :m - 1])
        assert [PARENTS[int(v)] for v in path[row, 1:m]] == [int(v) for v in path[row, :m - 1]]
    assert float((emitted - 1).double().mean()) > 0.5


def test_batched_rounds_follow_p():
    """verify_block_tree on trees drafted from the tables: the first token's law is p after the
    empty prefix, the first two tokens' (a round of one token continued by p) p's; the log-probs
    are log p, the kinds and paths consistent."""
    tables, p, _ = _tables(0)
    g = torch.Generator().manual_seed(3)
    n = 6000
    tokens = _draft_trees(tables, n, g)
    target = torch.stack([_row_inputs(tables, [int(t) for t in row])[0] for row in tokens]).float()
    draft = torch.stack([_row_inputs(tables, [int(t) for t in row])[1] for row in tokens]).float()
    out, emitted, logp, kinds, path = verify_block_tree(target, draft, tokens, CHILDREN, DEPTHS, temperature=1.0,
                                                        top_k=None, top_p=None, generator=g)
    check_rounds_follow_p(p, out, emitted, logp, kinds, path, g)


def test_each_walk_takes_the_uniforms_of_its_depth():
    """A walk that starts at an accepted spare child of depth d tests its spine with
    ``u_block[d]``, not uniforms an earlier walk's tests already conditioned: with the root's spine
    tests all failing (u = 0.995), the spare accepted (u = 0) and ``u_block[1] = 0``, the walk
    runs down the spare's whole spine."""
    tables, p, q = _tables(0)

    def fits(tokens):  # the root's spine and the spare's can fail at every length; the spare can be taken
        target, draft = _row_inputs(tables, tokens)
        pt, qt, tt = torch.softmax(target, -1), torch.softmax(draft, -1), torch.tensor(tokens)
        _, h = spine_stops(pt, qt, tt, [0, 1, 3, 6])
        _, h_spare = spine_stops(pt, qt, tt, [2, 5])
        return bool((h[1:] < 0.99).all()) and float(h_spare[1]) < 0.99 and p[()][tokens[2]] > q[()][tokens[2]]

    tokens = next(t for t, _ in _trees(q) if fits(t))
    target, draft = _row_inputs(tables, tokens)
    w = DEPTH + 1
    u_block = torch.zeros(w, w, dtype=torch.float64)
    u_block[0, 1:] = 0.995
    res = walk_row(torch.softmax(target, -1), torch.softmax(draft, -1), torch.tensor(tokens), CHILDREN, DEPTHS,
                   u_block, torch.zeros(w, 2, dtype=torch.float64), 0.5)
    assert res.path == [0, 2, 5] and res.tokens[:2] == [tokens[2], tokens[5]]
    assert res.kinds == [int(TokenKind.ACCEPTED)] * 2 + [int(TokenKind.BONUS)]
