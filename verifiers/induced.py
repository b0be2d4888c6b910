"""Closed forms of the induced distribution P, and the per-position diagnostics built on them.

Chain mode: P = sum_x q(x) [a(x) delta_x + (1 - a(x)) r_x] (each rule's ``induced``).
Candidate mode: with reach_i = prod_{j<i} (1 - alpha_j),
P = sum_i reach_i alpha_i delta_{c_i} + reach_{m+1} fallback / |fallback|.
At T = 0 every P is a point mass on the (deterministic) emitted token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .checks import check_candidate_inputs, check_pair_inputs, raise_if_bad_rows
from .processing import CHUNK_ELEMENTS, draft_logits, process_logits
from .rule_base import VerificationRule


@dataclass
class NodeQuantities:
    """Everything the candidate procedure needs at N nodes with m candidate slots."""

    p: Tensor  # [N, V] target distribution
    s_c: Tensor  # [N, m] s(c_i): p(c_i) with c_1..c_{i-1} zeroed and renormalised (lossless state)
    alpha: Tensor  # [N, m] acceptance probability of c_i once reached (0 on padding)
    fallback: Tensor  # [N, V] unnormalised fallback weights (when every candidate is rejected)
    fallback_mass: Tensor  # [N] their sum
    log_reach: Tensor  # [N, m+1] log prob of reaching c_i (index m: reaching the fallback)


def node_quantities(rule: VerificationRule, z: Tensor, p: Tensor, cands: Tensor) -> NodeQuantities:
    """Acceptance probabilities and fallback of each node (z, p = softmax(z) [N, V]; cands [N, m])."""
    ctx = rule.context(z, p)
    valid = cands >= 0
    cc = cands.clamp(min=0)
    p_at = p.gather(-1, cc)  # [N, m]
    p_c = p_at * valid
    # p without any candidate; padding slots (index 0) write p back (amin resolves duplicates)
    p_rest = p.scatter_reduce(-1, cc, torch.where(valid, 0.0, p_at), reduce="amin")
    # remaining mass when c_i is examined: non-candidates plus c_i..c_m (no cancellation)
    remaining = p_rest.sum(-1, keepdim=True) + p_c.flip(-1).cumsum(-1).flip(-1)
    s_c = torch.where(remaining > 0, p_c / remaining, 0.0).clamp_(max=1)
    alpha = rule.node_alpha(s_c, p_at, cc, ctx)
    alpha = torch.where(valid, alpha, 0.0)
    fallback = rule.node_fallback(p, p_rest, ctx)
    log_reach = torch.cat([alpha.new_zeros(alpha.shape[0], 1), torch.log1p(-alpha).cumsum(-1)], -1)
    return NodeQuantities(p, s_c, alpha, fallback, fallback.sum(-1), log_reach)


def induced_from_nodes(nq: NodeQuantities, cands: Tensor) -> Tensor:
    """P [N, V] of the candidate procedure."""
    m = cands.shape[1]
    weight = nq.log_reach[:, :m].exp() * nq.alpha  # [N, m], 0 on padding
    fb_scale = torch.where(nq.fallback_mass > 0, nq.log_reach[:, m].exp() / nq.fallback_mass, 0.0)
    out = nq.fallback * fb_scale.unsqueeze(-1)
    return out.scatter_add_(-1, cands.clamp(min=0), weight)


def one_hot(tokens: Tensor, vocab: int) -> Tensor:
    """Point masses [..., V] (float32) at tokens [...]."""
    out = torch.zeros(*tokens.shape, vocab, dtype=torch.float32, device=tokens.device)
    return out.scatter_(-1, tokens.unsqueeze(-1), 1.0)


def greedy_accepts(rule: VerificationRule, target_logits: Tensor, tokens: Tensor) -> Tensor:
    """T = 0: whether each token [...] (or [..., m]) is accepted given target logits [..., V]."""
    v1 = target_logits.argmax(-1)
    second = rule.greedy_second(target_logits)
    if tokens.dim() > v1.dim():
        v1 = v1.unsqueeze(-1)
        second = None if second is None else (second[0].unsqueeze(-1), second[1].unsqueeze(-1))
    ok = tokens == v1
    if second is not None:
        ok |= second[0] & (tokens == second[1])
    return ok


def greedy_choice(rule: VerificationRule, target_logits: Tensor, cands: Tensor) -> tuple[Tensor, Tensor]:
    """T = 0 at N nodes: (emitted token [N], index of the accepted candidate [N] or -1): the
    first candidate the rule's greedy test accepts, else the argmax."""
    v1 = target_logits.argmax(-1)
    if cands.shape[1] == 0:
        return v1, torch.full_like(v1, -1)
    ok = greedy_accepts(rule, target_logits, cands) & (cands >= 0)  # [N, m]
    any_ok = ok.any(-1)
    first = ok.int().argmax(-1, keepdim=True)
    y = torch.where(any_ok, cands.gather(-1, first).squeeze(-1), v1)
    return y, torch.where(any_ok, first.squeeze(-1), -1)


