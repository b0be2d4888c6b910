"""Chain verification with sampled drafts, batched over B rows (VERIFICATION.md, chain mode).

Row b drafted x_0..x_{K-1} with x_j ~ q_j; the target scored K+1 positions. Position j
accepts x_j with probability a(x_j); the first rejection emits a *recovered* token from the
rule's residual at that position; if all K are accepted a *bonus* token comes from p_K.

Randomness, in this fixed order from ``generator``: ``u_accept = torch.rand(B, K)`` (x_j is
accepted iff u_accept[b, j] < a(x_j)), then ``u_final = torch.rand(B)``, the one uniform that
picks the row's final token by inverse CDF at its first rejected position (or the bonus
position). T = 0 draws nothing.

Cost: one pass over the target and draft logits in cache-sized chunks (log-normalisers,
gathers, rule context), then work on [B, K] and on the B final rows only. Lossy rules whose
P differs from p also rebuild full P rows at the emitted positions (log P(y) needs the
closed form, which marginalises over the draft).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .checks import check_chain_inputs, check_generator, raise_if_bad_rows
from .induced import chain_diagnostics, greedy_accepts
from .processing import (CHUNK_ELEMENTS, draft_logits, log_normaliser, probs_from,
                         process_logits, sample_inverse_cdf)
from .results import ChainResult, TokenKind, empty_chain_result
from .rules import Context, VerificationRule


@dataclasses.dataclass
class _Positions:
    """Per-position quantities of a batch (everything except full vocabulary rows)."""

    lse_t: Tensor  # [B, K+1] log-normaliser of the processed target logits
    zt_x: Tensor  # [B, K] processed target logit of the draft token
    lse_q: Tensor  # [B, K]
    zq_x: Tensor  # [B, K] processed draft logit of the draft token
    ctx: Context  # rule context, each [B, K+1]


def _position_pass(rule, target, draft, x, temperature, top_k, top_p) -> _Positions:
    """One chunked pass over the logits (chunks of whole batch rows, sized to stay in cache)."""
    b, k1, v = target.shape
    step = max(1, CHUNK_ELEMENTS // (k1 * v))
    parts = []
    for s in range(0, b, step):
        xs = x[s:s + step].unsqueeze(-1)  # [b, K, 1]
        zt = process_logits(target[s:s + step], temperature, top_k, top_p)  # [b, K+1, V]
        lse_t = log_normaliser(zt)
        ctx = rule.context(zt, lse_t)
        zt_x = zt[:, :-1].gather(-1, xs).squeeze(-1)
        zq = draft_logits(draft[s:s + step], temperature)  # [b, K, V]
        parts.append((lse_t, zt_x, log_normaliser(zq), zq.gather(-1, xs).squeeze(-1), ctx))
    cat = [torch.cat([part[i] for part in parts]) for i in range(4)]
    ctx = {key: torch.cat([part[4][key] for part in parts]) for key in parts[0][4]}
    return _Positions(*cat, ctx)


def _check_positions(pos: _Positions, q_x: Tensor, target, draft, x) -> None:
    """Raise for NaN/+inf/all -inf logit rows and for draft tokens that q gives zero mass."""
    ok = torch.isfinite(pos.lse_t).all() & torch.isfinite(pos.lse_q).all() & (q_x > 0).all()
    if bool(ok):
        return
    raise_if_bad_rows("target_logits", target, pos.lse_t)
    raise_if_bad_rows("draft_logits", draft, pos.lse_q)
    b, j = ((q_x > 0) == 0).nonzero()[0].tolist()
    raise ValueError(f"draft_tokens[{b}, {j}] = {int(x[b, j])} has zero probability under the draft "
                     "distribution q (chain drafts must be sampled from q at the same temperature; "
                     "use verify_candidates for deterministic drafts)")


def _assemble(x, accepted, final_tok, final_kind, acc_vals, final_vals) -> tuple[Tensor, ...]:
    """Place accepted entries [B, K] and the final entry [B] of each row into [B, K+1] tensors."""
    b, k = x.shape
    rows = torch.arange(b, device=x.device)
    n_acc = accepted.sum(-1)
    tokens = torch.full((b, k + 1), -1, dtype=torch.long, device=x.device)
    tokens[:, :k] = torch.where(accepted, x, -1)
    tokens[rows, n_acc] = final_tok
    kinds = torch.full((b, k + 1), int(TokenKind.PAD), dtype=torch.int8, device=x.device)
    kinds[:, :k].masked_fill_(accepted, int(TokenKind.ACCEPTED))
    kinds[rows, n_acc] = final_kind.to(torch.int8)
    outs = []
    for acc_v, fin_v in zip(acc_vals, final_vals):
        out = torch.zeros((b, k + 1), dtype=acc_v.dtype, device=x.device)
        out[:, :k] = torch.where(accepted, acc_v, torch.zeros((), dtype=acc_v.dtype))
        out[rows, n_acc] = fin_v
        outs.append(out)
    return (tokens, n_acc + 1, kinds, *outs)


def _greedy_chain(rule, target, draft, x) -> ChainResult:
    """T = 0: accept x_j iff the rule's greedy test passes; the final token is the argmax."""
    b, k1, _ = target.shape
    top, v1 = target.max(-1)  # [B, K+1]
    if not bool(torch.isfinite(top).all()):
        raise_if_bad_rows("target_logits", target, top)
    if k1 > 1 and not bool(torch.isfinite(draft.amax(-1)).all()):
        raise_if_bad_rows("draft_logits", draft, draft.amax(-1))
    accepted = greedy_accepts(rule, target[:, :-1], x).int().cumprod(-1).bool()  # [B, K]
    n_acc = accepted.sum(-1)
    final = v1.gather(-1, n_acc.unsqueeze(-1)).squeeze(-1)
    kind = torch.where(n_acc == k1 - 1, int(TokenKind.BONUS), int(TokenKind.RECOVERED))
    t_lp = torch.where(x == v1[:, :-1], 0.0, float("-inf"))  # MARS may accept v2: log p = -inf
    zeros = torch.zeros(b, device=target.device)
    no = torch.zeros(b, dtype=torch.bool, device=target.device)
    tokens, num, kinds, b_lp, t_lp, rel = _assemble(
        x, accepted, final, kind, (torch.zeros_like(t_lp), t_lp, x != v1[:, :-1]), (zeros, zeros, no))
    return ChainResult(tokens, num, b_lp, t_lp, kinds, rel)


