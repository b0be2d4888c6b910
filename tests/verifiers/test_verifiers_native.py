"""The fused C++ verifiers (chains and candidate nodes) against the PyTorch ones on the
model's vocabulary (several sampling blocks), their thread-count invariance, Monte Carlo
checks whose support spans every sampling block, and what happens where they cannot be built."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch
from test_verifiers_montecarlo import assert_matches
from verifier_cases import KERNEL_CASES, KERNEL_IDS, candidate_inputs, chain_inputs

from verifiers import (get_rule, induced_candidates, induced_chain, native, target_probs,
                       verify_candidates, verify_chain)


@pytest.fixture(autouse=True)
def chain_backend():  # overrides the two-backend fixture: these tests pick their backend
    yield None


def _both(verify, *args, seed, **kw):
    """``verify(*args, **kw)`` on the C++ backend, then on the PyTorch one, same seed."""
    out = []
    for use in (True, False):
        with native.forced(use):
            out.append(verify(*args, generator=torch.Generator().manual_seed(seed), **kw))
    return out


@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
@pytest.mark.parametrize("sampling", [(1.0, None, None), (0.8, None, 0.9), (0.7, 50, None)],
                         ids=["T1", "T0.8-p0.9", "T0.7-k50"])
def test_native_equals_torch_on_the_model_vocabulary(case, sampling):
    temperature, top_k, top_p = sampling
    rule = case.rule()
    target, draft, x = chain_inputs(3, 4, 5, 49152, temperature, case.shift(8.0))
    target = target * 1.5  # peakier rows: longer accepted prefixes
    fast, slow = _both(verify_chain, rule, target, draft, x, seed=7, temperature=temperature, top_k=top_k,
                       top_p=top_p)
    assert torch.equal(fast.tokens, slow.tokens)
    assert torch.equal(fast.num_emitted, slow.num_emitted)
    assert torch.equal(fast.kinds, slow.kinds)
    assert torch.equal(fast.relaxed, slow.relaxed)
    torch.testing.assert_close(fast.behaviour_logprobs, slow.behaviour_logprobs, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(fast.target_logprobs, slow.target_logprobs, atol=2e-5, rtol=1e-5)
    assert (fast.tokens > 512).any()  # tokens come from beyond the first sampling block


@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
@pytest.mark.parametrize("sampling", [(1.0, None, None), (0.8, None, 0.9)], ids=["T1", "T0.8-p0.9"])
def test_native_candidates_equal_torch_on_the_model_vocabulary(case, sampling):
    temperature, top_k, top_p = sampling
    rule = case.rule()
    target, cands = candidate_inputs(4, 12, 4, 49152, case.shift(8.0))
    target = target * 1.5
    fast, slow = _both(verify_candidates, rule, target, cands, seed=8, temperature=temperature, top_k=top_k,
                       top_p=top_p)
    assert torch.equal(fast.tokens, slow.tokens)
    assert torch.equal(fast.accepted_index, slow.accepted_index)
    assert torch.equal(fast.relaxed, slow.relaxed)
    torch.testing.assert_close(fast.behaviour_logprobs, slow.behaviour_logprobs, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(fast.target_logprobs, slow.target_logprobs, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [50, 49152])
def test_native_equals_torch_when_mars_ties(vocab):
    """bf16-rounded logits tie often, the runner-up too: both backends pick the lowest index
    (processing.top2's rule), so MARS accepts the same second token."""
    rule = get_rule("mars", theta=0.5)
    target, draft, x = chain_inputs(8, 64, 3, vocab, 1.0, 6.0)
    target = target.to(torch.bfloat16).float()
    target[:, :, [vocab - 1, 7, 2]] = target.amax(-1, keepdim=True)[..., :1] + 0.5  # tie for first
    target[:8, :, 7] -= 0.25  # some rows: a tie for second place (2 with vocab - 1)
    x[:, 0] = 2  # a draft that is v1 or v2 only under the lowest-index rule
    fast, slow = _both(verify_chain, rule, target, draft, x, seed=3, temperature=1.0)
    assert torch.equal(fast.tokens, slow.tokens) and torch.equal(fast.kinds, slow.kinds)
    torch.testing.assert_close(fast.behaviour_logprobs, slow.behaviour_logprobs, atol=2e-5, rtol=1e-5)
    nodes = target[:, 0]
    cands = torch.stack([torch.full((64,), vocab - 1), torch.full((64,), 7)], 1)
    out = _both(verify_candidates, rule, nodes, cands, seed=4, temperature=1.0)
    assert torch.equal(out[0].tokens, out[1].tokens) and torch.equal(out[0].accepted_index, out[1].accepted_index)
    torch.testing.assert_close(out[0].behaviour_logprobs, out[1].behaviour_logprobs, atol=2e-5, rtol=1e-5)
    # every row relaxes; v1 = 2 (lowest of the tied first), v2 = vocab - 1 where 7 was lowered, else 7
    assert out[0].accepted_index.tolist() == [0] * 8 + [1] * 56


@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
def test_native_results_do_not_depend_on_the_thread_count(case):
    rule = case.rule()
    target, draft, x = chain_inputs(5, 3, 4, 3000, 1.0, case.shift(6.0))
    saved = torch.get_num_threads()
    runs = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with native.forced(True):
                runs.append(verify_chain(rule, target, draft, x, temperature=1.0,
                                         generator=torch.Generator().manual_seed(2)))
    finally:
        torch.set_num_threads(saved)
    for other in runs[1:]:
        for name in ("tokens", "num_emitted", "behaviour_logprobs", "target_logprobs", "kinds", "relaxed"):
            assert torch.equal(getattr(runs[0], name), getattr(other, name)), name
    target, cands = candidate_inputs(6, 9, 3, 3000, case.shift(6.0))
    nodes = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            with native.forced(True):
                nodes.append(verify_candidates(rule, target, cands, temperature=1.0,
                                               generator=torch.Generator().manual_seed(2)))
    finally:
        torch.set_num_threads(saved)
    for other in nodes[1:]:
        for name in ("tokens", "accepted_index", "behaviour_logprobs", "target_logprobs", "relaxed"):
            assert torch.equal(getattr(nodes[0], name), getattr(other, name)), name


SPREAD = [3, 511, 512, 1030, 1535, 1599]  # the live tokens, in all four sampling blocks of V = 1600


@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
def test_native_monte_carlo_across_sampling_blocks(case):
    """Like test_verifiers_montecarlo, with V = 1600 whose mass sits on tokens in every block of
    the kernel's two-level inverse-CDF search (the other tokens have p and q near 1e-13)."""
    n, k, v = 100_000, 2, 1600
    g = torch.Generator().manual_seed(31)
    shift = case.shift(3.0)
    target = torch.full((k + 1, v), -30.0)
    draft = torch.full((k, v), -30.0)
    target[:, SPREAD] = torch.randn(k + 1, len(SPREAD), generator=g) * 1.5 + shift
    draft[:, SPREAD] = target[:k, SPREAD] + torch.randn(k, len(SPREAD), generator=g) * 0.7
    draft[0, SPREAD[0]] = -math.inf  # a live target token outside the draft vocabulary
    rule = case.rule()
    q = torch.softmax(draft, -1)
    x = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=g) for j in range(k)], 1)
    with native.forced(True):
        res = verify_chain(rule, target.expand(n, k + 1, v), draft.expand(n, k, v), x, temperature=1.0,
                           generator=g)
    P = torch.cat([induced_chain(rule, target[:k], draft, temperature=1.0), target_probs(target[k:], 1.0)])
    for j in range(k + 1):
        reached = res.num_emitted > j
        assert reached.sum() > 5000
        y = res.tokens[reached, j]
        assert_matches(y, P[j])
        torch.testing.assert_close(res.behaviour_logprobs[reached, j].exp(), P[j][y].float(), atol=1e-5, rtol=1e-5)
    assert torch.isin(res.tokens[res.tokens >= 0], torch.tensor(SPREAD)).float().mean() > 0.999


