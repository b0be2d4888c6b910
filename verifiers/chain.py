"""Chain verification with sampled drafts, batched over B rows (verifiers/README.md, chain mode).

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

Backends: sampled chains on the CPU run the same procedure fused in C++ (:mod:`.native`, on
the same uniforms); the PyTorch code below serves other devices and is the fallback. Both
are tested against the reference and the closed forms.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from . import native
from .checks import check_chain_inputs, check_generator, check_token_range, raise_if_bad_rows, zero_q_draft_error
from .induced import chain_diagnostics, greedy_accepts
from .processing import CHUNK_ELEMENTS, draft_logits, process_logits, sample_inverse_cdf
from .results import ChainResult, TokenKind, empty_chain_result
from .rule_base import Context, VerificationRule
from .block import verify_chain_block
from .sampled import verify_chain_towards_law

TESTS = ("rule", "law", "block")  # verify_chain's acceptance tests


@dataclasses.dataclass
class _Rows:
    """Everything the rest of the verification needs from the full vocabulary rows of a batch
    (no [..., V] tensors). j_f = min(n_acc, K-1) is where the final token's draft-side values
    live (a bonus row's are never read)."""

    p_x: Tensor  # [B, K] p(x_j)
    q_x: Tensor  # [B, K] q(x_j)
    p_probe: Tensor  # [B, K+1] one entry of each p row: NaN iff the target row is bad
    q_probe: Tensor  # [B, K] the same for q
    ctx: Context  # rule context at the drafted positions, each [B, K]
    a: Tensor  # [B, K] acceptance probabilities a(x_j)
    n_acc: Tensor  # [B] length of the accepted prefix
    stats: dict[str, Tensor]  # rule chain statistics, each [B, K]; 0 after position j_f
    y: Tensor  # [B] the final token
    p_y: Tensor  # [B] p(y) at the final position
    q_y: Tensor  # [B] q(y) at position j_f (unused for bonus rows)
    r_y: Tensor  # [B] float64 w(y) / sum w, w the weights y was sampled from

    @staticmethod
    def cat(parts: list[_Rows]) -> _Rows:
        """Concatenate the chunks of a batch along the batch dim."""
        if len(parts) == 1:
            return parts[0]
        out = {}
        for field in dataclasses.fields(_Rows):
            vals = [getattr(part, field.name) for part in parts]
            out[field.name] = ({key: torch.cat([val[key] for val in vals]) for key in vals[0]}
                               if isinstance(vals[0], dict) else torch.cat(vals))
        return _Rows(**out)


def _rows(logits: Tensor, index: Tensor) -> Tensor:
    """logits[b, index[b]] [B, V] for logits [B, L, V] (a flat index_select: a plain row copy)."""
    b, length, v = logits.shape
    flat = index if b == 1 else index + torch.arange(b, device=index.device) * length
    return logits.reshape(b * length, v).index_select(0, flat)


def _at(values: Tensor, index: Tensor) -> Tensor:
    """values[b, index[b, 0]] [B] for values [B, L] and index [B, 1]."""
    return values.gather(1, index).squeeze(1)


_ROW_LOOP_MAX_B = 16  # up to this many rows, _stats_upto reduces each row's prefix in place


def _pad_rows(values: list[Tensor], k: int) -> Tensor:
    """Stack 1-d tensors of lengths <= k as rows of a [len(values), k] tensor, 0-padded."""
    out = torch.nn.utils.rnn.pad_sequence(values, batch_first=True)
    return torch.nn.functional.pad(out, (0, k - out.shape[1]))


def _stats_upto(rule, p: Tensor, q: Tensor, ctx_k: Context, j_f: Tensor) -> dict[str, Tensor]:
    """``rule.chain_stats`` at positions j <= j_f[b] only, the only ones a result reads (accepted
    positions and the final one); 0 elsewhere. Each row's statistic is the same reduction of the
    same row as over the whole block. With several threads at least two rows are reduced, so
    that no single-row reduction is split across threads (which would change its rounding)."""
    b, k, v = q.shape
    if not getattr(rule, "full_row_stats", False) or k == 0:
        return rule.chain_stats(p[:, :k], q, ctx_k)
    min_rows = min(2, b * k) if torch.get_num_threads() > 1 else 1
    if b <= _ROW_LOOP_MAX_B and k >= min_rows:  # per-row prefix views: no row copies, no unread rows
        m = (j_f + 1).clamp(min=min_rows).tolist()
        stats = [rule.chain_stats(p[i, :m[i]], q[i, :m[i]], {key: val[i, :m[i]] for key, val in ctx_k.items()})
                 for i in range(b)]
        return {key: _pad_rows([st[key] for st in stats], k) for key in stats[0]}
    need = (torch.arange(k, device=q.device) <= j_f.unsqueeze(-1)).flatten()  # [B*K]
    rows = need.nonzero().squeeze(-1)  # flat b*K + j
    n = rows.numel()
    if 4 * n > 3 * b * k or n < min_rows:  # copying the rows would cost more than it saves
        return rule.chain_stats(p[:, :k], q, ctx_k)
    p_rows = p.reshape(b * (k + 1), v).index_select(0, rows + rows // k)  # row b*(K+1) + j
    q_rows = q.reshape(b * k, v).index_select(0, rows)
    ctx_rows = {key: val.reshape(b * k)[rows] for key, val in ctx_k.items()}
    stats = rule.chain_stats(p_rows, q_rows, ctx_rows)
    return {key: val.new_zeros(b * k).index_copy_(0, rows, val).view(b, k)
            for key, val in stats.items()}


def _final_rows(rule, p, q, x, ctx_k, n_acc, j_f, u_final) -> tuple[Tensor, ...]:
    """Sample each row's final token from its residual at n_acc (or from p_K: the bonus), reusing
    the chunk's p and q rows; returns (y, p(y), q(y), w(y) / sum w)."""
    k = x.shape[1]
    p_f = _rows(p, n_acc)  # [B, V]
    bonus = n_acc == k
    n_bonus = int(bonus.sum())
    if n_bonus == len(bonus):
        q_f, w = p_f, p_f
    else:
        q_f = _rows(q, j_f)
        idx = j_f.unsqueeze(-1)
        # a bonus row's residual (from position K-1's context) is replaced by p below
        w = rule.residual(p_f, q_f, _at(x, idx), {key: _at(val, idx) for key, val in ctx_k.items()})
        if n_bonus:
            w = torch.where(bonus.unsqueeze(-1), p_f, w)
    # clamp: a no-op for valid rows; keeps a bad (NaN) row in range until the checks raise
    y = sample_inverse_cdf(w, u_final).clamp_(max=p.shape[-1] - 1).unsqueeze(-1)
    r_y = w.gather(-1, y).squeeze(-1).double() / w.sum(-1, dtype=torch.float64)
    return y.squeeze(-1), p_f.gather(-1, y).squeeze(-1), q_f.gather(-1, y).squeeze(-1), r_y


def _drafted_context(rule, z: Tensor, p: Tensor, k: int) -> Context:
    """The rule context at the drafted positions 0..K-1 only: nothing reads position K's (its
    token is a bonus, P = p there). With several threads and a single row, the context is taken
    over both rows instead, so that no one-row reduction is split across threads."""
    if k * z.shape[0] == 1 and torch.get_num_threads() > 1:
        return {key: val[:, :k] for key, val in rule.context(z, p).items()}
    return rule.context(z[:, :k], p[:, :k])


def _softmax(z: Tensor, out: Tensor | None) -> Tensor:
    """torch.softmax over the last dim, written into ``out`` (same shape) when given."""
    if out is None:
        return torch.softmax(z, -1)
    return torch.ops.aten._softmax.out(z, -1, False, out=out)


def _verify_rows(rule, target, draft, x, u_accept, u_final, temperature, top_k, top_p,
                 buffers: tuple[Tensor, Tensor] | None = None) -> _Rows:
    """Everything that reads full vocabulary rows, for one chunk of batch rows: softmaxes, gathers
    at the draft tokens, rule context, the accept decisions, the rule's chain statistics (only
    where a result reads them) and the final token (from the chunk's own p and q rows).
    ``buffers``: storage for p and q reused across chunks (fresh pages cost more than the math)."""
    b, k = x.shape
    zt = process_logits(target, temperature, top_k, top_p)  # [b, K+1, V]
    p = _softmax(zt, None if buffers is None else buffers[0][:b])
    ctx_k = _drafted_context(rule, zt, p, k)
    del zt
    q = _softmax(draft_logits(draft, temperature), None if buffers is None else buffers[1][:b])
    xs = x.unsqueeze(-1)
    p_x, q_x = p[:, :k].gather(-1, xs).squeeze(-1), q.gather(-1, xs).squeeze(-1)
    a = rule.accept_prob(p_x, q_x, x, ctx_k)
    n_acc = (u_accept < a).int().cumprod(-1).sum(-1)  # [b], length of the accepted prefix
    j_f = n_acc.clamp(max=k - 1)  # where the final token's draft-side values live
    stats = _stats_upto(rule, p, q, ctx_k, j_f)
    fin = _final_rows(rule, p, q, x, ctx_k, n_acc, j_f, u_final)
    p_probe, q_probe = p[..., 0], q[..., 0]
    if buffers is not None:  # the next chunk overwrites p and q
        p_probe, q_probe = p_probe.clone(), q_probe.clone()
    return _Rows(p_x, q_x, p_probe, q_probe, ctx_k, a, n_acc, stats, *fin)


def _check_rows(rows: _Rows, target, draft, x, temperature: float) -> None:
    """Raise for NaN/+inf/all -inf logit rows and for draft tokens that q gives zero mass
    (one host sync: NaN propagates through the probe sums)."""
    probes = [rows.p_probe.sum(), rows.q_probe.sum()]
    if rows.q_x.numel():
        probes.append(rows.q_x.amin())
    checks = torch.stack(probes).tolist()
    if all(c == c for c in checks) and (len(checks) == 2 or checks[2] > 0):
        return
    raise_if_bad_rows("target_logits", target, rows.p_probe, temperature)
    raise_if_bad_rows("draft_logits", draft, rows.q_probe, temperature)
    raise zero_q_draft_error(x, *(rows.q_x <= 0).nonzero()[0].tolist())


def _native_chain(rule, target, draft, x, temperature, top_k, top_p, u_accept, u_final) -> ChainResult:
    """The fused C++ verifier (:mod:`.native`) on the same uniforms; its input errors raised
    as the PyTorch path raises them."""
    b, k1, v = target.shape
    if top_k is not None or top_p is not None:  # truncate here; the kernel then uses T = 1
        z, t = process_logits(target, temperature, top_k, top_p), 1.0
        d = draft_logits(draft, temperature)
    else:
        z, d, t = target, draft, temperature
    try:
        return native.verify_chain_native(rule, z, d, x, u_accept, u_final, t)
    except native.NativeError as err:
        if err.status == 2:
            raise zero_q_draft_error(x, *err.bad_token) from None
        if err.status == 3:
            raise RuntimeError("internal error: a row's final-token weights have no mass") from None
        if err.status == 4:
            check_token_range("draft_tokens", x, v, allow_pad=False)
        nan = torch.tensor(float("nan"))
        bad = err.bad_rows.bool()
        probe_t = torch.where(bad[:b * k1].view(b, k1), nan, 0.0)
        probe_d = torch.where(bad[b * k1:].view(b, k1 - 1), nan, 0.0)
        raise_if_bad_rows("target_logits", target, probe_t, temperature)
        raise_if_bad_rows("draft_logits", draft, probe_d, temperature)
        raise AssertionError("the C++ verifier flagged a bad row that has none") from None


def _assemble(x, n_acc, final_tok, final_kind, acc_vals, final_vals) -> tuple[Tensor, ...]:
    """Lay out accepted entries [B, K] (positions < n_acc) and each row's final entry [B]
    (position n_acc) as [B, K+1] tensors; padding is -1 (tokens, kinds) or 0 (values)."""
    k = x.shape[1]
    n = n_acc.unsqueeze(-1)  # [B, 1]
    after = torch.arange(k + 1, device=x.device) >= n  # [B, K+1]: not an accepted entry

    def lay(acc: Tensor, fin: Tensor, fill) -> Tensor:
        out = torch.nn.functional.pad(acc, (0, 1), value=fill).masked_fill_(after, fill)
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


def _behaviour(rule, x, rows: _Rows, exact, t_lp_acc, t_lp_fin) -> tuple[Tensor, Tensor]:
    """log P(y) for accepted [B, K] and final [B] tokens: log p(y) where P == p (``exact``: a bool
    or a [B, K] mask); elsewhere the rule's closed form at y, floored by the realised path's
    probability (a term of P(y), > 0; fmax also replaces a NaN from a degenerate closed form)."""
    b, k = x.shape
    if exact is True:
        return t_lp_acc, t_lp_fin
    ctx_k, a, n_acc = rows.ctx, rows.a, rows.n_acc
    P_acc = rule.prob_at(rows.p_x, rows.q_x, x, ctx_k, rows.stats).double()
    lp_acc = torch.fmax(P_acc, rows.q_x.double() * a.double()).log().float()
    acc = lp_acc if exact is False else torch.where(exact, t_lp_acc, lp_acc)
    lossy = n_acc < k  # bonus: P = p
    if k == 0 or not bool(lossy.any()):
        return acc, t_lp_fin
    idx = n_acc.clamp(max=k - 1).unsqueeze(-1)  # = n_acc where lossy
    if exact is not False:
        lossy &= ~_at(exact, idx)
    ctx_f = {key: _at(val, idx) for key, val in ctx_k.items()}
    stats_f = {key: _at(val, idx) for key, val in rows.stats.items()}
    P_fin = rule.prob_at(rows.p_y, rows.q_y, rows.y, ctx_f, stats_f).double()
    floor_fin = _at(rows.q_x, idx).double() * (1 - _at(a, idx).double()) * rows.r_y
    return acc, torch.where(lossy, torch.fmax(P_fin, floor_fin).log().float(), t_lp_fin)


def _sampled_chain(rule, target, draft, x, temperature, top_k, top_p, generator, fused) -> ChainResult:
    b, k1, v = target.shape
    k, dev = k1 - 1, target.device
    state = generator.get_state()  # restored if the inputs are rejected
    u_accept = torch.rand(b, k, generator=generator, device=dev)
    u_final = torch.rand(b, generator=generator, device=dev)
    if fused:
        try:
            return _native_chain(rule, target, draft, x, temperature, top_k, top_p, u_accept, u_final)
        except ValueError:
            generator.set_state(state)
            raise
    step = max(1, CHUNK_ELEMENTS // (k1 * v))  # whole batch rows per chunk, sized to stay in cache
    if step >= b:
        rows = _verify_rows(rule, target, draft, x, u_accept, u_final, temperature, top_k, top_p)
    else:
        f32 = {"dtype": torch.float32, "device": dev}  # processed logits are float32
        buffers = (torch.empty(step, k1, v, **f32), torch.empty(step, k, v, **f32))
        rows = _Rows.cat([_verify_rows(rule, target[s:s + step], draft[s:s + step], x[s:s + step],
                                       u_accept[s:s + step], u_final[s:s + step], temperature,
                                       top_k, top_p, buffers) for s in range(0, b, step)])
    try:
        _check_rows(rows, target, draft, x, temperature)
    except ValueError:
        generator.set_state(state)
        raise
    n_acc = rows.n_acc
    t_lp_acc, t_lp_fin = rows.p_x.log(), rows.p_y.log()
    exact = rule.induces_target(rows.ctx)
    b_lp_acc, b_lp_fin = _behaviour(rule, x, rows, exact, t_lp_acc, t_lp_fin)
    if exact is True:
        relaxed = torch.zeros_like(x, dtype=torch.bool)
    else:
        relaxed = rows.a > (rows.p_x / rows.q_x).clamp(max=1)
    kind = torch.where(n_acc == k, int(TokenKind.BONUS), int(TokenKind.RECOVERED))
    no = torch.zeros(b, dtype=torch.bool, device=dev)
    tokens, num, kinds, b_lp, t_lp, rel = _assemble(
        x, n_acc, rows.y, kind, (b_lp_acc, t_lp_acc, relaxed), (b_lp_fin, t_lp_fin, no))
    return ChainResult(tokens, num, b_lp, t_lp, kinds, rel)


def verify_chain(rule: VerificationRule, target_logits: Tensor, draft_logits: Tensor,
                 draft_tokens: Tensor, *, temperature: float, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None,
                 diagnostics: bool = False, test: str = "rule") -> ChainResult:
    """Verify B drafted chains of K tokens (see the module docstring).

    target_logits [B, K+1, V], draft_logits [B, K, V] (over the target vocabulary, -inf
    outside a draft vocabulary), draft_tokens [B, K] with x_j ~ q_j. p uses temperature and
    top-k/top-p; q uses the same temperature only. T = 0 is greedy and needs no generator.

    test: ``"rule"``, the rule's own acceptance test (above); ``"law"``, rejection towards the
    law the rule's test induces at each position (``verifiers.sampled.verify_chain_towards_law``):
    the same law and behaviour log-probs, the most acceptance that law allows (more than MARS's
    own test; the same for lossless and overshoot); ``"block"`` (lossless rule only), block
    verification (``verifiers.block``): the drafts' prefix is accepted jointly, P = p, more drafts
    accepted than token by token. At T = 0 each is the rule's greedy test.
    """
    if test not in TESTS:
        raise ValueError(f"test must be one of {list(TESTS)}, got {test!r}")
    if test == "block" and getattr(rule, "name", None) != "lossless":
        raise ValueError(f"test 'block' verifies towards p and is exact for the lossless rule only, got rule "
                         f"{getattr(rule, 'name', rule)!r} (use test 'rule' or 'law' for it)")
    towards_law = test == "law" and temperature > 0 and getattr(rule, "name", None) != "lossless"
    fused = native.usable(rule, temperature, target_logits.device)
    b, k, _ = check_chain_inputs(rule, target_logits, draft_logits, draft_tokens,
                                 temperature, top_k, top_p, contents=not fused or towards_law)
    check_generator(generator, temperature, target_logits.device)
    if b == 0:
        return empty_chain_result(k, target_logits.device, diagnostics)
    x = draft_tokens.long()
    with torch.no_grad():
        if temperature == 0:
            res = _greedy_chain(rule, target_logits, draft_logits, x)
        elif test == "block":
            res = verify_chain_block(target_logits, draft_logits, x, temperature=temperature, top_k=top_k,
                                     top_p=top_p, generator=generator)
        elif towards_law:
            res = verify_chain_towards_law(rule, target_logits, draft_logits, x, temperature=temperature,
                                           top_k=top_k, top_p=top_p, generator=generator)
        else:
            res = _sampled_chain(rule, target_logits, draft_logits, x, temperature, top_k, top_p,
                                 generator, fused)
        if diagnostics:
            diag = chain_diagnostics(rule, target_logits, draft_logits, x, res.tokens,
                                     temperature, top_k, top_p)
            res = dataclasses.replace(res, diagnostics=diag)
    return res
