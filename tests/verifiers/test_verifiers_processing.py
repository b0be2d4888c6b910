"""Sampling processing (temperature, top-k, top-p) and the top-2 search MARS uses."""

from __future__ import annotations

import math

import pytest
import torch

from verifiers import process_logits
from verifiers.processing import top2


def test_top_k_and_top_p_processing():
    z = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]])
    assert torch.equal(process_logits(z, 1.0, top_k=2) > -math.inf,
                       torch.tensor([[True, True, True, False, False]]))  # ties at the k-th kept
    p = torch.softmax(z, -1)[0]
    kept = process_logits(z, 1.0, top_p=float(p[0]) + 1e-3) > -math.inf
    assert kept.tolist() == [[True, True, True, False, False]]  # smallest prefix reaching top_p
    assert (process_logits(z, 1.0, top_p=float(p[0]) - 1e-3) > -math.inf).sum() == 1
    assert torch.equal(process_logits(z, 0.5), z / 0.5)
    greedy = process_logits(torch.tensor([[0.0, 3.0, 3.0]]), 0.0)
    assert greedy.tolist() == [[-math.inf, 0.0, -math.inf]]  # first argmax on ties


@pytest.mark.parametrize("vocab", [10, 4096, 49152, 5003])
def test_top2_matches_topk(vocab):
    """The two-level top-2 search (large vocabularies) returns exactly torch.topk's answer."""
    g = torch.Generator().manual_seed(vocab)
    z = torch.randn(3, 5, vocab, generator=g)
    z[0, 0, 7] = -math.inf
    z[1, 2, :] = -math.inf
    z[1, 2, vocab - 1] = 0.0  # a single finite logit: z2 = -inf
    z1, z2, v1, v2 = top2(z)
    ref = z.topk(2, -1)
    assert torch.equal(z1, ref.values[..., 0]) and torch.equal(z2, ref.values[..., 1])
    assert torch.equal(v1[z2 > -math.inf], ref.indices[..., 0][z2 > -math.inf])
    assert torch.equal(v2[z2 > -math.inf], ref.indices[..., 1][z2 > -math.inf])
    assert int(v1[1, 2]) == vocab - 1


@pytest.mark.parametrize("vocab", [10, 4096, 49152, 5003])
def test_top2_breaks_ties_by_lowest_index(vocab):
    """Tied maxima and tied runners-up (common with bf16 logits) resolve to the lowest index,
    inside one block, across blocks and with multiplicity, as the C++ verifier resolves them."""
    g = torch.Generator().manual_seed(vocab)
    z = (torch.randn(6, vocab, generator=g) * 2).to(torch.bfloat16).float()  # many ties
    hi = vocab - 2
    z[0, [hi, 3, 5]] = 50.0  # a tied max: v1 = 3, v2 = 5 (same value)
    z[1, hi] = 60.0
    z[1, [hi - 1, 2]] = 50.0  # tied runner-up in different places: v2 = 2
    z[2, [1, 4]] = 50.0
    z[2, 0] = 60.0  # runner-up tied inside v1's block: v2 = 1
    z[3, [hi, 0]] = 50.0  # tied max at both ends: v1 = 0, v2 = hi
    z1, z2, v1, v2 = top2(z)
    for r in range(len(z)):
        order = sorted(range(vocab), key=lambda i: (-float(z[r, i]), i))  # value desc, index asc
        assert (int(v1[r]), int(v2[r])) == (order[0], order[1]), r
        assert float(z1[r]) == float(z[r, order[0]]) and float(z2[r]) == float(z[r, order[1]])
    assert [int(v) for v in v1[:4]] == [3, hi, 0, 0] and [int(v) for v in v2[:4]] == [5, 2, 1, hi]