@pytest.mark.parametrize("case", KERNEL_CASES, ids=KERNEL_IDS)
def test_native_candidate_monte_carlo_across_sampling_blocks(case):
    """Candidates at three of the live tokens of V = 1600; rejections sample the fallback over
    the rest, in all four sampling blocks."""
    n, v = 100_000, 1600
    g = torch.Generator().manual_seed(32)
    target = torch.full((1, v), -30.0)
    target[0, SPREAD] = torch.randn(len(SPREAD), generator=g) * 1.5 + (case.shift(3.0))
    cands = torch.tensor([[SPREAD[2], SPREAD[4], SPREAD[0]]])
    rule = case.rule()
    with native.forced(True):
        res = verify_candidates(rule, target.expand(n, v), cands.expand(n, 3), temperature=0.9, generator=g)
    P = induced_candidates(rule, target, cands, temperature=0.9)[0]
    assert_matches(res.tokens, P)
    torch.testing.assert_close(res.behaviour_logprobs.exp(), P[res.tokens].float(), atol=1e-5, rtol=1e-5)
    accepted = res.accepted_index >= 0
    assert torch.equal(res.tokens[accepted], cands[0][res.accepted_index[accepted]])


def _run_without_compiler(mode: str, tmp_path) -> subprocess.CompletedProcess:
    code = ("import torch, warnings; warnings.simplefilter('always')\n"
            "from verifiers import get_rule, verify_chain, native\n"
            "t = torch.randn(2, 3, 50); d = t[:, :2] + torch.randn(2, 2, 50)\n"
            "x = torch.multinomial(torch.softmax(d, -1).reshape(-1, 50), 1).reshape(2, 2)\n"
            "r = verify_chain(get_rule('lossless'), t, d, x, temperature=1.0, generator=torch.Generator())\n"
            "print('emitted', int(r.num_emitted.sum()), 'native', native.enabled())\n")
    env = dict(os.environ, CXX="no-such-compiler-xyz", HONEST_ROLLOUTS_CACHE=str(tmp_path),
               HONEST_ROLLOUTS_NATIVE=mode)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)