def _final_rows(rule, target, draft, x, pos, n_acc, temperature, top_k, top_p):
    """Target/draft rows [B, V] at each row's final position and the weights to sample from."""
    b, k1, _ = target.shape
    rows = torch.arange(b, device=target.device)
    zt = process_logits(target[rows, n_acc], temperature, top_k, top_p)  # [B, V]
    p = probs_from(zt, pos.lse_t[rows, n_acc])
    if k1 == 1:
        return zt, p, None, p
    jq = n_acc.clamp(max=k1 - 2)
    q = probs_from(draft_logits(draft[rows, jq], temperature), pos.lse_q[rows, jq])
    ctx = {key: val[rows, n_acc] for key, val in pos.ctx.items()}
    w = rule.residual(p, q, zt, x[rows, jq], ctx)
    return zt, p, q, torch.where((n_acc == k1 - 1).unsqueeze(-1), p, w)


def _induced_at(rule, target, draft, pos, rows, cols, ys, temperature, top_k, top_p) -> Tensor:
    """P(y) [E] at E positions (rows, cols) of the chain (cols < K), chunked over positions."""
    step = max(1, CHUNK_ELEMENTS // target.shape[-1])
    out = []
    for s in range(0, len(rows), step):
        r, c, y = rows[s:s + step], cols[s:s + step], ys[s:s + step]
        zt = process_logits(target[r, c], temperature, top_k, top_p)  # [e, V]
        p = probs_from(zt, pos.lse_t[r, c])
        q = probs_from(draft_logits(draft[r, c], temperature), pos.lse_q[r, c])
        ctx = {key: val[r, c] for key, val in pos.ctx.items()}
        out.append(rule.induced(p, q, zt, ctx).gather(-1, y.unsqueeze(-1)).squeeze(-1))
    return torch.cat(out) if out else torch.zeros(0, device=target.device)


def _behaviour(rule, target, draft, x, pos, accepted, a, q_x, n_acc, y, w, t_lp_acc, t_lp_fin,
               temperature, top_k, top_p) -> tuple[Tensor, Tensor]:
    """log P(y) for accepted [B, K] and final [B] tokens. Where P == p it is log p(y); elsewhere
    the closed form, floored by the realised path's probability (a term of P(y), > 0)."""
    b, k = x.shape
    exact = rule.induces_target(pos.ctx)
    if exact is True:
        return t_lp_acc, t_lp_fin
    rows = torch.arange(b, device=x.device)
    exact = torch.zeros(b, k + 1, dtype=torch.bool, device=x.device) | exact
    bonus = n_acc == k
    lossy_acc = accepted & ~exact[:, :k]
    lossy_fin = ~bonus & ~exact[rows, n_acc]
    ra, ca = lossy_acc.nonzero(as_tuple=True)
    rf = lossy_fin.nonzero(as_tuple=True)[0]
    P_y = _induced_at(rule, target, draft, pos, torch.cat([ra, rf]), torch.cat([ca, n_acc[rf]]),
                      torch.cat([x[ra, ca], y[rf]]), temperature, top_k, top_p).double()
    jq = n_acc[rf]
    w_y = w[rf, y[rf]].double() / w[rf].double().sum(-1)
    floor = torch.cat([q_x[ra, ca].double() * a[ra, ca].double(),
                       q_x[rf, jq].double() * (1 - a[rf, jq].double()) * w_y])
    lp = torch.maximum(P_y, floor).log().float()
    acc_lp, fin_lp = t_lp_acc.clone(), t_lp_fin.clone()
    acc_lp[ra, ca] = lp[:len(ra)]
    fin_lp[rf] = lp[len(ra):]
    return acc_lp, fin_lp


def _sampled_chain(rule, target, draft, x, temperature, top_k, top_p, generator) -> ChainResult:
    b, k1, _ = target.shape
    k, dev = k1 - 1, target.device
    pos = _position_pass(rule, target, draft, x, temperature, top_k, top_p)
    p_x = (pos.zt_x - pos.lse_t[:, :k]).exp()  # [B, K]
    q_x = (pos.zq_x - pos.lse_q).exp()
    _check_positions(pos, q_x, target, draft, x)
    a = rule.accept_prob(p_x, q_x, pos.zt_x, x, {key: val[:, :k] for key, val in pos.ctx.items()})
    u_accept = torch.rand(b, k, generator=generator, device=dev)
    u_final = torch.rand(b, generator=generator, device=dev)
    accepted = (u_accept < a).int().cumprod(-1).bool()  # [B, K], a prefix per row
    n_acc = accepted.sum(-1)
    zt_f, _, _, w = _final_rows(rule, target, draft, x, pos, n_acc, temperature, top_k, top_p)
    y = sample_inverse_cdf(w, u_final)  # [B]
    t_lp_acc = pos.zt_x - pos.lse_t[:, :k]
    rows = torch.arange(b, device=dev)
    t_lp_fin = zt_f.gather(-1, y.unsqueeze(-1)).squeeze(-1) - pos.lse_t[rows, n_acc]
    b_lp_acc, b_lp_fin = _behaviour(rule, target, draft, x, pos, accepted, a, q_x, n_acc, y, w,
                                    t_lp_acc, t_lp_fin, temperature, top_k, top_p)
    relaxed = a > (p_x / q_x).clamp(max=1)
    kind = torch.where(n_acc == k, int(TokenKind.BONUS), int(TokenKind.RECOVERED))
    no = torch.zeros(b, dtype=torch.bool, device=dev)
    tokens, num, kinds, b_lp, t_lp, rel = _assemble(
        x, accepted, y, kind, (b_lp_acc, t_lp_acc, relaxed), (b_lp_fin, t_lp_fin, no))
    return ChainResult(tokens, num, b_lp, t_lp, kinds, rel)


def verify_chain(rule: VerificationRule, target_logits: Tensor, draft_logits: Tensor,
                 draft_tokens: Tensor, *, temperature: float, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None,
                 diagnostics: bool = False) -> ChainResult:
    """Verify B drafted chains of K tokens (see the module docstring).

    target_logits [B, K+1, V], draft_logits [B, K, V] (over the target vocabulary, -inf
    outside a draft vocabulary), draft_tokens [B, K] with x_j ~ q_j. p uses temperature and
    top-k/top-p; q uses the same temperature only. T = 0 is greedy and needs no generator.
    """
    b, k, _ = check_chain_inputs(rule, target_logits, draft_logits, draft_tokens,
                                 temperature, top_k, top_p)
    check_generator(generator, temperature, target_logits.device)
    if b == 0:
        return empty_chain_result(k, target_logits.device, diagnostics)
    x = draft_tokens.long()
    with torch.no_grad():
        if temperature == 0:
            res = _greedy_chain(rule, target_logits, draft_logits, x)
        else:
            res = _sampled_chain(rule, target_logits, draft_logits, x, temperature, top_k, top_p,
                                 generator)
        if diagnostics:
            diag = chain_diagnostics(rule, target_logits, draft_logits, x, res.tokens,
                                     temperature, top_k, top_p)
            res = dataclasses.replace(res, diagnostics=diag)
    return res
