"""Block verification (``verify_chain(lossless, ..., test="block")``, verifiers/block.py).

- exactness by enumeration: over a small vocabulary with a target and a draft that depend on
  the whole prefix (autoregressive tables), every drafted block, stop and final token is
  enumerated; one round continued by sampling from p gives p's probability to every sequence
  of up to K + 1 tokens. The same enumeration of token-by-token verification passes too, and
  block verification accepts at least as many drafts in expectation, more on these tables;
- Monte Carlo: the batched code's rounds on blocks drafted from the tables match the
  enumerated law of a round (every emitted sequence), and its log-probs are log p;
- the batched code equals the plain-loop reference token for token on the same uniforms;
- K = 1 is the token-by-token law; T = 0 is the greedy test; other rules and bad input are
  refused, the generator left as it was.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from test_verifiers_montecarlo import assert_matches

from verifiers import get_rule, induced_chain, target_probs, verify_chain
from verifiers.processing import draft_probs
from verifiers.reference import reference_block_chain

V, K = 3, 3
LOSSLESS = get_rule("lossless")


def _tables(seed: int, top_k: int | None = None, hole: bool = True):
    """Logits of p and q after every prefix of up to K tokens: {prefix: (target [V], draft [V])}.
    ``hole``: the draft never proposes token 2 after the empty prefix (q = 0 there)."""
    g = torch.Generator().manual_seed(seed)
    tables = {}
    for length in range(K + 1):
        for prefix in itertools.product(range(V), repeat=length):
            target, draft = torch.randn(V, generator=g) * 1.5, torch.randn(V, generator=g) * 1.5
            if hole and not prefix:
                draft[2] = -math.inf
            tables[prefix] = (target, draft)
    p = {pre: _normalised(target_probs(t, 1.0, top_k)) for pre, (t, _) in tables.items()}
    q = {pre: _normalised(draft_probs(d, 1.0)) for pre, (_, d) in tables.items()}
    return tables, p, q


def _normalised(probs: torch.Tensor) -> torch.Tensor:
    return probs.double() / probs.double().sum()


def _round_law(p, q, verify: str) -> dict[tuple[int, ...], float]:
    """The law of one round's emitted tokens (the accepted drafts, then the final token),
    enumerating every drafted block and every outcome: ``block`` verification from its formulas,
    ``token``-by-token verification, or ``wrong``: block verification stopping with h_j = r_j."""
    law: dict[tuple[int, ...], float] = {}

    def emit(prefix, weights, mass):
        total = float(weights.sum())
        weights = weights if total > 0 else p[prefix]
        for y in range(V):
            law[prefix + (y,)] = law.get(prefix + (y,), 0.0) + mass * float(weights[y]) / float(weights.sum())

    for xs in itertools.product(range(V), repeat=K):
        drawn = math.prod(float(q[xs[:j]][xs[j]]) for j in range(K))
        if drawn == 0:
            continue
        if verify == "token":
            stand = 1.0
            for j in range(K):
                a = min(1.0, float(p[xs[:j]][xs[j]] / q[xs[:j]][xs[j]]))
                emit(xs[:j], (p[xs[:j]] - q[xs[:j]]).clamp(min=0), drawn * stand * (1 - a))
                stand *= a
            emit(xs, p[xs], drawn * stand)
            continue
        w = [1.0]
        for j in range(K):
            w.append(min(1.0, w[-1] * float(p[xs[:j]][xs[j]] / q[xs[:j]][xs[j]])))
        h = []
        for j in range(K):
            r = float((w[j] * p[xs[:j]] - q[xs[:j]]).clamp(min=0).sum())
            h.append(1.0 if j == 0 or r + 1 - w[j] <= 0 else r if verify == "wrong" else r / (r + 1 - w[j]))
        h.append(w[K])
        none_longer = 1.0
        for n in range(K, -1, -1):
            mass = drawn * none_longer * h[n]
            none_longer *= 1 - h[n]
            pre = xs[:n]
            emit(pre, p[pre] if n == K else (w[n] * p[pre] - q[pre]).clamp(min=0), mass)
    return law


def _p_of(p, seq: tuple[int, ...]) -> float:
    return math.prod(float(p[seq[:i]][seq[i]]) for i in range(len(seq)))


def _continued_law_error(p, law) -> float:
    """max over sequences s of up to K + 1 tokens of |Pr(one round, then sampling from p, starts
    with s) - p(s)|."""
    worst = 0.0
    for length in range(1, K + 2):
        for seq in itertools.product(range(V), repeat=length):
            got = sum(mass for out, mass in law.items() if len(out) >= length and out[:length] == seq)
            got += sum(law.get(seq[:i], 0.0) * _p_of(p, seq[:i]) ** -1 * _p_of(p, seq)
                       for i in range(1, length) if _p_of(p, seq[:i]) > 0)
            worst = max(worst, abs(got - _p_of(p, seq)))
    return worst


def _accepted(law) -> float:
    return sum(mass * (len(out) - 1) for out, mass in law.items())


@pytest.mark.parametrize("seed,top_k", [(0, None), (1, None), (2, 2), (3, None)])
def test_enumeration_one_round_continued_by_p_is_p(seed, top_k):
    _, p, q = _tables(seed, top_k)
    block, token = _round_law(p, q, "block"), _round_law(p, q, "token")
    assert abs(sum(block.values()) - 1) < 1e-12
    assert _continued_law_error(p, block) < 1e-12
    assert _continued_law_error(p, token) < 1e-12
    assert _accepted(block) > _accepted(token) + 1e-3


def test_enumeration_fails_for_a_wrong_stop_probability():
    """The check above can fail: stopping with r_j alone (not r_j / (r_j + 1 - w_j)) breaks it."""
    _, p, q = _tables(0)
    assert _continued_law_error(p, _round_law(p, q, "wrong")) > 1e-3


def _batch(tables, n: int, seed: int):
    """n blocks drafted from the q table, and each row's target and draft logits."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.zeros(n, K, dtype=torch.long)
    for j in range(K):
        probs = torch.stack([draft_probs(tables[tuple(row[:j].tolist())][1], 1.0) for row in drafts])
        drafts[:, j] = torch.multinomial(probs, 1, generator=g)[:, 0]
    target = torch.stack([torch.stack([tables[tuple(row[:j].tolist())][0] for j in range(K + 1)]) for row in drafts])
    draft = torch.stack([torch.stack([tables[tuple(row[:j].tolist())][1] for j in range(K)]) for row in drafts])
    return target, draft, drafts


