"""Bad inputs, edge shapes, greedy decoding, support handling, determinism and diagnostics."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from verifier_cases import RULE_CASES, RULE_IDS, RuleCase, candidate_inputs, chain_inputs

from verifiers import (DIAGNOSTIC_KEYS, TokenKind, get_rule, induced_candidates, induced_chain,
                       process_logits, target_probs, verify_candidates, verify_chain)

LOSSLESS = get_rule("lossless")


def _chain(rule=LOSSLESS, seed=0, b=4, k=3, v=10, temperature=1.0, **kw):
    target, draft, x = chain_inputs(seed, b, k, v, temperature)
    gen = torch.Generator().manual_seed(seed) if temperature > 0 else None
    return verify_chain(rule, target, draft, x, temperature=temperature, generator=gen, **kw)


@pytest.mark.parametrize("where, value, text", [
    ("target", math.nan, "target_logits: the logit vector at row 2, position 1 contains NaN"),
    ("target", math.inf, "target_logits: the logit vector at row 2, position 1 contains \\+inf"),
    ("draft", math.nan, "draft_logits: the logit vector at row 2, position 1 contains NaN"),
    ("target_row", -math.inf, "target_logits: the logit vector at row 2, position 1 is all -inf"),
])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_logits_name_tensor_row_and_position(where, value, text, temperature):
    target, draft, x = chain_inputs(0, 4, 3, 10, 1.0)
    if where == "target":
        target[2, 1, 5] = value
    elif where == "draft":
        draft[2, 1, 5] = value
    else:
        target[2, 1] = value
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=text):
        verify_chain(LOSSLESS, target, draft, x, temperature=temperature, generator=gen)


def test_bad_candidate_logits_and_candidates():
    target, cands = candidate_inputs(0, 5, 3, 10)
    gen = torch.Generator().manual_seed(0)
    bad = target.clone()
    bad[3, 2] = math.nan
    with pytest.raises(ValueError, match="target_logits: the logit vector at row 3 contains NaN"):
        verify_candidates(LOSSLESS, bad, cands, temperature=1.0, generator=gen)
    with pytest.raises(ValueError, match="row 1 repeats a token"):
        verify_candidates(LOSSLESS, target, torch.tensor([[1, 2], [3, 3], [0, 1], [1, 0], [2, -1]]),
                          temperature=1.0, generator=gen)
    with pytest.raises(ValueError, match="row 0: -1 padding must come after"):
        verify_candidates(LOSSLESS, target, torch.tensor([[-1, 2]] * 5), temperature=1.0, generator=gen)
    with pytest.raises(ValueError, match=r"candidates\[2, 0\] = 10 is outside the vocabulary"):
        verify_candidates(LOSSLESS, target, torch.tensor([[1], [2], [10], [0], [3]]),
                          temperature=1.0, generator=gen)
    with pytest.raises(ValueError, match=r"candidates shape \[4, 3\] does not match target_logits shape \[5, 10\]"):
        verify_candidates(LOSSLESS, target, cands[:4], temperature=1.0, generator=gen)


def test_shape_mismatches_name_both_shapes():
    target, draft, x = chain_inputs(0, 4, 3, 10, 1.0)
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=r"draft_logits shape \[4, 2, 10\] does not match target_logits shape \[4, 4, 10\]"):
        verify_chain(LOSSLESS, target, draft[:, :2], x, temperature=1.0, generator=gen)
    with pytest.raises(ValueError, match=r"draft_tokens shape \[3, 3\] does not match target_logits shape \[4, 4, 10\]"):
        verify_chain(LOSSLESS, target, draft, x[:3], temperature=1.0, generator=gen)
    with pytest.raises(ValueError, match=r"target_logits must be \[B, K\+1, V\], got shape \[4, 10\]"):
        verify_chain(LOSSLESS, target[:, 0], draft, x, temperature=1.0, generator=gen)
    with pytest.raises(ValueError, match=r"draft_logits shape \[4, 9\] does not match target_logits shape \[4, 10\]"):
        induced_chain(LOSSLESS, target[:, 0], draft[:, 0, :9], temperature=1.0)


@pytest.mark.parametrize("kwargs, text", [
    ({"temperature": -0.5}, "temperature must be a finite number >= 0"),
    ({"temperature": 1.0, "top_k": 0}, "top_k must be None or an integer >= 1"),
    ({"temperature": 1.0, "top_p": 0.0}, r"top_p must be None or in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": 1.5}, r"top_p must be None or in \(0, 1\]"),
    ({"temperature": 1.0, "top_p": True}, r"top_p must be None or in \(0, 1\]"),  # True == 1 would pass a range test
])
def test_bad_sampling_parameters(kwargs, text):
    target, draft, x = chain_inputs(0, 2, 2, 10, 1.0)
    with pytest.raises(ValueError, match=text):
        verify_chain(LOSSLESS, target, draft, x, generator=torch.Generator(), **kwargs)
    with pytest.raises(ValueError, match=text):
        verify_candidates(LOSSLESS, target[:, 0], x, generator=torch.Generator(), **kwargs)


def test_bad_tokens_generator_and_rule():
    target, draft, x = chain_inputs(0, 2, 2, 10, 1.0)
    bad = x.clone()
    bad[1, 1] = 10
    with pytest.raises(ValueError, match=r"draft_tokens\[1, 1\] = 10 is outside the vocabulary \[0, 10\)"):
        verify_chain(LOSSLESS, target, draft, bad, temperature=1.0, generator=torch.Generator())
    bad[1, 1] = -1
    with pytest.raises(ValueError, match=r"draft_tokens\[1, 1\] = -1 is outside"):
        verify_chain(LOSSLESS, target, draft, bad, temperature=1.0, generator=torch.Generator())
    with pytest.raises(ValueError, match="needs an explicit torch.Generator"):
        verify_chain(LOSSLESS, target, draft, x, temperature=1.0, generator=None)
    with pytest.raises(TypeError, match="rule must be a verification rule"):
        verify_chain("lossless", target, draft, x, temperature=1.0, generator=torch.Generator())
    draft[0, 1, x[0, 1]] = -math.inf  # a draft token that q could not have sampled
    with pytest.raises(ValueError, match=r"draft_tokens\[0, 1\] = .* has zero probability under the draft"):
        verify_chain(LOSSLESS, target, draft, x, temperature=1.0, generator=torch.Generator())


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_k_zero_emits_one_bonus_token(case, temperature):
    rule = case.rule()
    res = _chain(rule, b=3, k=0, temperature=temperature, diagnostics=True)
    assert res.tokens.shape == (3, 1) and (res.num_emitted == 1).all()
    assert (res.kinds == int(TokenKind.BONUS)).all() and (res.tokens >= 0).all()
    torch.testing.assert_close(res.behaviour_logprobs, res.target_logprobs)
    assert set(res.diagnostics) == set(DIAGNOSTIC_KEYS)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_empty_batches(temperature):
    gen = torch.Generator() if temperature else None
    res = verify_chain(LOSSLESS, torch.zeros(0, 4, 10), torch.zeros(0, 3, 10),
                       torch.zeros(0, 3, dtype=torch.long), temperature=temperature, generator=gen,
                       diagnostics=True)
    assert res.tokens.shape == (0, 4) and res.num_emitted.shape == (0,)
    assert res.kinds.dtype == torch.int8 and res.diagnostics["tv"].shape == (0, 4)
    out = verify_candidates(LOSSLESS, torch.zeros(0, 10), torch.zeros(0, 3, dtype=torch.long),
                            temperature=temperature, generator=gen)
    assert out.tokens.shape == (0,) and out.accepted_index.shape == (0,)
    assert induced_candidates(LOSSLESS, torch.zeros(0, 10), torch.zeros(0, 2, dtype=torch.long),
                              temperature=1.0).shape == (0, 10)


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_nodes_without_candidates_sample_from_p(case, temperature):
    rule = case.rule()
    target, _ = candidate_inputs(0, 3, 1, 10)
    for empty in (torch.full((3, 2), -1), torch.zeros(3, 0, dtype=torch.long)):
        P = induced_candidates(rule, target, empty, temperature=temperature)
        torch.testing.assert_close(P, target_probs(target, temperature))
        res = verify_candidates(rule, target, empty, temperature=temperature,
                                generator=torch.Generator(), diagnostics=True)
        assert (res.accepted_index == -1).all()
        torch.testing.assert_close(res.behaviour_logprobs, res.target_logprobs)


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
def test_greedy_is_deterministic_with_zero_logprobs(case):
    rule = case.rule()
    target, draft, x = chain_inputs(3, 32, 4, 10, 0.0, case.shift(6.0))
    x[::2, 1] = target[::2, 1].argmax(-1)  # some rows accept beyond the first position
    runs = [verify_chain(rule, target, draft, x, temperature=0.0, generator=gen)
            for gen in (None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))]
    for other in runs[1:]:
        assert torch.equal(runs[0].tokens, other.tokens)
    res = runs[0]
    assert (res.behaviour_logprobs == 0).all()
    v1 = target.argmax(-1)
    rows = torch.arange(32)
    last = res.num_emitted - 1
    assert torch.equal(res.tokens[rows, last], v1[rows, last])  # the final token is the argmax
    accepted = res.kinds == int(TokenKind.ACCEPTED)
    if rule.greedy_second(target) is None:  # only the argmax is ever accepted
        assert torch.equal(res.tokens[accepted], v1[accepted])
        assert not res.relaxed.any()
    else:  # MARS also accepts v2 where its ratio test holds on the raw logits
        second = target.topk(2, -1).indices[..., 1]
        ok = (res.tokens == v1) | (res.tokens == second)
        assert ok[accepted].all() and res.relaxed.any()
        assert (res.target_logprobs[res.relaxed] == -math.inf).all()
    _, cands = candidate_inputs(3, 32, 3, 10, case.shift(6.0))
    out = verify_candidates(rule, target[:, 0], cands, temperature=0.0, generator=None)
    assert (out.behaviour_logprobs == 0).all()
    fell_back = out.accepted_index < 0
    assert torch.equal(out.tokens[fell_back], v1[fell_back, 0])


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("top_k, top_p", [(2, None), (None, 0.5), (3, 0.7)])
def test_support_handling_under_truncation(case, top_k, top_p):
    """No emitted token outside supp P; finite behaviour log-probs; uncovered mass reported."""
    rule = case.rule()
    shift = case.shift(6.0)
    target, draft, x = chain_inputs(4, 256, 3, 12, 1.0, shift)
    res = verify_chain(rule, target, draft, x, temperature=1.0, top_k=top_k, top_p=top_p,
                       generator=torch.Generator().manual_seed(0), diagnostics=True)
    emitted = res.tokens >= 0
    assert torch.isfinite(res.behaviour_logprobs[emitted]).all()
    b, j = emitted.nonzero(as_tuple=True)
    for pos in range(4):
        sel = j == pos
        if pos < 3:
            P = induced_chain(rule, target[b[sel], pos], draft[b[sel], pos], temperature=1.0,
                              top_k=top_k, top_p=top_p)
        else:
            P = target_probs(target[b[sel], pos], 1.0, top_k, top_p)
        assert (P.gather(-1, res.tokens[b[sel], pos, None]) > 0).all()
    if case.name == "lossless":  # P = p: the uncovered mass is the truncated mass of softmax(z / T)
        pi = torch.softmax(target, -1)
        cut = process_logits(target, 1.0, top_k, top_p) == -math.inf
        expected = (pi * cut).sum(-1).masked_fill(~emitted, 0)
        torch.testing.assert_close(res.diagnostics["uncovered"], expected, atol=1e-6, rtol=0)
        assert (expected > 0).any()
    _, cands = candidate_inputs(4, 256, 3, 12)
    out = verify_candidates(rule, target[:, 0], cands, temperature=1.0, top_k=top_k, top_p=top_p,
                            generator=torch.Generator().manual_seed(0), diagnostics=True)
    P = induced_candidates(rule, target[:, 0], cands, temperature=1.0, top_k=top_k, top_p=top_p)
    assert (P.gather(-1, out.tokens[:, None]) > 0).all()
    assert torch.isfinite(out.behaviour_logprobs).all()


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
def test_seeded_runs_are_deterministic(case):
    rule = case.rule()
    target, draft, x = chain_inputs(8, 64, 4, 10, 1.0, case.shift(6.0))

    def run(seed):
        return verify_chain(rule, target, draft, x, temperature=1.0,
                            generator=torch.Generator().manual_seed(seed))

    a, b, c = run(1), run(1), run(2)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.behaviour_logprobs, b.behaviour_logprobs)
    assert not torch.equal(a.tokens, c.tokens)
    _, cands = candidate_inputs(8, 64, 3, 10)
    runs = [verify_candidates(rule, target[:, 0], cands, temperature=1.0,
                              generator=torch.Generator().manual_seed(s)) for s in (1, 1, 2)]
    assert torch.equal(runs[0].tokens, runs[1].tokens)
    assert not torch.equal(runs[0].tokens, runs[2].tokens)


def test_lossless_behaviour_equals_target_and_relaxed_never_fires():
    res = _chain(b=64, k=5, temperature=0.7, top_p=0.9)
    assert res.tokens.dtype == res.num_emitted.dtype == torch.long
    assert res.kinds.dtype == torch.int8 and res.relaxed.dtype == torch.bool
    assert res.behaviour_logprobs.dtype == res.target_logprobs.dtype == torch.float32
    assert torch.equal(res.behaviour_logprobs, res.target_logprobs)
    assert not res.relaxed.any()
    kinds = res.kinds
    assert ((kinds == int(TokenKind.PAD)) == (res.tokens < 0)).all()
    assert ((kinds >= 0).sum(-1) == res.num_emitted).all()
    assert ((kinds == int(TokenKind.BONUS)).any(-1) == (res.num_emitted == 6)).all()
    assert (res.behaviour_logprobs[res.tokens < 0] == 0).all()


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
def test_diagnostics(case):
    rule = case.rule()
    res = _chain(rule, seed=5, b=32, k=3, temperature=1.0, diagnostics=True)
    d = res.diagnostics
    assert set(d) == set(DIAGNOSTIC_KEYS) and all(t.shape == (32, 4) for t in d.values())
    pad = res.tokens < 0
    assert all((t[pad] == 0).all() for t in d.values())
    bonus = res.kinds == int(TokenKind.BONUS)
    assert (d["tv"][bonus].abs() < 1e-6).all()  # the bonus position has P = p
    if case.name == "lossless":
        assert (d["tv"].abs() < 1e-6).all() and (d["kl"].abs() < 1e-5).all()
        torch.testing.assert_close(d["entropy_P"], d["entropy_p"])
    elif case.name != "mars":  # (MARS relaxes only on positive logits, absent here)
        assert (d["tv"] > 1e-3).any()
    assert (d["uncovered"] == 0).all()  # no truncation, every rule here covers supp p
    _, cands = candidate_inputs(5, 16, 3, 10)
    target, _, _ = chain_inputs(5, 16, 0, 10, 1.0)
    out = verify_candidates(rule, target[:, 0], cands, temperature=1.0,
                            generator=torch.Generator(), diagnostics=True)
    assert all(t.shape == (16,) for t in out.diagnostics.values())


@pytest.mark.parametrize("case", [RuleCase("mars", {"theta": 0.9}), RuleCase("typical"),
                                  RuleCase("overshoot", {"lenience": 0.5, "min_p": 0.2})],
                         ids=["mars", "typical", "overshoot-gate"])
def test_large_vocabulary_matches_reference(case):
    """V = 4096 takes the block top-2 path and the chunked pass (several chunks)."""
    from verifiers.reference import reference_chain

    rule = case.rule()
    g = torch.Generator().manual_seed(2)
    target = 6 * torch.randn(40, 4, 4096, generator=g) + 12  # peaked and positive (MARS relaxes)
    draft = target[:, :3] + 0.3 * torch.randn(40, 3, 4096, generator=g)  # close: long accepted runs
    x = torch.multinomial(torch.softmax(draft, -1).reshape(-1, 4096), 1,
                          generator=torch.Generator().manual_seed(0)).reshape(40, 3)
    res = verify_chain(rule, target, draft, x, temperature=1.0, generator=torch.Generator().manual_seed(4))
    ref = reference_chain(rule, target, draft, x, temperature=1.0, generator=torch.Generator().manual_seed(4))
    for b, row in enumerate(ref):
        assert res.tokens[b, :len(row)].tolist() == [t for t, *_ in row]
        torch.testing.assert_close(res.behaviour_logprobs[b, :len(row)],
                                   torch.tensor([lp for _, _, lp, _ in row]), atol=1e-5, rtol=1e-5)
    assert res.num_emitted.float().mean() > 1.5


@pytest.mark.parametrize("use_native", [True, False])
def test_logits_that_overflow_once_divided_by_temperature_are_bad_rows(use_native):
    """A finite logit that becomes +inf at z = logits / T names its row and says it overflowed
    at that temperature (not "all -inf"), on both backends."""
    from verifiers import native

    said = "is finite .* but overflows float32 once divided by the temperature T = 0.5"
    with native.forced(use_native):
        target, draft, x = chain_inputs(3, 2, 2, 10, 0.5)
        target[1, 0, 4] = 3e38
        with pytest.raises(ValueError, match="target_logits: the logit vector at row 1, position 0 " + said):
            verify_chain(LOSSLESS, target, draft, x, temperature=0.5, generator=torch.Generator())
        nodes, cands = candidate_inputs(3, 3, 2, 10)
        nodes[2, 1] = 3e38
        with pytest.raises(ValueError, match="target_logits: the logit vector at row 2 " + said):
            verify_candidates(LOSSLESS, nodes, cands, temperature=0.5, generator=torch.Generator())


def test_rejected_inputs_leave_the_generator_untouched():
    nodes, cands = candidate_inputs(4, 3, 2, 10)
    nodes[1, 3] = math.nan
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="row 1 contains NaN"):
        verify_candidates(LOSSLESS, nodes, cands, temperature=1.0, generator=gen)
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(3, generator=torch.Generator().manual_seed(0)))
    target, draft, x = chain_inputs(4, 2, 2, 10, 1.0)
    draft[0, 1, 2] = math.inf
    with pytest.raises(ValueError, match="draft_logits: the logit vector at row 0, position 1 contains \\+inf"):
        verify_chain(LOSSLESS, target, draft, x, temperature=1.0, generator=gen)
    assert torch.equal(torch.rand(3, generator=gen), torch.rand(6, generator=torch.Generator().manual_seed(0))[3:])


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    """torch's default dtype set to ``dtype`` inside the block, restored after."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
def test_outputs_are_float32_under_a_float64_default_dtype(case):
    """Under torch.set_default_dtype(torch.float64) both backends still return float32 log-probs,
    and agree (the uniforms are then drawn in float64: the same in both)."""
    from verifiers import native

    rule = case.rule()
    target, draft, x = chain_inputs(6, 3, 3, 12, 1.0, case.shift(6.0))
    nodes, cands = candidate_inputs(6, 4, 3, 12)
    runs = []
    with _default_dtype(torch.float64):
        for use in (True, False):
            with native.forced(use):
                runs.append((verify_chain(rule, target, draft, x, temperature=1.0,
                                          generator=torch.Generator().manual_seed(1)),
                             verify_candidates(rule, nodes, cands, temperature=1.0,
                                               generator=torch.Generator().manual_seed(1))))
    for fast, slow in zip(*runs):
        assert torch.equal(fast.tokens, slow.tokens)
        for name in ("behaviour_logprobs", "target_logprobs"):
            assert getattr(fast, name).dtype == getattr(slow, name).dtype == torch.float32
            torch.testing.assert_close(getattr(fast, name), getattr(slow, name), atol=1e-5, rtol=1e-5)


