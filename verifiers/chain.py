"""Chain verification with sampled drafts, batched over B rows (VERIFICATION.md, chain mode).

Row b drafted x_0..x_{K-1} with x_j ~ q_j; the target scored K+1 positions. Position j
accepts x_j with probability a(x_j); the first rejection emits a *recovered* token from the
rule's residual at that position; if all K are accepted a *bonus* token comes from p_K.

Randomness, in this fixed order from ``generator``: ``u_accept = torch.rand(B, K)`` (x_j is
accepted iff u_accept[b, j] < a(x_j)), then ``u_final = torch.rand(B)``, the one uniform that
picks the row's final token by inverse CDF at its first rejected position (or the bonus
position). T = 0 draws nothing.

Cost: one pass over the target and draft logits in cache-sized chunks (softmaxes, gathers,
rule context and the rule's row statistics), then work on [B, K] and on the B final rows
only. log P(y) comes from the rule's closed form at y (``prob_at``), which marginalises
over the draft; no full P row is built unless diagnostics are asked for.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from .checks import check_chain_inputs, check_generator, raise_if_bad_rows
from .induced import chain_diagnostics, greedy_accepts
from .processing import CHUNK_ELEMENTS, draft_logits, process_logits, sample_inverse_cdf
from .results import ChainResult, TokenKind, empty_chain_result
from .rules import Context, VerificationRule


@dataclasses.dataclass
class _Positions:
    """Per-position quantities of a batch (no full vocabulary rows)."""

    p_x: Tensor  # [B, K] p(x_j)
    q_x: Tensor  # [B, K] q(x_j)
    p_probe: Tensor  # [B, K+1] one entry of each p row: NaN iff the target row is bad
    q_probe: Tensor  # [B, K] the same for q
    ctx: Context  # rule context, each [B, K+1]
    stats: dict[str, Tensor]  # rule chain statistics, each [B, K]


def _position_pass(rule, target, draft, x, temperature, top_k, top_p) -> _Positions:
    """The one pass over the logits, in chunks of whole batch rows sized to stay in cache:
    softmaxes, gathers at the draft tokens, rule context and chain statistics."""
    b, k1, v = target.shape
    step = max(1, CHUNK_ELEMENTS // (k1 * v))
    parts = []
    for s in range(0, b, step):
        xs = x[s:s + step].unsqueeze(-1)  # [b, K, 1]
        zt = process_logits(target[s:s + step], temperature, top_k, top_p)  # [b, K+1, V]
        p = torch.softmax(zt, -1)
        ctx = rule.context(zt, p)
        q = torch.softmax(draft_logits(draft[s:s + step], temperature), -1)  # [b, K, V]
        p_k = p[:, :-1]
        gathered = (p_k.gather(-1, xs).squeeze(-1), q.gather(-1, xs).squeeze(-1), p[..., 0],
                    q[..., 0])
        stats = rule.chain_stats(p_k, q, {key: val[:, :-1] for key, val in ctx.items()})
        parts.append((*gathered, ctx, stats))
    if len(parts) == 1:
        return _Positions(*parts[0])
    cat = [torch.cat([part[i] for part in parts]) for i in range(4)]
    ctx, stats = ({key: torch.cat([part[i][key] for part in parts]) for key in parts[0][i]}
                  for i in (4, 5))
    return _Positions(*cat, ctx, stats)


def _check_positions(pos: _Positions, target, draft, x) -> None:
    """Raise for NaN/+inf/all -inf logit rows and for draft tokens that q gives zero mass
    (one host sync: NaN propagates through the probe sums)."""
    probes = [pos.p_probe.sum(), pos.q_probe.sum()]
    if pos.q_x.numel():
        probes.append(pos.q_x.amin())
    checks = torch.stack(probes).tolist()
    if all(c == c for c in checks) and (len(checks) == 2 or checks[2] > 0):
        return
    raise_if_bad_rows("target_logits", target, pos.p_probe)
    raise_if_bad_rows("draft_logits", draft, pos.q_probe)
    b, j = (pos.q_x <= 0).nonzero()[0].tolist()
    raise ValueError(f"draft_tokens[{b}, {j}] = {int(x[b, j])} has zero probability under the draft "
                     "distribution q (chain drafts must be sampled from q at the same temperature; "
                     "use verify_candidates for deterministic drafts)")


def _assemble(x, n_acc, final_tok, final_kind, acc_vals, final_vals) -> tuple[Tensor, ...]:
    """Lay out accepted entries [B, K] (positions < n_acc) and each row's final entry [B]
    (position n_acc) as [B, K+1] tensors; padding is -1 (tokens, kinds) or 0 (values)."""
    b, k = x.shape
    n = n_acc.unsqueeze(-1)  # [B, 1]
    after = torch.arange(k + 1, device=x.device) >= n  # [B, K+1]: not an accepted entry

    def lay(acc: Tensor, fin: Tensor, fill) -> Tensor:
        out = torch.cat([acc, acc.new_full((b, 1), fill)], 1).masked_fill_(after, fill)
        return out.scatter_(1, n, fin.unsqueeze(-1).to(acc.dtype))

    tokens = lay(x, final_tok, -1)
    kinds = lay(torch.zeros_like(x, dtype=torch.int8), final_kind, int(TokenKind.PAD))
    return (tokens, n_acc + 1, kinds, *(lay(a, f, 0) for a, f in zip(acc_vals, final_vals)))


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
        x, n_acc, final, kind, (torch.zeros_like(t_lp), t_lp, x != v1[:, :-1]), (zeros, zeros, no))
    return ChainResult(tokens, num, b_lp, t_lp, kinds, rel)


@dataclasses.dataclass
class _Final:
    """Each row's final position n_acc (the first rejection, or K for the bonus)."""

    tokens: Tensor  # [B] the sampled token y
    p_y: Tensor  # [B] p(y) at the final position
    q_y: Tensor  # [B] q(y) at position min(n_acc, K-1) (unused for bonus rows)
    weights: Tensor  # [B, V] what y was sampled from (unnormalised)


