"""The batched verifiers equal the slow loop references token for token on seeded inputs."""

from __future__ import annotations

import pytest
import torch
from verifier_cases import RULE_CASES, RULE_IDS, candidate_inputs, chain_inputs

from verifiers import verify_candidates, verify_chain
from verifiers.reference import reference_candidates, reference_chain

SAMPLING = [(0.0, None, None), (0.7, None, None), (1.0, None, None), (0.7, 4, None),
            (1.0, None, 0.8), (1.0, 5, 0.9)]
SAMPLING_IDS = [f"T{t}-k{k}-p{p}" for t, k, p in SAMPLING]


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-5


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("sampling", SAMPLING, ids=SAMPLING_IDS)
def test_chain_matches_reference(case, sampling):
    temperature, top_k, top_p = sampling
    rule = case.rule()
    shift = case.shift(6.0)  # positive logits so that MARS relaxes somewhere
    target, draft, x = chain_inputs(11, 24, 4, 12, temperature, shift)
    gen = torch.Generator().manual_seed(5)
    res = verify_chain(rule, target, draft, x, temperature=temperature, top_k=top_k, top_p=top_p,
                       generator=gen)
    ref = reference_chain(rule, target, draft, x, temperature=temperature, top_k=top_k,
                          top_p=top_p, generator=torch.Generator().manual_seed(5))
    for b, row in enumerate(ref):
        assert int(res.num_emitted[b]) == len(row)
        assert (res.tokens[b, len(row):] == -1).all() and (res.kinds[b, len(row):] == -1).all()
        for j, (tok, kind, behaviour, target_lp) in enumerate(row):
            assert int(res.tokens[b, j]) == tok, (b, j)
            assert int(res.kinds[b, j]) == int(kind), (b, j)
            assert _close(float(res.behaviour_logprobs[b, j]), behaviour), (b, j)
            assert _close(float(res.target_logprobs[b, j]), target_lp), (b, j)
    assert res.num_emitted.float().mean() > 1.2  # the inputs exercise acceptances


@pytest.mark.parametrize("case", RULE_CASES, ids=RULE_IDS)
@pytest.mark.parametrize("sampling", SAMPLING, ids=SAMPLING_IDS)
def test_candidates_match_reference(case, sampling):
    temperature, top_k, top_p = sampling
    rule = case.rule()
    shift = case.shift(6.0)
    target, cands = candidate_inputs(3, 40, 4, 12, shift)
    res = verify_candidates(rule, target, cands, temperature=temperature, top_k=top_k,
                            top_p=top_p, generator=torch.Generator().manual_seed(9))
    ref = reference_candidates(rule, target, cands, temperature=temperature, top_k=top_k,
                               top_p=top_p, generator=torch.Generator().manual_seed(9))
    for n, (tok, index, behaviour, target_lp) in enumerate(ref):
        assert int(res.tokens[n]) == tok, n
        assert int(res.accepted_index[n]) == index, n
        assert _close(float(res.behaviour_logprobs[n]), behaviour), n
        assert _close(float(res.target_logprobs[n]), target_lp), n
    assert (res.accepted_index >= 0).any() and (res.accepted_index < 0).any()


def test_sampler_never_picks_a_zero_weight_token():
    """u = 0 picks the first positive weight; u * total reaching the total (simulated with u = 1,
    as float rounding could produce) picks the last positive weight, never a zero-weight one."""
    from verifiers import sample_inverse_cdf
    from verifiers.reference import reference_sample

    w = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]])
    for u, expected in ((0.0, 1), (0.25, 1), (0.5, 3), (1 - 2 ** -24, 3), (1.0, 3)):
        assert int(sample_inverse_cdf(w, torch.tensor([u]))) == expected == reference_sample(w[0], u)
    g = torch.Generator().manual_seed(0)
    w = (torch.rand(500, 9, generator=g) > 0.6) * torch.rand(500, 9, generator=g)
    w[:, 4] = 1e-3  # every row has mass
    tok = sample_inverse_cdf(w, torch.rand(500, generator=g))
    assert (w.gather(-1, tok[:, None]) > 0).all()
