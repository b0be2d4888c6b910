"""Verification over candidates drawn from q without replacement (verifiers/README.md, sampled
candidates): one node of a sampled draft tree, towards p or a lossy rule's chain law.

Node n has candidates c_1..c_m in draw order, -1 padded: c_1 ~ q, and c_i ~ q_i, q with
c_1..c_{i-1} removed and renormalised (sequential sampling without replacement, as
:func:`draw_without_replacement` draws them). Recursive rejection keeps a state s, initially p:

    for i = 1..m: accept c_i with probability min(1, s(c_i) / q_i(c_i)); stop if accepted
                  otherwise s = norm((s - q_i)+)
    if none was accepted: emit y ~ s

Each step is speculative sampling of s with proposal q_i, whose output law is s; by induction
from the last step the emitted token's law is p at every node, whatever the number of
candidates (even one chosen from the earlier candidates). So the behaviour log-prob is
log p(y), as in a lossless chain. Where (s - q_i)+ is empty, s = q_i and the rejection had
probability 0; s is then kept (a float rounding case).

A lossy rule R verifies sampled candidates **towards its chain law**: the recursion starts from
s = P_R(p, q) = ``rule.induced(p, q, ctx)``, the closed form of R's chain verification at a
position with this p and q, instead of p. By the same induction the emitted token's law is P_R:
per position the law (and so the behaviour log-prob log P_R(y) and the drift) of R's sampled
chain, reached with more acceptance (each step is the lossless coupling towards P_R, and a node
has more than one candidate). The target log-prob stays log p(y). For overshoot the one-candidate
step accepts exactly as the rule's chain does (sum min(q, P) = sum min(q, p / l)); for MARS it
accepts more (sum min(q, P) > q(v1) + q(v2) where it relaxes). A node without candidates (a
tree's leaf: a bonus token) emits from p, as a chain's bonus does.

Randomness, in this fixed order from ``generator``: ``u_accept = torch.rand(N, m)`` (c_i is
accepted iff u_accept[n, i] < its acceptance), then ``u_final = torch.rand(N)`` (the
fallback by inverse CDF), as in :func:`verifiers.verify_candidates`.

Backends: on the CPU both functions run fused in C++ (:mod:`.native`, ``csrc/sampled.cpp`` with
its node step ``csrc/sampled.h``: the same procedure on the same uniforms; a lossy rule's chain
law from the kernel's closed forms, ``csrc/rules.h``, for the rules with a kernel id); the
PyTorch code below serves other devices and other rules, and is the fallback.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .checks import check_candidate_inputs, check_generator, check_token_range, raise_if_bad_rows, zero_q_draft_error
from .induced import checked_softmax
from .processing import draft_logits as scale_draft, process_logits, sample_inverse_cdf
from .results import CandidateResult, ChainResult, TokenKind, empty_candidate_result


def chain_law(rule, z: Tensor, p: Tensor, q: Tensor, drafted: Tensor | None = None) -> Tensor:
    """P_R [N, V]: what ``rule``'s chain verification induces at positions with processed target
    logits ``z``, target p and draft q (``rule.induced``); p itself for the lossless rule and at
    the rows where ``drafted [N]`` is False (no candidates: a bonus token). The law a node of
    sampled candidates is verified towards."""
    if getattr(rule, "name", None) == "lossless":
        return p
    law = rule.induced(p, q, rule.context(z, p))
    return law if drafted is None else torch.where(drafted[:, None], law, p)


def draw_without_replacement(logits: Tensor, m: int, temperature: float, generator: torch.Generator) -> Tensor:
    """``m`` ids per row of draft logits ``[..., Vd]`` drawn from q = softmax(logits / T)
    without replacement, in draw order: draw i picks by inverse CDF (:func:`sample_inverse_cdf`,
    one float64 uniform per row, ``u = rand(m, rows)`` from ``generator``) from q with the
    earlier draws removed. Ids with q = 0 are never drawn: where fewer than m have q > 0 the
    tail is -1. Fused in C++ on the CPU (:mod:`.native`, the same uniforms and procedure)."""
    if temperature <= 0:
        raise ValueError("sampled candidates need temperature > 0 (at T = 0 draft the top-k)")
    rows = logits.reshape(-1, logits.shape[-1])
    u = torch.rand(m, rows.shape[0], generator=generator, dtype=torch.float64, device=logits.device)
    if logits.device.type == "cpu" and native.enabled():
        try:
            ids = native.draw_sampled_native(rows, u, temperature)
        except native.NativeError as err:
            raise_if_bad_rows("draft logits", rows, torch.where(err.bad_rows.bool(), float("nan"), 0.0), temperature)
            raise AssertionError("the C++ sampler flagged a bad row that has none") from None
        return ids.view(*logits.shape[:-1], m)
    rest = checked_softmax("draft logits", rows, scale_draft(rows, temperature))
    ids = []
    for i in range(m):
        left = rest.sum(-1) > 0
        pick = torch.where(left, sample_inverse_cdf(rest, u[i]).clamp_(max=rest.shape[-1] - 1), -1)
        rest.scatter_(1, pick.clamp(min=0)[:, None], 0.0)
        ids.append(pick)
    return torch.stack(ids, -1).view(*logits.shape[:-1], m)


def _check_draft(draft_logits: Tensor, target_logits: Tensor) -> None:
    if not isinstance(draft_logits, Tensor) or not draft_logits.is_floating_point():
        raise ValueError(f"draft_logits must be a float tensor, got {type(draft_logits).__name__}")
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft_logits shape {list(draft_logits.shape)} does not match target_logits shape "
                         f"{list(target_logits.shape)} (both [N, V], over the target vocabulary)")
    if draft_logits.device != target_logits.device:
        raise ValueError(f"draft_logits is on {draft_logits.device} but target_logits is on {target_logits.device}")


def _recursive_rejection(p: Tensor, q: Tensor, cands: Tensor, u_accept: Tensor) -> tuple[Tensor, Tensor]:
    """The recursion over all nodes at once: (accepted index [N] or -1, final state s [N, V])."""
    n, m = cands.shape
    s, rest = p.clone(), q.clone()  # rest: q with the candidates drawn so far removed
    index = torch.full((n,), -1, dtype=torch.long, device=p.device)
    live = torch.ones(n, dtype=torch.bool, device=p.device)
    for i in range(m):
        c = cands[:, i]
        here = live & (c >= 0)
        if not bool(here.any()):
            break
        col = c.clamp(min=0)[:, None]
        q_i = rest / rest.sum(-1, keepdim=True)
        q_c = q_i.gather(1, col)[:, 0]
        ratio = s.gather(1, col)[:, 0] / q_c.clamp(min=torch.finfo(q_c.dtype).tiny)
        accept = here & (u_accept[:, i] < ratio)
        index = torch.where(accept, i, index)
        reject = here & ~accept
        live &= ~accept
        if bool(reject.any()):
            r = (s - q_i).clamp_(min=0)
            mass = r.sum(-1, keepdim=True)
            s = torch.where(reject[:, None] & (mass > 0), r / mass.clamp(min=torch.finfo(r.dtype).tiny), s)
        rest.scatter_(1, col, torch.where(here[:, None], 0.0, rest.gather(1, col)))
    return index, s


def _zero_q_error(q: Tensor, cands: Tensor) -> ValueError:
    zero = (cands >= 0) & (q.gather(1, cands.clamp(min=0)) <= 0)
    row, i = (int(x) for x in zero.nonzero()[0])
    return ValueError(f"candidates row {row}, position {i}: token {int(cands[row, i])} has draft "
                      "probability 0 (sampled candidates must be drawn from q)")


def kernel_logits(target: Tensor, draft: Tensor, temperature: float, top_k: int | None,
                  top_p: float | None) -> tuple[Tensor, Tensor, float]:
    """What the C++ kernels take: (target logits, draft logits, T). With top-k / top-p the target
    is truncated here and both are divided by T; the kernel then uses T = 1."""
    if top_k is None and top_p is None:
        return target, draft, temperature
    return process_logits(target, temperature, top_k, top_p), scale_draft(draft, temperature), 1.0


def _native(rule, raw, draft, cands, u_accept, u_final, temperature, top_k, top_p) -> CandidateResult:
    """The fused C++ verifier on the same uniforms (the rule's chain law from its kernel closed form)."""
    z, zd, t = kernel_logits(raw, draft, temperature, top_k, top_p)
    try:
        tokens, index, logp, target = native.verify_sampled_native(rule, z, zd, cands, u_accept, u_final, t)
    except native.NativeError as err:
        if err.status == 4:
            raise _zero_q_error(torch.softmax(scale_draft(draft, temperature), -1), cands) from None
        name, rows = ("target_logits", raw) if err.status == 1 else ("draft_logits", draft)
        raise_if_bad_rows(name, rows, torch.where(err.bad_rows.bool(), float("nan"), 0.0), temperature)
        raise AssertionError("the C++ verifier flagged a bad row that has none") from None
    return CandidateResult(tokens, index, logp, target, (index >= 0) & (logp > target))


def verify_sampled_candidates(rule, target_logits: Tensor, draft_logits: Tensor, candidates: Tensor, *,
                              temperature: float, top_k: int | None = None, top_p: float | None = None,
                              generator: torch.Generator | None) -> CandidateResult:
    """Verify N nodes: ``target_logits [N, V]``, ``draft_logits [N, V]`` (the drafter's logits the
    candidates were drawn from, over the target vocabulary, -inf outside the draft vocabulary;
    q = softmax(draft_logits / T)), ``candidates [N, m]`` in draw order (-1 padded, distinct).
    The emitted token's law is P_R (:func:`chain_law`; p for the lossless rule, and at a node
    without candidates, whose token is a bonus token): its behaviour
    log-prob is log P_R(y), its target log-prob log p(y). ``relaxed``: a candidate was accepted
    and P_R gives it more than p does."""
    n, m = _check(rule, target_logits, draft_logits, candidates, temperature, top_k, top_p)
    check_generator(generator, temperature, target_logits.device)
    dev = target_logits.device
    u_accept = torch.rand(n, m, generator=generator, device=dev)
    u_final = torch.rand(n, generator=generator, device=dev)
    return _verify(rule, target_logits, draft_logits, candidates, u_accept, u_final, temperature, top_k, top_p)


def _check(rule, target_logits, draft_logits, candidates, temperature, top_k, top_p) -> tuple[int, int]:
    if temperature == 0:
        raise ValueError("sampled candidates need temperature > 0 (at T = 0 draft the top-k)")
    n, m, _ = check_candidate_inputs(rule, target_logits, candidates, temperature, top_k, top_p)
    _check_draft(draft_logits, target_logits)
    return n, m


def _verify(rule, target_logits: Tensor, draft_logits: Tensor, candidates: Tensor, u_accept: Tensor,
            u_final: Tensor, temperature: float, top_k: int | None, top_p: float | None) -> CandidateResult:
    """The verification of checked inputs on the uniforms ``u_accept [N, m]``, ``u_final [N]``."""
    n, dev = candidates.shape[0], target_logits.device
    if n == 0:
        return empty_candidate_result(dev, False)
    cands = candidates.long()
    with torch.no_grad():
        if dev.type == "cpu" and native.enabled() and native.supports(rule):
            return _native(rule, target_logits, draft_logits, cands, u_accept, u_final, temperature, top_k, top_p)
        z = process_logits(target_logits, temperature, top_k, top_p)
        p = checked_softmax("target_logits", target_logits, z, temperature)
        zq = scale_draft(draft_logits, temperature)
        q = checked_softmax("draft_logits", draft_logits, zq, temperature)
        if bool(((cands >= 0) & (q.gather(1, cands.clamp(min=0)) <= 0)).any()):
            raise _zero_q_error(q, cands)
        law = chain_law(rule, z, p, q, cands[:, 0] >= 0)
        index, s = _recursive_rejection(law, q, cands, u_accept)
        fallback = sample_inverse_cdf(s, u_final).clamp_(max=p.shape[-1] - 1)
        tokens = torch.where(index >= 0, cands.gather(1, index.clamp(min=0)[:, None])[:, 0], fallback)
        law_y, p_y = law.gather(1, tokens[:, None])[:, 0], p.gather(1, tokens[:, None])[:, 0]
    return CandidateResult(tokens, index, law_y.log().float(), p_y.log().float(), (index >= 0) & (law_y > p_y))


def verify_chain_towards_law(rule, target_logits: Tensor, draft_logits: Tensor, draft_tokens: Tensor, *,
                             temperature: float, top_k: int | None, top_p: float | None,
                             generator: torch.Generator) -> ChainResult:
    """``verify_chain(..., test="law")`` at T > 0 (checked inputs): a chain of drafts x_j ~ q_j
    verified as a tree of sampled candidates with one candidate per node. Position j accepts x_j
    with probability min(1, P_R(x_j) / q_j(x_j)), P_R = :func:`chain_law` at (p_j, q_j); the first
    rejection emits from norm((P_R - q_j)+); if every draft is accepted a bonus token comes from
    p_K. Each position's law is P_R, the law of the rule's own chain test there (so the same
    behaviour log-probs and drift), with acceptance sum min(q, P_R): the most any test of that
    law can have; for MARS more than its own test, for overshoot the same.

    Randomness, in this order from ``generator``: ``u_accept = rand(B, K+1, 1)``, then
    ``u_final = rand(B, K+1)``; entry (b, j) is used at row b's position j (the C++ walk and
    the PyTorch loop below read the same entries: the same tokens)."""
    b, k1, v = target_logits.shape
    dev = target_logits.device
    state = generator.get_state()  # restored if the inputs are rejected
    u_accept = torch.rand(b, k1, 1, generator=generator, device=dev)
    u_final = torch.rand(b, k1, generator=generator, device=dev)
    x = draft_tokens.long()
    try:
        if dev.type == "cpu" and native.enabled() and native.supports(rule):
            out = _chain_walk_native(rule, target_logits, draft_logits, x, u_accept, u_final, temperature, top_k,
                                     top_p)
        else:
            draft = torch.cat([draft_logits, draft_logits.new_zeros(b, 1, v)], dim=1)  # the bonus position: no q
            out = _chain_walk(rule, target_logits, draft, x, u_accept, u_final, temperature, top_k, top_p)
    except ValueError:
        generator.set_state(state)
        raise
    tokens, logp, target, kinds, emitted = out
    pad = torch.arange(k1, device=dev) >= emitted[:, None]
    relaxed = (kinds == int(TokenKind.ACCEPTED)) & (logp > target)
    return ChainResult(tokens.masked_fill(pad, -1), emitted, logp.masked_fill(pad, 0.0),
                       target.masked_fill(pad, 0.0), kinds.masked_fill(pad, int(TokenKind.PAD)).to(torch.int8),
                       relaxed & ~pad)


def _chain_walk_native(rule, target, draft, x, u_accept, u_final, temperature, top_k, top_p):
    """The chain as a tree for ``hr_walk_sampled`` (``csrc/sampled_tree.cpp``): nodes 0..K, node j's
    one child j + 1, q over the target vocabulary (identity id map); ``draft`` [B, K, V] (node K, a
    leaf, has no draft row)."""
    b, k1, v = target.shape
    z, zd, t = kernel_logits(target, draft, temperature, top_k, top_p)
    nodes = torch.arange(k1)
    children = torch.where(nodes < k1 - 1, nodes + 1, -1)[:, None]
    tokens = torch.cat([x.new_zeros(b, 1), x], dim=1)  # node 0 (the pending token) is never emitted
    try:
        out, logp, target_lp, kinds, _, emitted = native.walk_sampled_native(
            rule, z, zd, torch.arange(v), tokens, children, u_accept, u_final, t)
    except native.NativeError as err:  # re-checked in PyTorch, which names the row and position
        check_sampled_chain(target, draft, x, temperature, top_k, top_p)
        raise AssertionError(f"the C++ walk flagged bad input (status {err.status}) that has none") from None
    return out, logp, target_lp, kinds, emitted


def _chain_walk(rule, target, draft, x, u_accept, u_final, temperature, top_k, top_p):
    """The same walk in PyTorch, position by position over the rows still accepting."""
    check_sampled_chain(target, draft[:, :-1], x, temperature, top_k, top_p)
    b, k1, _ = target.shape
    dev = target.device
    tokens = torch.full((b, k1), -1, dtype=torch.long, device=dev)
    logp, target_lp = torch.zeros(b, k1, device=dev), torch.zeros(b, k1, device=dev)
    kinds = torch.full((b, k1), int(TokenKind.PAD), dtype=torch.long, device=dev)
    emitted = torch.zeros(b, dtype=torch.long, device=dev)
    live = torch.arange(b, device=dev)
    for j in range(k1):
        bonus = j == k1 - 1
        cands = torch.full((len(live), 1), -1, dtype=torch.long, device=dev) if bonus else x[live, j:j + 1]
        res = _verify(rule, target[live, j], draft[live, j], cands, u_accept[live, j], u_final[live, j],
                      temperature, top_k, top_p)
        acc = res.accepted_index >= 0
        tokens[live, j], logp[live, j], target_lp[live, j] = res.tokens, res.behaviour_logprobs, res.target_logprobs
        fail = TokenKind.BONUS if bonus else TokenKind.RECOVERED
        kinds[live, j] = torch.where(acc, int(TokenKind.ACCEPTED), int(fail))
        emitted[live] += 1
        live = live[acc]
        if len(live) == 0:
            break
    return tokens, logp, target_lp, kinds, emitted


def check_sampled_chain(target, draft, x, temperature, top_k, top_p) -> None:
    """Raise for a bad logit row (naming its row and position) or a draft token q gives 0."""
    raise_if_bad_rows("target_logits", target, process_logits(target, temperature, top_k, top_p).logsumexp(-1),
                      temperature)
    if draft.shape[1]:
        raise_if_bad_rows("draft_logits", draft, scale_draft(draft, temperature).logsumexp(-1), temperature)
        check_token_range("draft_tokens", x, target.shape[-1], allow_pad=False)
        zero = (draft.gather(2, x[:, :, None])[..., 0] == -torch.inf).nonzero()
        if len(zero):
            raise zero_q_draft_error(x, *zero[0].tolist())