def _rows(logits: Tensor, index: Tensor) -> Tensor:
    """logits[b, index[b]] [B, V] for logits [B, L, V] (a flat index_select: a plain row copy)."""
    b, length, v = logits.shape
    flat = index + torch.arange(b, device=index.device) * length
    return logits.reshape(b * length, v).index_select(0, flat)


def _final_tokens(rule, target, draft, x, pos, n_acc, u_final, temperature, top_k, top_p) -> _Final:
    """Sample each row's final token from its residual at n_acc (or from p_K: the bonus)."""
    k = x.shape[1]
    p = torch.softmax(process_logits(_rows(target, n_acc), temperature, top_k, top_p), -1)  # [B, V]
    bonus = (n_acc == k).tolist()
    if all(bonus):
        q, w = p, p
    else:
        jq = n_acc.clamp(max=k - 1)
        q = torch.softmax(draft_logits(_rows(draft, jq), temperature), -1)
        ctx = {key: val.gather(1, n_acc.unsqueeze(-1)).squeeze(-1) for key, val in pos.ctx.items()}
        w = rule.residual(p, q, x.gather(1, jq.unsqueeze(-1)).squeeze(-1), ctx)
        if any(bonus):
            w = torch.where((n_acc == k).unsqueeze(-1), p, w)
    y = sample_inverse_cdf(w, u_final).unsqueeze(-1)
    return _Final(y.squeeze(-1), p.gather(-1, y).squeeze(-1), q.gather(-1, y).squeeze(-1), w)


def _behaviour(rule, x, pos, a, n_acc, fin: _Final, t_lp_acc, t_lp_fin) -> tuple[Tensor, Tensor]:
    """log P(y) for accepted [B, K] and final [B] tokens: log p(y) where P == p; elsewhere the
    rule's closed form at y, floored by the realised path's probability (a term of P(y), > 0;
    fmax also replaces a NaN from a degenerate closed form)."""
    b, k = x.shape
    exact = rule.induces_target(pos.ctx)
    if exact is True:
        return t_lp_acc, t_lp_fin
    exact = torch.zeros(b, k + 1, dtype=torch.bool, device=x.device) | exact
    ctx_k = {key: val[:, :k] for key, val in pos.ctx.items()}
    P_acc = rule.prob_at(pos.p_x, pos.q_x, x, ctx_k, pos.stats).double()
    floor_acc = pos.q_x.double() * a.double()
    acc = torch.where(exact[:, :k], t_lp_acc, torch.fmax(P_acc, floor_acc).log().float())
    if k == 0:
        return acc, t_lp_fin
    jq = n_acc.clamp(max=k - 1).unsqueeze(-1)
    ctx_f = {key: val.gather(1, jq).squeeze(-1) for key, val in ctx_k.items()}
    stats_f = {key: val.gather(1, jq).squeeze(-1) for key, val in pos.stats.items()}
    P_fin = rule.prob_at(fin.p_y, fin.q_y, fin.tokens, ctx_f, stats_f).double()
    w_y = fin.weights.gather(-1, fin.tokens.unsqueeze(-1)).squeeze(-1).double()
    r_y = w_y / fin.weights.sum(-1, dtype=torch.float64)
    floor_fin = (pos.q_x.gather(1, jq).squeeze(-1).double()
                 * (1 - a.gather(1, jq).squeeze(-1).double()) * r_y)
    lossy = ~exact.gather(1, n_acc.unsqueeze(-1)).squeeze(-1) & (n_acc < k)  # bonus: P = p
    fin_lp = torch.where(lossy, torch.fmax(P_fin, floor_fin).log().float(), t_lp_fin)
    return acc, fin_lp


def _sampled_chain(rule, target, draft, x, temperature, top_k, top_p, generator) -> ChainResult:
    b, k1, _ = target.shape
    k, dev = k1 - 1, target.device
    pos = _position_pass(rule, target, draft, x, temperature, top_k, top_p)
    _check_positions(pos, target, draft, x)
    a = rule.accept_prob(pos.p_x, pos.q_x, x, {key: val[:, :k] for key, val in pos.ctx.items()})
    u_accept = torch.rand(b, k, generator=generator, device=dev)
    u_final = torch.rand(b, generator=generator, device=dev)
    n_acc = (u_accept < a).int().cumprod(-1).sum(-1)  # [B], length of the accepted prefix
    fin = _final_tokens(rule, target, draft, x, pos, n_acc, u_final, temperature, top_k, top_p)
    t_lp_acc, t_lp_fin = pos.p_x.log(), fin.p_y.log()
    b_lp_acc, b_lp_fin = _behaviour(rule, x, pos, a, n_acc, fin, t_lp_acc, t_lp_fin)
    if rule.induces_target(pos.ctx) is True:
        relaxed = torch.zeros_like(x, dtype=torch.bool)
    else:
        relaxed = a > (pos.p_x / pos.q_x).clamp(max=1)
    kind = torch.where(n_acc == k, int(TokenKind.BONUS), int(TokenKind.RECOVERED))
    no = torch.zeros(b, dtype=torch.bool, device=dev)
    tokens, num, kinds, b_lp, t_lp, rel = _assemble(
        x, n_acc, fin.tokens, kind, (b_lp_acc, t_lp_acc, relaxed), (b_lp_fin, t_lp_fin, no))
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