@pytest.mark.parametrize("top_k", [None, 2])
def test_batched_rounds_follow_the_enumerated_law(top_k):
    tables, p, q = _tables(4, top_k)
    target, draft, drafts = _batch(tables, 60_000, seed=5)
    res = verify_chain(LOSSLESS, target, draft, drafts, temperature=1.0, top_k=top_k,
                       generator=torch.Generator().manual_seed(6), test="block")
    law = _round_law(p, q, "block")
    outcomes = sorted(law)
    index = {out: i for i, out in enumerate(outcomes)}
    emitted = [tuple(row[:n]) for row, n in zip(res.tokens.tolist(), res.num_emitted.tolist())]
    assert_matches(torch.tensor([index[out] for out in emitted]), torch.tensor([law[out] for out in outcomes]))
    for row in (0, 1, 2):  # log P = log p = the target's log-prob of each emitted token
        n = int(res.num_emitted[row])
        seq = emitted[row]
        want = [math.log(float(p[seq[:j]][seq[j]])) for j in range(n)]
        assert res.behaviour_logprobs[row, :n].tolist() == pytest.approx(want, abs=1e-5)
        assert torch.equal(res.behaviour_logprobs[row], res.target_logprobs[row])
    assert not res.relaxed.any()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.8, 6, 0.9)])
def test_batched_equals_reference_on_the_same_uniforms(temperature, top_k, top_p):
    g = torch.Generator().manual_seed(7)
    b, k, v = 40, 5, 13
    target = torch.randn(b, k + 1, v, generator=g) * 2
    draft = target[:, :k] + torch.randn(b, k, v, generator=g)  # a draft near the target: long prefixes too
    draft[:, :, 0] = -math.inf
    q = draft_probs(draft, temperature)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=g).view(b, k)
    kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    res = verify_chain(LOSSLESS, target, draft, drafts, generator=torch.Generator().manual_seed(8), test="block", **kw)
    ref = reference_block_chain(target, draft, drafts, generator=torch.Generator().manual_seed(8), **kw)
    lengths = set()
    for row, want in enumerate(ref):
        n = int(res.num_emitted[row])
        lengths.add(n)
        assert res.tokens[row, :n].tolist() == [t for t, *_ in want]
        assert res.kinds[row, :n].tolist() == [int(kind) for _, kind, *_ in want]
        assert res.behaviour_logprobs[row, :n].tolist() == pytest.approx([lp for *_, lp, _ in want], abs=1e-5)
        assert (res.tokens[row, n:] == -1).all() and (res.behaviour_logprobs[row, n:] == 0).all()
    assert len(lengths) >= 3  # rejections early, late and (for some rows) none