def _chunks(n: int, row_elems: int):
    step = max(1, CHUNK_ELEMENTS // max(1, row_elems))
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def checked_softmax(name: str, raw: Tensor, z: Tensor, temperature: float | None = None) -> Tensor:
    """softmax(z) [..., V]; raises naming ``name`` and the row if a row is NaN (bad logits, or
    finite logits that overflow once divided by ``temperature``)."""
    p = torch.softmax(z, -1)
    if p.numel() and bool(p[..., 0].isnan().any()):
        raise_if_bad_rows(name, raw, p[..., 0], temperature)
    return p


def induced_chain(rule: VerificationRule, target_logits: Tensor, draft_logits_: Tensor, *,
                  temperature: float, top_k: int | None = None, top_p: float | None = None) -> Tensor:
    """Closed-form P [N, V] of chain verification with x ~ q at N independent positions
    (target_logits, draft logits [N, V]). At T = 0 the draft is its argmax and P is a point mass."""
    n, v = check_pair_inputs(rule, target_logits, draft_logits_, temperature, top_k, top_p)
    with torch.no_grad():
        if temperature == 0:
            x = draft_logits_.argmax(-1)
            y = torch.where(greedy_accepts(rule, target_logits, x), x, target_logits.argmax(-1))
            return one_hot(y, v)
        z = process_logits(target_logits, temperature, top_k, top_p)
        p = checked_softmax("target_logits", target_logits, z, temperature)
        q = checked_softmax("draft_logits", draft_logits_, draft_logits(draft_logits_, temperature), temperature)
        return rule.induced(p, q, rule.context(z, p))


def induced_candidates(rule: VerificationRule, target_logits: Tensor, candidates: Tensor, *,
                       temperature: float, top_k: int | None = None,
                       top_p: float | None = None) -> Tensor:
    """Closed-form P [N, V] of candidate verification at N nodes (candidates [N, m], -1 padded)."""
    check_candidate_inputs(rule, target_logits, candidates, temperature, top_k, top_p)
    n, v = target_logits.shape
    with torch.no_grad():
        if temperature == 0:
            return one_hot(greedy_choice(rule, target_logits, candidates.long())[0], v)
        z = process_logits(target_logits, temperature, top_k, top_p)
        p = checked_softmax("target_logits", target_logits, z, temperature)
        return induced_from_nodes(node_quantities(rule, z, p, candidates.long()), candidates.long())


def distribution_metrics(P: Tensor, p: Tensor, pi: Tensor) -> dict[str, Tensor]:
    """TV(P, p), KL(P || p), H(P), H(p), and the mass of pi on {P == 0}; each [...]."""
    return {
        "tv": 0.5 * (P - p).abs().sum(-1),
        "kl": (torch.xlogy(P, P) - torch.xlogy(P, p)).sum(-1),
        "entropy_P": torch.special.entr(P).sum(-1),
        "entropy_p": torch.special.entr(p).sum(-1),
        "uncovered": pi.masked_fill(P > 0, 0.0).sum(-1),
    }


def _untruncated(logits: Tensor, temperature: float, p: Tensor, top_k, top_p) -> Tensor:
    """softmax(logits / T) without top-k/top-p (p itself when nothing truncates)."""
    if temperature == 0 or (top_k is None and top_p is None):
        return p
    return torch.softmax(process_logits(logits, temperature), -1)


def chain_diagnostics(rule: VerificationRule, target_logits: Tensor, draft_logits_: Tensor,
                      draft_tokens: Tensor, tokens: Tensor, temperature: float,
                      top_k, top_p) -> dict[str, Tensor]:
    """Per-position diagnostics [B, K+1] of a chain step (0 where tokens == -1)."""
    b, k1, v = target_logits.shape
    parts = []
    for sl in _chunks(b, k1 * v):
        raw, tok = target_logits[sl], tokens[sl]
        z = process_logits(raw, temperature, top_k, top_p)
        p = torch.softmax(z, -1)  # [b, K+1, V]
        if temperature == 0:
            P = one_hot(torch.where(tok >= 0, tok, raw.argmax(-1)), v)
        else:
            q = torch.softmax(draft_logits(draft_logits_[sl], temperature), -1)
            ctx = {key: val[:, :-1] for key, val in rule.context(z, p).items()}
            P = torch.cat([rule.induced(p[:, :-1], q, ctx), p[:, -1:]], 1)
        parts.append(distribution_metrics(P, p, _untruncated(raw, temperature, p, top_k, top_p)))
    pad = tokens < 0
    return {key: torch.cat([d[key] for d in parts]).masked_fill_(pad, 0.0) for key in parts[0]}


def candidate_diagnostics(rule: VerificationRule, target_logits: Tensor, candidates: Tensor,
                          tokens: Tensor, temperature: float, top_k, top_p) -> dict[str, Tensor]:
    """Per-node diagnostics [N] of a candidate step."""
    n, v = target_logits.shape
    parts = []
    for sl in _chunks(n, v):
        raw = target_logits[sl]
        z = process_logits(raw, temperature, top_k, top_p)
        p = torch.softmax(z, -1)
        if temperature == 0:
            P = one_hot(tokens[sl], v)
        else:
            P = induced_from_nodes(node_quantities(rule, z, p, candidates[sl]), candidates[sl])
        parts.append(distribution_metrics(P, p, _untruncated(raw, temperature, p, top_k, top_p)))
    return {key: torch.cat([d[key] for d in parts]) for key in parts[0]}
