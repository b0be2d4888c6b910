"""The verifiers on CUDA (marker ``gpu``) against the closed forms and references of the CPU tests.

On a non-CPU device the verifiers take their PyTorch paths (the C++ kernels serve the CPU alone)
and a sampled tree is walked by the batched ``walk_rows``. Each test runs twice: on ``cuda``
(``gpu``; skipped without a device) and on the ``cpu`` in the default run, where the same paths
are forced (the kernels bypassed, ``walk_rows`` in place of the CPU's row-by-row walk), so each
body is known to pass and to fail on a broken walk. What each one checks:

- chain verification, every rule (``verifier_cases``): the law of the emitted tokens at every
  position is the closed form ``induced_chain`` (Monte Carlo, ``assert_matches``) and
  exp(behaviour log-prob) = P(y), as ``test_verifiers_montecarlo.py``; candidate verification
  likewise, the truncation baselines too (``test_truncation_sampling.py``);
- block verification (``verifiers/block.py``): the emitted sequences follow the enumerated law
  of a round (``test_block.py``'s tables), log-probs are log p; its rows equal the plain-loop
  reference token for token on the same uniforms;
- block verification of a sampled tree (``verifiers/block_tree.py``): the first two tokens follow
  p (``test_block_tree.py``'s tables), log-probs are log p (``walk_rows`` on the device against
  the row-by-row ``walk_row`` on the same uniforms: ``test_block_tree_backends.py``, also ``gpu``).
"""

from __future__ import annotations

import math

import pytest
import test_block as chain_tables
import test_block_tree as tree_tables
import test_truncation_sampling as truncation
import torch
from test_verifiers_montecarlo import N, V, _case_logits, assert_matches
from verifier_cases import RULE_CASES, RULE_IDS

from verifiers import block, block_tree, get_rule, induced_candidates, induced_chain, native, target_probs
from verifiers import verify_candidates, verify_chain
from verifiers.block_tree import verify_block_tree, walk_rows
from verifiers.processing import draft_probs
from verifiers.reference import reference_block_chain

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def chain_backend():
    """Overrides ``conftest.py``'s: one run, on the PyTorch code (the only code CUDA runs)."""
    with native.forced(False):
        yield "torch"


