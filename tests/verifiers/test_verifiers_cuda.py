"""Block verification on CUDA (marker ``gpu``) against the closed forms and references of the CPU tests.

The chain and candidate laws of every rule on CUDA are checked where the CPU checks them, by the
same test bodies with a device parameter (``verifier_cases.on_devices``; ``gpu`` on CUDA):
``test_verifiers_montecarlo.py`` (``test_chain_monte_carlo``, ``test_candidates_monte_carlo``:
the emitted tokens follow the closed forms ``induced_chain`` / ``induced_candidates``, Monte Carlo
with ``assert_matches``, and exp(behaviour log-prob) = P(y)) and ``test_truncation_sampling.py``
(``test_monte_carlo``, the truncation baselines). ``scripts/gpu_check.sh`` runs those files too.

On a non-CPU device the verifiers take their PyTorch paths (the C++ kernels serve the CPU alone)
and a sampled tree is walked by the batched ``walk_rows``. Each test runs twice: on ``cuda``
(``gpu``; skipped without a device) and on the ``cpu`` in the default run, where the same paths
are forced (the kernels bypassed, ``walk_rows`` in place of the CPU's row-by-row walk), so each
body is known to pass and to fail on a broken walk. What each one checks:

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
import torch
from test_verifiers_montecarlo import N, assert_matches

from verifiers import block, block_tree, get_rule, native, verify_chain
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
    """The device under test (this module's own, in place of ``conftest.py``'s); on the CPU a
    sampled tree is walked as on CUDA (``walk_rows``)."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    monkeypatch.setattr(block_tree, "walk_each_row", walk_rows)
    return torch.device(request.param)


def _generator(device: torch.device, seed: int) -> torch.Generator:
    return torch.Generator(device).manual_seed(seed)


def _draws(device: torch.device) -> int:
    """Verifications per Monte Carlo case: ``N`` on CUDA, a quarter on the (shared) CPU."""
    return N if device.type == "cuda" else N // 4


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