def test_one_draft_is_the_token_by_token_law():
    g = torch.Generator().manual_seed(9)
    target, draft = torch.randn(2, 5, generator=g), torch.randn(1, 5, generator=g)
    n = 100_000
    q = draft_probs(draft, 1.0)
    drafts = torch.multinomial(q, n, replacement=True, generator=g).view(n, 1)
    res = verify_chain(LOSSLESS, target.expand(n, 2, 5), draft.expand(n, 1, 5), drafts, temperature=1.0,
                       generator=torch.Generator().manual_seed(10), test="block")
    assert_matches(res.tokens[:, 0], induced_chain(LOSSLESS, target[:1], draft, temperature=1.0)[0])
    accepted = (res.num_emitted == 2).double().mean()
    assert abs(accepted - torch.minimum(target_probs(target[0], 1.0), q[0]).sum()) < 4 / math.sqrt(n)


def test_greedy_is_the_rules_greedy_test():
    g = torch.Generator().manual_seed(11)
    target, draft = torch.randn(6, 4, 9, generator=g), torch.randn(6, 3, 9, generator=g)
    drafts = target[:, :3].argmax(-1)
    drafts[2, 1] = (drafts[2, 1] + 1) % 9
    a = verify_chain(LOSSLESS, target, draft, drafts, temperature=0.0, generator=None, test="block")
    b = verify_chain(LOSSLESS, target, draft, drafts, temperature=0.0, generator=None, test="rule")
    assert torch.equal(a.tokens, b.tokens) and int(a.num_emitted[2]) == 2


def test_other_rules_and_bad_input_are_refused():
    g = torch.Generator().manual_seed(12)
    target, draft = torch.randn(2, 3, 9, generator=g), torch.randn(2, 2, 9, generator=g)
    drafts = torch.zeros(2, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="lossless rule only.*'mars'"):
        verify_chain(get_rule("mars"), target, draft, drafts, temperature=1.0, generator=g, test="block")
    target[1, 2, 4] = math.nan
    gen = torch.Generator().manual_seed(13)
    before = gen.get_state()
    with pytest.raises(ValueError, match="target_logits: the logit vector at row 1, position 2 contains NaN"):
        verify_chain(LOSSLESS, target, draft, drafts, temperature=1.0, generator=gen, test="block")
    assert torch.equal(gen.get_state(), before)
    draft[0, 1, 0] = -math.inf
    target[1, 2, 4] = 0.0
    with pytest.raises(ValueError, match=r"draft_tokens\[0, 1\] = 0 has zero probability"):
        verify_chain(LOSSLESS, target, draft, drafts, temperature=1.0, generator=gen, test="block")


def test_cpp_and_torch_agree_on_a_full_vocabulary():
    """At V = 49152 (sampling blocks, long rows) the C++ kernel and the PyTorch path emit the same
    tokens and log-probs on the same uniforms, at T = 1 and at T = 0.7 with top-k."""
    from verifiers import native

    g = torch.Generator().manual_seed(14)
    b, k, v = 12, 4, 49152
    target = torch.randn(b, k + 1, v, generator=g) * 3
    draft = target[:, :k] + torch.randn(b, k, v, generator=g)
    for temperature, top_k in ((1.0, None), (0.7, 200)):
        drafts = torch.multinomial(draft_probs(draft, temperature).reshape(-1, v), 1, generator=g).view(b, k)
        runs = []
        for use in (True, False):
            with native.forced(use):
                runs.append(verify_chain(LOSSLESS, target, draft, drafts, temperature=temperature, top_k=top_k,
                                         generator=torch.Generator().manual_seed(15), test="block"))
        assert torch.equal(runs[0].tokens, runs[1].tokens) and torch.equal(runs[0].kinds, runs[1].kinds)
        assert torch.allclose(runs[0].behaviour_logprobs, runs[1].behaviour_logprobs, atol=1e-5)
        assert len(set(runs[0].num_emitted.tolist())) >= 2


def test_expected_accepted_drafts_match_the_verifiers():
    """``expected_accepted``: per fixed block, the mean accepted drafts of many block and token-by-
    token verifications of that block (Monte Carlo over the verifiers' randomness)."""
    from verifiers.block import expected_accepted

    g = torch.Generator().manual_seed(16)
    k, v, n = 4, 11, 40_000
    target = torch.randn(3, k + 1, v, generator=g) * 2
    draft = target[:, :k] + torch.randn(3, k, v, generator=g)
    x = torch.multinomial(draft_probs(draft, 1.0).reshape(-1, v), 1, generator=g).view(3, k)
    token, block = expected_accepted(target_probs(target, 1.0), draft_probs(draft, 1.0), x)
    for row in range(3):
        args = (target[row].expand(n, -1, -1), draft[row].expand(n, -1, -1), x[row].expand(n, -1))
        for test, want in (("block", block[row]), ("rule", token[row])):
            res = verify_chain(LOSSLESS, *args, temperature=1.0, generator=torch.Generator().manual_seed(17), test=test)
            got = (res.num_emitted - 1).double()
            assert abs(got.mean() - want) < 4 * got.std() / math.sqrt(n) + 1e-9, (row, test)