@pytest.fixture(params=DEVICES)
def device(request, monkeypatch) -> torch.device:
    """The device under test; on the CPU a sampled tree is walked as on CUDA (``walk_rows``)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setattr(block_tree, "walk_each_row", walk_rows)
    return torch.device(request.param)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def _draws(device: torch.device) -> int:
    """Verifications per Monte Carlo case: ``N`` on CUDA, a quarter on the (shared) CPU."""
    return N if device.type == "cuda" else N // 4


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, None, None), (0.8, None, 0.85), (0.9, 4, None)])
def test_chain_law_and_behaviour_logprobs(device, case, temperature, top_k, top_p):
    """N verifications of one K = 2 chain on the device: each position's tokens follow the closed
    form P (the bonus position: p), and exp(behaviour log-prob) = P(y)."""
    rule, k, n = case.rule(), 2, _draws(device)
    target, draft = _case_logits(21, k, case.shift(3.0))
    gen = _generator(device, 1234)
    q = torch.softmax(draft / temperature, -1).to(device)  # [K, V]
    x = torch.stack([torch.multinomial(q[j], n, replacement=True, generator=gen) for j in range(k)], 1)
    res = verify_chain(rule, target.to(device).expand(n, k + 1, V), draft.to(device).expand(n, k, V), x,
                       temperature=temperature, top_k=top_k, top_p=top_p, generator=gen)
    assert res.tokens.device.type == device.type
    P = induced_chain(rule, target[:k], draft, temperature=temperature, top_k=top_k, top_p=top_p)  # [K, V]
    P = torch.cat([P, target_probs(target[k:], temperature, top_k=top_k, top_p=top_p)])
    tokens, emitted, behaviour = res.tokens.cpu(), res.num_emitted.cpu(), res.behaviour_logprobs.cpu()
    for j in range(k + 1):
        reached = emitted > j
        assert reached.sum() > n / 40
        y = tokens[reached, j]
        assert_matches(y, P[j])
        torch.testing.assert_close(behaviour[reached, j].exp(), P[j][y].float(), atol=1e-5, rtol=1e-5)
    assert torch.isfinite(behaviour).all()


CANDIDATE_CASES = RULE_CASES + truncation.CASES
CANDIDATE_IDS = RULE_IDS + truncation.IDS


@pytest.mark.parametrize("case", CANDIDATE_CASES, ids=CANDIDATE_IDS)
def test_candidate_law_and_behaviour_logprobs(device, case):
    """N verifications of one node's candidates on the device: the closed form
    ``induced_candidates``, exp(behaviour log-prob) = P(y), accepted tokens are the candidates."""
    rule, n = case.rule(), _draws(device)
    target, _ = _case_logits(22, 0, case.shift(3.0))
    c = torch.tensor([[1, 3, 6, 0, 2, 5]])
    res = verify_candidates(rule, target.to(device).expand(n, V), c.to(device).expand(n, c.shape[1]),
                            temperature=0.9, generator=_generator(device, 99))
    P = induced_candidates(rule, target, c, temperature=0.9)[0]
    tokens, index = res.tokens.cpu(), res.accepted_index.cpu()
    assert_matches(tokens, P)
    torch.testing.assert_close(res.behaviour_logprobs.cpu().exp(), P[tokens].float(), atol=1e-5, rtol=1e-5)
    accepted = index >= 0
    assert torch.equal(tokens[accepted], c[0][index[accepted]])


@pytest.mark.parametrize("top_k", [None, 2])
def test_block_verification_follows_the_enumerated_law(device, top_k):
    """Blocks drafted from ``test_block.py``'s autoregressive tables, verified on the device: the
    emitted sequences follow the enumerated law of a round; the log-probs are log p."""
    tables, p, q = chain_tables._tables(4, top_k)
    rows = 4 * _draws(device) // 10  # 80,000 on CUDA
    target, draft, drafts = chain_tables._batch(tables, rows, seed=5)
    res = verify_chain(get_rule("lossless"), target.to(device), draft.to(device), drafts.to(device), temperature=1.0,
                       top_k=top_k, generator=_generator(device, 6), test="block")
    law = chain_tables._round_law(p, q, "block")
    outcomes = sorted(law)
    index = {out: i for i, out in enumerate(outcomes)}
    emitted = [tuple(row[:n]) for row, n in zip(res.tokens.tolist(), res.num_emitted.tolist())]
    assert_matches(torch.tensor([index[out] for out in emitted]), torch.tensor([law[out] for out in outcomes]))
    behaviour = res.behaviour_logprobs.cpu()
    for row in range(0, rows, 997):
        seq = emitted[row]
        want = [math.log(float(p[seq[:j]][seq[j]])) for j in range(len(seq))]
        assert behaviour[row, :len(seq)].tolist() == pytest.approx(want, abs=1e-5)
    assert torch.equal(res.behaviour_logprobs, res.target_logprobs) and not res.relaxed.any()


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.8, 6, 0.9)])
def test_block_rows_equal_the_reference_on_the_same_uniforms(device, temperature, top_k, top_p):
    """``block._rows`` on the device, on uniforms drawn as ``reference_block_chain`` draws them,
    emits the reference's tokens and log-probs."""
    g = torch.Generator().manual_seed(7)
    b, k, v = 200, 5, 13
    target = torch.randn(b, k + 1, v, generator=g) * 2
    draft = target[:, :k] + torch.randn(b, k, v, generator=g)
    draft[:, :, 0] = -math.inf
    drafts = torch.multinomial(draft_probs(draft, temperature).reshape(-1, v), 1, generator=g).view(b, k)
    kw = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    ref = reference_block_chain(target, draft, drafts, generator=torch.Generator().manual_seed(8), **kw)
    u = torch.Generator().manual_seed(8)
    u_block, u_final = torch.rand(b, k + 1, generator=u, dtype=torch.float64), torch.rand(b, generator=u)
    tokens, n, lp = block._rows(*(t.to(device) for t in (target, draft, drafts, u_block, u_final)), **kw)
    tokens, n, lp = tokens.cpu(), n.cpu(), lp.cpu()
    for row, want in enumerate(ref):
        m = int(n[row]) + 1
        assert tokens[row, :m].tolist() == [t for t, *_ in want], row
        assert lp[row, :m].tolist() == pytest.approx([x for *_, x, _ in want], abs=1e-5), row
    assert len(set(n.tolist())) >= 3  # rejections early, late and (for some rows) none


def test_sampled_tree_block_verification_follows_p(device):
    """Trees of ``test_block_tree.py``'s shape drafted from its tables, walked on the device: the
    first token follows p, the first two (a one-token round continued by p) too; the log-probs
    are log p, the kinds and paths consistent."""
    tables, p, _ = tree_tables._tables(0)
    g = torch.Generator().manual_seed(3)
    n = 6000
    tokens = tree_tables._draft_trees(tables, n, g)
    rows = [tree_tables._row_inputs(tables, [int(t) for t in row]) for row in tokens]
    target = torch.stack([t for t, _ in rows]).float()
    draft = torch.stack([d for _, d in rows]).float()
    out, emitted, logp, kinds, path = (
        x.cpu() for x in verify_block_tree(target.to(device), draft.to(device), tokens.to(device),
                                           tree_tables.CHILDREN, tree_tables.DEPTHS, temperature=1.0, top_k=None,
                                           top_p=None, generator=_generator(device, 3)))
    tree_tables.check_rounds_follow_p(p, out, emitted, logp, kinds, path, g)