def test_the_block_tree_walk_is_float32_under_a_float64_default_dtype():
    """The block-tree walk under torch.set_default_dtype(torch.float64): the C++ walk returns float32
    log-probs that agree with the PyTorch walk's (its output buffer once followed the default dtype,
    so the kernel's floats were read back as doubles)."""
    from rollout.engine.sampled_tree import sampled_shape
    from verifiers import native
    from verifiers.block_tree import verify_block_tree

    shape = sampled_shape(8, 5, 3)
    children, depths = [list(c) for c in shape.children], list(shape.depths)
    g = torch.Generator().manual_seed(0)
    draft = torch.randn(6, shape.size, 12, generator=g) * 2
    target = draft + torch.randn(6, shape.size, 12, generator=g) * 0.7
    tokens = torch.randint(0, 12, (6, shape.size), generator=g)
    runs = []
    with _default_dtype(torch.float64):
        for use in (True, False):
            with native.forced(use):
                runs.append(verify_block_tree(target, draft, tokens, children, depths, temperature=1.0, top_k=None,
                                              top_p=None, generator=torch.Generator().manual_seed(1)))
    (t1, e1, l1, k1, p1), (t2, e2, l2, k2, p2) = runs
    assert torch.equal(t1, t2) and torch.equal(e1, e2) and torch.equal(k1, k2) and torch.equal(p1, p2)
    assert l1.dtype == l2.dtype == torch.float32 and bool((e1 > 1).any())
    torch.testing.assert_close(l1, l2, atol=2e-4, rtol=1e-5)
