"""Verification over deterministic candidates, batched over N nodes (verifiers/README.md,
deterministic candidates): one EAGLE tree node, or one position of a greedy-drafted chain.

Node n has candidates c_1..c_m (distinct, in draft-score order, -1 padded). They are examined
in order: c_i is accepted with probability alpha_i (see ``rules``); the first acceptance
stops; if none is accepted a *recovered* token is sampled from the rule's fallback. The
engine's tree walk composes this node by node (an accepted c_i moves to c_i's children).

Randomness, in this fixed order from ``generator``: ``u_accept = torch.rand(N, m)`` (c_i is
accepted iff u_accept[n, i] < alpha_i), then ``u_final = torch.rand(N)``, which picks the
fallback token by inverse CDF. T = 0 draws nothing.

Backends: sampled nodes on the CPU run fused in C++ (:mod:`.native`, same uniforms); the
PyTorch code below serves other devices and is the fallback.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import native
from .checks import check_candidate_inputs, check_generator, raise_if_bad_rows
from .induced import (NodeQuantities, candidate_diagnostics, checked_softmax, greedy_choice,
                      node_quantities)
from .processing import CHUNK_ELEMENTS, process_logits, sample_inverse_cdf
from .results import CandidateResult, empty_candidate_result
from .rule_base import VerificationRule


def _log_prob(nq: NodeQuantities, cands: Tensor, y: Tensor) -> Tensor:
    """log P(y) [n] = log(sum_i [y = c_i] reach_i alpha_i + reach_{m+1} fallback(y) / |fallback|)."""
    m = cands.shape[1]
    match = (cands == y.unsqueeze(-1)) & (cands >= 0)  # [n, m], at most one True per row
    cand_term = (nq.log_reach[:, :m] + nq.alpha.log()).masked_fill(~match, float("-inf"))
    cand_term = cand_term.amax(-1) if m else torch.full_like(y, float("-inf"), dtype=torch.float32)
    fb_y = nq.fallback.gather(-1, y.unsqueeze(-1)).squeeze(-1)
    fb_term = nq.log_reach[:, m] + fb_y.log() - nq.fallback_mass.log()
    fb_term = torch.where(nq.fallback_mass > 0, fb_term, float("-inf"))
    return torch.logaddexp(cand_term, fb_term)


def _sampled_chunk(rule, raw, cands, u_accept, u_final, temperature, top_k, top_p):
    """Verify one chunk of nodes; returns (tokens, accepted_index, behaviour, target, relaxed)."""
    z = process_logits(raw, temperature, top_k, top_p)  # [n, V]
    nq = node_quantities(rule, z, checked_softmax("target_logits", raw, z, temperature), cands)
    accepted = u_accept < nq.alpha  # [n, m]
    any_acc = accepted.any(-1)
    first = accepted.int().argmax(-1, keepdim=True) if cands.shape[1] else None
    fallback_tok = sample_inverse_cdf(nq.fallback, u_final).clamp_(max=raw.shape[-1] - 1)
    if bool((~any_acc & (nq.fallback_mass <= 0)).any()):
        raise RuntimeError("internal error: a node rejected every candidate but its fallback is empty")
    if first is None:
        y, index, relaxed = fallback_tok, torch.full_like(fallback_tok, -1), torch.zeros_like(any_acc)
    else:
        y = torch.where(any_acc, cands.gather(-1, first).squeeze(-1), fallback_tok)
        index = torch.where(any_acc, first.squeeze(-1), -1)
        gain = nq.alpha.gather(-1, first) > nq.s_c.gather(-1, first)
        relaxed = any_acc & gain.squeeze(-1)
    target = nq.p.gather(-1, y.unsqueeze(-1)).squeeze(-1).log()
    return y, index, _log_prob(nq, cands, y), target, relaxed


def _greedy(rule, raw, cands) -> tuple[Tensor, ...]:
    """T = 0: the first candidate the greedy test accepts, else the argmax; log-probs 0."""
    top, v1 = raw.max(-1)
    if not bool(torch.isfinite(top).all()):
        raise_if_bad_rows("target_logits", raw, top)
    y, index = greedy_choice(rule, raw, cands)
    target = torch.where(y == v1, 0.0, float("-inf"))  # MARS may accept v2, where p = 0
    return y, index, torch.zeros_like(target), target, (index >= 0) & (y != v1)


def _native_nodes(rule, raw, cands, u_accept, u_final, temperature, top_k, top_p) -> CandidateResult:
    """The fused C++ verifier (:mod:`.native`) on the same uniforms."""
    if top_k is not None or top_p is not None:  # truncate here; the kernel then uses T = 1
        z, t = process_logits(raw, temperature, top_k, top_p), 1.0
    else:
        z, t = raw, temperature
    try:
        return native.verify_candidates_native(rule, z, cands, u_accept, u_final, t)
    except native.NativeError as err:
        if err.status == 3:
            raise RuntimeError("internal error: a node rejected every candidate but its fallback is empty") from None
        if err.status == 4:
            check_candidate_inputs(rule, raw, cands, temperature, top_k, top_p)
        raise_if_bad_rows("target_logits", raw, torch.where(err.bad_rows.bool(), float("nan"), 0.0), temperature)
        raise AssertionError("the C++ verifier flagged a bad row that has none") from None


def verify_candidates(rule: VerificationRule, target_logits: Tensor, candidates: Tensor, *,
                      temperature: float, top_k: int | None = None, top_p: float | None = None,
                      generator: torch.Generator | None,
                      diagnostics: bool = False) -> CandidateResult:
    """Verify N nodes: target_logits [N, V], candidates [N, m] (-1 padded, distinct).
    p uses temperature and top-k/top-p; T = 0 is greedy and needs no generator."""
    fused = native.usable(rule, temperature, target_logits.device)
    n, m, v = check_candidate_inputs(rule, target_logits, candidates, temperature, top_k, top_p,
                                     contents=not fused)
    check_generator(generator, temperature, target_logits.device)
    if n == 0:
        return empty_candidate_result(target_logits.device, diagnostics)
    cands = candidates.long()
    with torch.no_grad():
        if temperature == 0:
            out = _greedy(rule, target_logits, cands)
        else:
            dev = target_logits.device
            state = generator.get_state()  # restored if the inputs are rejected
            u_accept = torch.rand(n, m, generator=generator, device=dev)
            u_final = torch.rand(n, generator=generator, device=dev)
            try:
                if fused:
                    res = _native_nodes(rule, target_logits, cands, u_accept, u_final, temperature, top_k, top_p)
                    if diagnostics:
                        res = dataclasses.replace(res, diagnostics=candidate_diagnostics(
                            rule, target_logits, cands, res.tokens, temperature, top_k, top_p))
                    return res
                step = max(1, CHUNK_ELEMENTS // v)
                parts = [_sampled_chunk(rule, target_logits[s:s + step], cands[s:s + step],
                                        u_accept[s:s + step], u_final[s:s + step],
                                        temperature, top_k, top_p) for s in range(0, n, step)]
            except ValueError:
                generator.set_state(state)
                raise
            out = tuple(torch.cat([part[i] for part in parts]) for i in range(5))
        diag = None
        if diagnostics:
            diag = candidate_diagnostics(rule, target_logits, cands, out[0], temperature, top_k, top_p)
    tokens, index, behaviour, target, relaxed = out
    return CandidateResult(tokens, index, behaviour.float(), target.float(), relaxed, diag)
