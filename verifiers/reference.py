"""Slow, obvious reference implementations, used only by the tests.

``reference_chain`` and ``reference_candidates`` walk one row / node at a time in plain
Python and draw the same uniforms in the same order as the batched code (u_accept first,
then u_final), so the two must agree token for token. ``brute_force_chain`` and
``brute_force_candidates`` build the induced distribution by enumerating the procedure
(every draft x, every accept/reject path) instead of using the closed forms.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .processing import draft_probs, process_logits
from .results import TokenKind
from .rule_base import VerificationRule


def reference_sample(weights: Tensor, u: float) -> int:
    """The first token whose cumulative weight exceeds u * total (weights [V] >= 0)."""
    cdf = torch.cumsum(weights.double(), 0).tolist()
    target = u * cdf[-1]
    for i, c in enumerate(cdf):
        if c > target:
            return i
    return next(i for i, c in enumerate(cdf) if c >= cdf[-1])  # u * total rounded up to total


def _log(v) -> float:
    """log of a probability, -inf for 0 (a cos-accepted token may lie outside supp p)."""
    return math.log(v) if v > 0 else -math.inf


def _target(rule, logits: Tensor, temperature, top_k, top_p):
    z = process_logits(logits, temperature, top_k, top_p)
    p = torch.softmax(z, -1)
    return z, p, rule.context(z, p)


def _greedy_ok(rule: VerificationRule, logits: Tensor, x: int) -> bool:
    v1 = int(logits.argmax())
    second = rule.greedy_second(logits)
    return x == v1 or (second is not None and bool(second[0]) and x == int(second[1]))


def reference_chain(rule: VerificationRule, target_logits: Tensor, draft_logits_: Tensor,
                    draft_tokens: Tensor, *, temperature: float, top_k=None, top_p=None,
                    generator: torch.Generator | None) -> list[list[tuple[int, int, float, float]]]:
    """Per row, the emitted (token, kind, behaviour log-prob, target log-prob) in order."""
    b, k1, _ = target_logits.shape
    k = k1 - 1
    if temperature > 0:
        u_accept = torch.rand(b, k, generator=generator).tolist()
        u_final = torch.rand(b, generator=generator).tolist()
    rows = []
    for r in range(b):
        out = []
        for j in range(k + 1):
            logits = target_logits[r, j]
            if temperature == 0:
                v1 = int(logits.argmax())
                x = int(draft_tokens[r, j]) if j < k else -1
                if j < k and _greedy_ok(rule, logits, x):
                    out.append((x, TokenKind.ACCEPTED, 0.0, 0.0 if x == v1 else -math.inf))
                    continue
                out.append((v1, TokenKind.BONUS if j == k else TokenKind.RECOVERED, 0.0, 0.0))
                break
            z, p, ctx = _target(rule, logits, temperature, top_k, top_p)
            if j == k:
                y = reference_sample(p, u_final[r])
                out.append((y, TokenKind.BONUS, _log(p[y]), _log(p[y])))
                break
            q = draft_probs(draft_logits_[r, j], temperature)
            x = int(draft_tokens[r, j])
            P = rule.induced(p, q, ctx)
            if u_accept[r][j] < float(rule.accept_prob(p[x], q[x], torch.tensor(x), ctx)):
                out.append((x, TokenKind.ACCEPTED, math.log(P[x]), _log(p[x])))
                continue
            y = reference_sample(rule.residual(p, q, torch.tensor(x), ctx), u_final[r])
            out.append((y, TokenKind.RECOVERED, math.log(P[y]), _log(p[y])))
            break
        rows.append(out)
    return rows


def reference_candidates(rule: VerificationRule, target_logits: Tensor, candidates: Tensor, *,
                         temperature: float, top_k=None, top_p=None,
                         generator: torch.Generator | None) -> list[tuple[int, int, float, float]]:
    """Per node: (token, accepted index or -1, behaviour log-prob, target log-prob)."""
    n, m = candidates.shape
    if temperature > 0:
        u_accept = torch.rand(n, m, generator=generator).tolist()
        u_final = torch.rand(n, generator=generator).tolist()
    out = []
    for r in range(n):
        cands = [int(c) for c in candidates[r] if c >= 0]
        logits = target_logits[r]
        if temperature == 0:
            hit = next((i for i, c in enumerate(cands) if _greedy_ok(rule, logits, c)), None)
            v1 = int(logits.argmax())
            y = v1 if hit is None else cands[hit]
            out.append((y, -1 if hit is None else hit, 0.0, 0.0 if y == v1 else -math.inf))
            continue
        _, p, ctx = _target(rule, logits, temperature, top_k, top_p)
        alphas, fallback = _walk(rule, p, ctx, cands)
        P = _path_sum(alphas, fallback, cands, p.shape[-1])
        hit = next((i for i, a in enumerate(alphas) if u_accept[r][i] < a), None)
        y = cands[hit] if hit is not None else reference_sample(fallback, u_final[r])
        out.append((y, -1 if hit is None else hit, math.log(P[y]), _log(p[y])))
    return out


def _walk(rule, p: Tensor, ctx, cands: list[int]) -> tuple[list[float], Tensor]:
    """Explicit state walk: s starts at p; a rejected c_i is zeroed and s renormalised."""
    s = p.clone()
    alphas = []
    for c in cands:
        s_c = s[c] / s.sum() if s.sum() > 0 else torch.tensor(0.0)
        alpha = rule.node_alpha(s_c.reshape(1, 1), p[c].reshape(1, 1), torch.tensor([[c]]),
                                {key: val.reshape(1) for key, val in ctx.items()})
        alphas.append(float(alpha))
        s[c] = 0.0
    fb = rule.node_fallback(p[None], s[None], {key: val.reshape(1) for key, val in ctx.items()})[0]
    return alphas, fb


def _path_sum(alphas: list[float], fallback: Tensor, cands: list[int], vocab: int) -> Tensor:
    """P [V] (float64) by summing over accept/reject paths."""
    P = torch.zeros(vocab, dtype=torch.float64)
    reach = 1.0
    for a, c in zip(alphas, cands):
        P[c] += reach * a
        reach *= 1 - a
    if reach > 0:
        P += reach * fallback.double() / fallback.double().sum()
    return P


def brute_force_candidates(rule: VerificationRule, target_logits: Tensor, candidates: Tensor, *,
                           temperature: float, top_k=None, top_p=None) -> Tensor:
    """P [N, V] (float64) by enumerating the accept/reject paths of each node (T > 0)."""
    rows = []
    for r in range(target_logits.shape[0]):
        _, p, ctx = _target(rule, target_logits[r], temperature, top_k, top_p)
        cands = [int(c) for c in candidates[r] if c >= 0]
        alphas, fallback = _walk(rule, p, ctx, cands)
        rows.append(_path_sum(alphas, fallback, cands, p.shape[-1]))
    return torch.stack(rows)


def brute_force_chain(rule: VerificationRule, target_logits: Tensor, draft_logits_: Tensor, *,
                      temperature: float, top_k=None, top_p=None) -> Tensor:
    """P [N, V] (float64) = sum_x q(x) [a(x) delta_x + (1 - a(x)) r_x], enumerating x (T > 0)."""
    rows = []
    for r in range(target_logits.shape[0]):
        _, p, ctx = _target(rule, target_logits[r], temperature, top_k, top_p)
        q = draft_probs(draft_logits_[r], temperature)
        P = torch.zeros(p.shape[-1], dtype=torch.float64)
        for x in range(p.shape[-1]):
            if q[x] == 0:
                continue
            a = float(rule.accept_prob(p[x], q[x], torch.tensor(x), ctx))
            P[x] += float(q[x]) * a
            if a < 1:
                w = rule.residual(p, q, torch.tensor(x), ctx).double()
                P += float(q[x]) * (1 - a) * w / w.sum()
        rows.append(P)
    return torch.stack(rows)


def reference_block_chain(target_logits: Tensor, draft_logits_: Tensor, draft_tokens: Tensor, *,
                          temperature: float, top_k=None, top_p=None,
                          generator: torch.Generator) -> list[list[tuple[int, int, float, float]]]:
    """Block verification (``verifiers.block``, T > 0), one row at a time in plain Python floats, on
    the same uniforms in the same order: per row the emitted (token, kind, log P, log p)."""
    b, k1, _ = target_logits.shape
    k = k1 - 1
    u_block = torch.rand(b, k1, generator=generator, dtype=torch.float64).tolist()
    u_final = torch.rand(b, generator=generator).tolist()
    rows = []
    for r in range(b):
        p = [torch.softmax(process_logits(target_logits[r, j], temperature, top_k, top_p), -1) for j in range(k1)]
        q = [draft_probs(draft_logits_[r, j], temperature) for j in range(k)]
        x = [int(t) for t in draft_tokens[r]]
        w = [1.0]
        for j in range(k):
            ratio = float(p[j][x[j]]) / float(q[j][x[j]]) if float(q[j][x[j]]) > 0 else 0.0
            w.append(min(1.0, w[-1] * ratio))
        n = k if u_block[r][k] < w[k] else 0
        if n < k:
            for j in range(k - 1, 0, -1):  # from the longest prefix down; the empty one always stands
                resid = (w[j] * p[j] - q[j]).clamp(min=0).double().sum().item()
                if resid + 1 - w[j] <= 0 or u_block[r][j] < resid / (resid + 1 - w[j]):
                    n = j
                    break
        weights = p[k] if n == k else (w[n] * p[n] - q[n]).clamp(min=0)
        y = reference_sample(weights if float(weights.sum()) > 0 else p[n], u_final[r])
        out = [(x[j], TokenKind.ACCEPTED, _log(p[j][x[j]]), _log(p[j][x[j]])) for j in range(n)]
        out.append((y, TokenKind.BONUS if n == k else TokenKind.RECOVERED, _log(p[n][y]), _log(p[n][y])))
        rows.append(out)
    return rows