def test_without_a_compiler_auto_falls_back_and_required_raises(tmp_path):
    auto = _run_without_compiler("auto", tmp_path)
    assert auto.returncode == 0, auto.stderr
    assert "native False" in auto.stdout and "emitted" in auto.stdout
    assert "no C++ compiler 'no-such-compiler-xyz'" in auto.stderr  # the one warning says why
    required = _run_without_compiler("1", tmp_path)
    assert required.returncode != 0
    assert "RuntimeError: no C++ compiler 'no-such-compiler-xyz'" in required.stderr


def test_kernel_declarations_match_the_kernels_table():
    """A rule's kernel id names the same rule, with as many arguments, in csrc/rules.h; a
    declaration that does not (min-p's class under typical's id) is refused."""
    from verifiers.rules import MinP

    for case in KERNEL_CASES:
        rule = case.rule()
        prm = native.params(rule)
        assert prm.rule == rule.kernel_id and list(prm.args)[:len(rule.kernel_args())] == list(rule.kernel_args())

    class Misdeclared(MinP):
        kernel_id = 3

    with pytest.raises(RuntimeError, match="declares kernel id 3 with 1 arguments, but the kernel implements 'typical'"):
        native.params(Misdeclared())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_native_overshoot_logprobs_equal_the_float64_closed_form_on_flat_rows(temperature):
    """Flat 49152-token rows: a recovered token's P = g + rejected R carries the rejected mass and
    TV, sums over the whole row. Summed in float32 lanes of ~3000 terms they cost up to 5e-6 in
    log P here (1.2e-4 on a vLLM-verified position of the embedded model, an Intel Xeon,
    2026-12-02); summed in float64, 6e-7 (the float32 rounding of the terms themselves)."""
    rule = get_rule("overshoot", lenience=0.9)
    g = torch.Generator().manual_seed(11)
    b, v = 64, 49152
    target = torch.randn(b, 2, v, generator=g) * 0.5
    draft = target[:, :1] + torch.randn(b, 1, v, generator=g)
    q = torch.softmax(draft.double() / temperature, -1)
    x = torch.multinomial(q[:, 0].float(), 1, generator=g)
    with native.forced(True):
        res = verify_chain(rule, target, draft, x, temperature=temperature, generator=torch.Generator().manual_seed(3))
    p = torch.softmax(target[:, 0].double() / temperature, -1)
    gmass = torch.minimum(q[:, 0], p / rule.lenience)
    rejected = (q[:, 0] - gmass).sum(-1, keepdim=True)
    resid = (p - q[:, 0]).clamp(min=0)
    induced = gmass + rejected * resid / resid.sum(-1, keepdim=True)
    y = res.tokens[:, 0]
    recovered = res.kinds[:, 0] == 1
    assert int(recovered.sum()) >= 5  # the ill-conditioned case is exercised
    want = induced.gather(1, y[:, None])[:, 0].log()
    err = (res.behaviour_logprobs[:, 0].double() - want).abs()
    assert float(err.max()) < 1.5e-6, float(err.max())
