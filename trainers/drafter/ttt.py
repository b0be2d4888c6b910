"""Training-time test (TTT) for EAGLE-3 drafters: the unrolled forward, its masks, the loss
and the teacher-forced acceptance (``trainers/drafter/train.py`` runs the training).

Vocabulary (see ``rollout/eagle3.py`` and ``trainers/drafter/data.py`` for the rest):
- **draft position i** at step 0 takes the target features of token i and the embedding
  of token i + 1, and predicts token i + 2, i.e. it is scored against the target logits
  at position i + 1 ("shift by one").
- **step s** (0 <= s < ttt_steps) unrolls the draft: position i takes the draft's own
  output hidden from step s - 1 at i, the ground-truth token i + 1 + s, RoPE position
  ``pos + s``, and is scored against the target logits at i + 1 + s. It attends causally
  to the step-0 keys (j <= i) and, from steps 1..s, only to the keys at its own position i.
  This is exactly what chain drafting sees at inference (a test checks it).
- **loss** (``objective``), per step s, total = sum_s step_weight^s * loss_s:
  "ce": the soft cross-entropy to the target distribution renormalised over the draft
  vocabulary, on positions whose target predicts a response token and whose target argmax
  is in the draft vocabulary; "tv": one minus the expected acceptance of a draft sampled at
  T = 1, ``1 - sum_v min(p_v, q_v)`` (p: the target's probabilities over the full
  vocabulary at the draft ids, so mass outside the draft vocabulary counts as rejected;
  q: the draft at its logit scale), on every position whose target predicts a response
  token, plus ``ce_weight`` times the "ce" term. "tv" optimises what lossless verification
  at T = 1 accepts; "ce" (forward KL) spreads the draft over the target's support.
  "block": one minus the joint acceptance of the chain so far, ``1 - sum over x_1..x_s+1 of
  min(P(x_1..x_s+1), Q(x_1..x_s+1))`` at step s, where P and Q are the target's and the draft's
  laws of the s + 1 tokens from a position: no lossless verifier accepts an (s + 1)-token prefix
  more often (a coupling bound; token by token verification accepts the product of per-token
  overlaps, block verification, the best verifier, more). Summed over steps with weight 1 it
  bounds the expected accepted length of every lossless verifier from above; the bounds of the
  different prefixes need not be reachable at once. It is estimated along the responses, which must be
  samples of the target at T = 1 (``data.greedy_fraction: 0``): with ``r = Q(x_1..x_s) /
  P(x_1..x_s)`` over the sampled tokens before step s, the step-s term is
  ``sum_v min(p_s(v), r q_s(v))``, whose mean over sampled prefixes is the joint overlap
  exactly (:func:`joint_overlap`; at step 0, r = 1 and it is the "tv" term). A chain is scored
  only at the steps that predict a response token.
- **teacher-forced acceptance** (held-out report): per step, the share of positions where
  the draft's argmax equals the target's (T = 0) and the expected acceptance
  ``sum_v min(p, q)`` (T = 1); ``est_tau = 1 + sum_k prod_{s<k} a_s`` is the chain
  acceptance length these imply.

Simplification: steps s >= 1 run only on columns from ``align - ttt_steps - 1`` on
(the response region and the few prompt columns whose unrolled predictions land in it),
which skips work whose loss is masked anyway.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rollout.eagle3 import Eagle3Head
from trainers.drafter.data import Batch


def ttt_mask(valid: torch.Tensor, first: int, step: int) -> torch.Tensor:
    """Attention mask of step ``step`` for query columns ``first..T-1``: ``[B, Tq, T + step * Tq]``.

    valid: ``[B, T]`` bool, which step-0 keys are real tokens. Block 0 (step-0 keys) is
    causal over valid keys (a query always sees its own column, so padding rows stay
    finite); blocks 1..step (one per unrolled step) are diagonal: own position only.
    """
    b, t = valid.shape
    q = torch.arange(first, t, device=valid.device)[:, None]  # [Tq, 1]
    k = torch.arange(t, device=valid.device)[None, :]  # [1, T]
    block0 = ((k <= q) & valid[:, None, :]) | (k == q)  # [B, Tq, T]
    eye = torch.eye(t - first, dtype=torch.bool, device=valid.device).expand(b, -1, -1)
    return torch.cat([block0] + [eye] * step, dim=2)


def _shift(x: torch.Tensor, start: int, length: int, fill: float | int = 0) -> torch.Tensor:
    """Columns ``start..start+length-1`` of ``x [B, W, ...]``, padded with ``fill`` past the end."""
    part = x[:, start: start + length]
    pad = length - part.shape[1]
    if pad <= 0:
        return part
    return torch.cat([part, part.new_full((x.shape[0], pad, *x.shape[2:]), fill)], dim=1)


def ttt_forward(head: Eagle3Head, batch: Batch, steps: int) -> list[tuple[int, torch.Tensor]]:
    """Unroll the head ``steps`` times over ``batch``.

    Returns per step (first column, output hidden ``[B, T - first, H]``); the logits are
    ``head.logits_from_hidden(hidden)``, which callers apply to the positions they score.
    """
    t = batch.tokens.shape[1] - 1  # draft positions 0..T-1 (the last token has no successor)
    valid = batch.valid[:, :t]
    out = head(batch.tokens[:, 1:], batch.features[:, :t], batch.pos[:, :t], ttt_mask(valid, 0, 0),
               compute_logits=False)
    results = [(0, out.hidden)]
    first = max(0, batch.align - steps - 1)
    kv, hidden = out.kv, out.hidden[:, first:]
    for s in range(1, steps):
        tokens = _shift(batch.tokens, first + 1 + s, t - first)  # ground-truth token i + 1 + s
        pos = batch.pos[:, first:t] + s
        out = head(tokens, hidden, pos, ttt_mask(valid, first, s), past=kv, compute_logits=False)
        kv, hidden = out.kv, out.hidden
        results.append((first, hidden))
    return results


def _targets(head: Eagle3Head, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Target logits over the draft vocabulary ``[B, T, Vd]`` (column i = target position i + 1) and the loss mask:
    ``head.target_logits`` where the target was attached (``TargetModel.attach_to``: its lm_head, tied or
    not, and its logit rule), else the shared input embedding (a tied target with plain logits)."""
    source = getattr(head, "target_logits", None)
    if source is not None:
        logits = source(batch.final[:, 1:])  # [B, T, Vd]
    else:
        emb = head.embed_tokens.weight[head.target_ids].to(batch.final.dtype)  # [Vd, H]
        logits = batch.final[:, 1:] @ emb.T  # [B, T, Vd]
    am = batch.argmax[:, 1:]
    in_draft = head.t2d[am.clamp(min=0)] & (am >= 0)
    return logits, batch.lossable[:, 1:] & in_draft


def _full_probs(tl: torch.Tensor, batch: Batch) -> torch.Tensor:
    """The target's probabilities over its full vocabulary, at the draft ids ``[B, T, Vd]``
    (mass outside the draft vocabulary is left out, so a draft can never be accepted there)."""
    return (tl - batch.lse[:, 1:, None]).exp()


def _t1_acceptance(p: torch.Tensor, logits: torch.Tensor, scale: float) -> torch.Tensor:
    """Expected acceptance of a draft sampled from softmax(scale * logits) against target
    probabilities ``p`` (both ``[N, Vd]``): ``sum_v min(p_v, q_v)`` per position ``[N]``."""
    return joint_overlap(p, torch.softmax(logits * scale, -1), None)


OBJECTIVES = ("ce", "tv", "block")
LOG_RATIO_CAP = 30.0  # r = Q / P of a sampled prefix is capped at e^30 (min(p, r q) is p long before)
OUTSIDE = -1e4  # log q of a token outside the draft vocabulary: exp() gives exactly 0


def joint_overlap(p: torch.Tensor, q: torch.Tensor, log_ratio: torch.Tensor | None) -> torch.Tensor:
    """``sum_v min(p_v, r q_v)`` per position (``p``, ``q`` ``[N, Vd]``; ``r = exp(log_ratio [N])``,
    capped at ``exp(LOG_RATIO_CAP)``; None: r = 1, the T = 1 overlap of :func:`_t1_acceptance`).
    With r = Q(x_1..x_s) / P(x_1..x_s) of a prefix sampled from P, its mean over prefixes is
    ``sum over x_1..x_s+1 of min(P, Q)`` (module doc, "block")."""
    if log_ratio is None:
        return torch.minimum(p, q).sum(-1)
    return torch.minimum(p, log_ratio.clamp(max=LOG_RATIO_CAP).exp()[:, None] * q).sum(-1)


def next_log_ratio(log_ratio: torch.Tensor | None, log_q: torch.Tensor, log_p: torch.Tensor,
                   ids: torch.Tensor) -> torch.Tensor:
    """``log r`` after one more sampled token: ``+ log q(x) - log p(x)``, with ``log_q [N, Vd]``
    the draft's log-probabilities, ``log_p [N]`` the target's of the token and ``ids [N]`` its
    draft id (-1 outside the draft vocabulary, where q(x) = 0, so r becomes 0)."""
    outside = torch.full_like(log_p, OUTSIDE)
    step = torch.where(ids >= 0, log_q.gather(-1, ids.clamp(min=0)[:, None])[:, 0], outside) - log_p
    return step if log_ratio is None else log_ratio + step


def _sampled_ids(head: Eagle3Head, batch: Batch, tl: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per column c (target position c + 1): the draft id of the sampled token c + 2 (-1 outside
    the draft vocabulary or past the row) and the target's log-probability of it over its full
    vocabulary (meaningful where the id is >= 0), ``[B, T]`` each."""
    t = tl.shape[1]
    tokens = _shift(batch.tokens, 2, t, fill=-1)  # [B, T]: token c + 2
    target_ids = head.target_ids
    ids = torch.searchsorted(target_ids, tokens.clamp(min=0)).clamp(max=len(target_ids) - 1)
    ids = torch.where((target_ids[ids] == tokens) & (tokens >= 0), ids, torch.full_like(ids, -1))
    log_p = tl.gather(-1, ids.clamp(min=0)[..., None])[..., 0] - batch.lse[:, 1:]
    return ids, log_p


def ttt_loss(head: Eagle3Head, batch: Batch, steps: int, step_weight: float, objective: str = "ce", *,
             ce_weight: float = 0.0, scale: float = 1.0) -> tuple[torch.Tensor, list[float]]:
    """The weighted loss over the unrolled steps (module doc); returns (loss, per-step losses).

    scale: the draft logit scale of the "tv" objective (q = softmax(scale * logits), the law
    the head samples from); ce_weight: the "ce" term added to "tv". The per-step figures of
    "tv" are ``1 - mean acceptance`` without the "ce" term."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r}: allowed {OBJECTIVES}")
    if objective == "block":
        return _block_loss(head, batch, steps, step_weight, scale)
    with_ce = objective == "ce" or ce_weight > 0
    with torch.no_grad():
        tl, mask = _targets(head, batch)
        probs = torch.softmax(tl, dim=-1) if with_ce else None  # [B, T, Vd], renormalised over the draft vocabulary
        p_full = _full_probs(tl, batch) if objective == "tv" else None
    t = tl.shape[1]
    total, per_step = 0.0, []
    for s, (first, hidden) in enumerate(ttt_forward(head, batch, steps)):
        cols = (first + s, t - first)
        if with_ce:
            m = _shift(mask, *cols, fill=False)  # [B, Tq] scored positions
            logits = head.logits_from_hidden(hidden[m])  # [N, Vd]: lm_head on scored positions only
            ce = -(_shift(probs, *cols)[m] * F.log_softmax(logits, dim=-1)).sum(-1)  # [N]
            loss_s = ce.sum() / max(1, len(ce))
        if objective == "tv":
            m = _shift(batch.lossable[:, 1:], *cols, fill=False)
            accept = _t1_acceptance(_shift(p_full, *cols)[m], head.logits_from_hidden(hidden[m]), scale)
            tv_s = 1.0 - accept.sum() / max(1, len(accept))
            loss_s = tv_s + ce_weight * loss_s if with_ce else tv_s
            per_step.append(float(tv_s.detach()))
        else:
            per_step.append(float(loss_s.detach()))
        total = total + step_weight**s * loss_s
    return total, per_step


def _block_loss(head: Eagle3Head, batch: Batch, steps: int, step_weight: float,
                scale: float) -> tuple[torch.Tensor, list[float]]:
    """The "block" objective (module doc): per step, one minus the mean joint overlap of the
    chains scored there; each sampled token's draft and target log-probabilities carry r on."""
    with torch.no_grad():
        tl, _ = _targets(head, batch)
        p_full = _full_probs(tl, batch)
        ids, log_p = _sampled_ids(head, batch, tl)
    total, per_step = 0.0, []
    outs = ttt_forward(head, batch, steps)
    for s, ((overlap,), alive) in enumerate(_block_overlaps(head, batch, outs, (scale,), p_full, ids, log_p)):
        loss_s = 1.0 - (overlap * alive).sum() / alive.sum().clamp(min=1)
        per_step.append(float(loss_s.detach()))
        total = total + step_weight**s * loss_s
    return total, per_step


def _block_overlaps(head: Eagle3Head, batch: Batch, outs: list[tuple[int, torch.Tensor]],
                    scales: tuple[float, ...], p_full: torch.Tensor, ids: torch.Tensor, log_p: torch.Tensor):
    """Per step of ``outs`` (:func:`ttt_forward`'s): the joint overlap of each chain for each draft
    logit scale (:func:`joint_overlap`, a tuple of ``[N]``, one chain per position that predicts a
    response token; the head's logits computed once a step) and whether the step scores it
    (``[N]`` bool)."""
    t = p_full.shape[1]
    lossable = batch.lossable[:, 1:]
    first = max(0, batch.align - len(outs) - 1)  # the later steps' first column (before it nothing is lossable)
    start = _shift(lossable, first, t - first, fill=False)  # [B, Tq]: the chains' first positions
    log_ratios = [None] * len(scales)
    for s, (col0, hidden) in enumerate(outs):
        hidden = hidden[:, first - col0:]
        cols = (first + s, t - first)
        logits = head.logits_from_hidden(hidden[start])  # [N, Vd]
        log_qs = [F.log_softmax(logits * scale, -1) for scale in scales]
        alive = _shift(lossable, *cols, fill=False)[start]
        p = _shift(p_full, *cols)[start]
        yield tuple(joint_overlap(p, lq.exp(), lr) for lq, lr in zip(log_qs, log_ratios)), alive
        lp, x = _shift(log_p, *cols)[start], _shift(ids, *cols, fill=-1)[start]
        log_ratios = [next_log_ratio(lr, lq, lp, x) for lq, lr in zip(log_qs, log_ratios)]


@torch.no_grad()
def ttt_entropy_floor(head: Eagle3Head, batch: Batch, steps: int, step_weight: float) -> float:
    """The smallest value ``ttt_loss`` can take (draft = target): the weighted target entropies."""
    tl, mask = _targets(head, batch)
    ent = -(torch.softmax(tl, -1) * torch.log_softmax(tl, -1)).sum(-1)  # [B, T]
    t, first = tl.shape[1], max(0, batch.align - steps - 1)
    total = 0.0
    for s in range(steps):
        c = 0 if s == 0 else first
        m = _shift(mask, c + s, t - c, fill=False).float()
        total += step_weight**s * float((_shift(ent, c + s, t - c) * m).sum() / m.sum().clamp(min=1.0))
    return total


@torch.no_grad()
def ttt_acceptance(head: Eagle3Head, batch: Batch, steps: int,
                   scales: tuple[float, ...] = (1.0,), block: bool = False) -> dict[str, torch.Tensor]:
    """Per-step sums of teacher-forced acceptance at T = 0 (``acc_t0 [steps]``) and at T = 1 for
    each draft logit scale (``acc_t1 [len(scales), steps]``: the draft samples from
    softmax(scale * logits), see ``Eagle3Config.logit_scale``), and position counts ``[steps]``.
    ``block``: also the joint overlaps of the "block" objective per scale (``acc_block
    [len(scales), steps]``, over the ``count_block [steps]`` chains each step scores; meaningful
    on responses sampled at T = 1). One unrolled forward serves every scale."""
    tl, _ = _targets(head, batch)
    p_full = _full_probs(tl, batch)
    t = tl.shape[1]
    acc0, count = torch.zeros(steps), torch.zeros(steps)
    acc1 = torch.zeros(len(scales), steps)
    outs = ttt_forward(head, batch, steps)
    out = {}
    if block:
        ids, log_p = _sampled_ids(head, batch, tl)
        out["acc_block"], out["count_block"] = torch.zeros(len(scales), steps), torch.zeros(steps)
        for s, (overlaps, alive) in enumerate(_block_overlaps(head, batch, outs, scales, p_full, ids, log_p)):
            out["count_block"][s] = float(alive.sum())
            for i, overlap in enumerate(overlaps):
                out["acc_block"][i, s] = float((overlap * alive).sum())
    for s, (first, hidden) in enumerate(outs):
        m = _shift(batch.lossable[:, 1:], first + s, t - first, fill=False)
        am = _shift(batch.argmax[:, 1:], first + s, t - first, fill=-1)[m]  # [N]
        p = _shift(p_full, first + s, t - first)[m]  # [N, Vd]
        logits = head.logits_from_hidden(hidden[m])  # [N, Vd]
        hit0 = head.target_ids[logits.argmax(-1)] == am
        for i, scale in enumerate(scales):
            acc1[i, s] = float(_t1_acceptance(p, logits, scale).sum())
        acc0[s], count[s] = float(hit0.sum()), float(m.sum())
    return {"acc_t0": acc0, "acc_t1": acc1, "count": count} | out


def summed_acceptance(head: Eagle3Head, data, idx: list[int], steps: int, scales: tuple[float, ...],
                      batch: int, device: torch.device | str, block: bool = False) -> dict[str, torch.Tensor]:
    """:func:`ttt_acceptance` summed over the samples ``idx`` of ``data`` (a ``DrafterData``), in
    batches of ``batch``, with the head in eval mode (its mode is restored after)."""
    from trainers.drafter.data import collate

    was_training = head.training
    head.eval()
    sums: dict[str, torch.Tensor] = {}
    try:
        for start in range(0, len(idx), batch):
            acc = ttt_acceptance(head, collate(data, idx[start: start + batch], device), steps, scales, block=block)
            sums = {k: sums[k] + v for k, v in acc.items()} if sums else acc
    finally:
        head.train(was_training)
    return sums


def estimated_block_tau(acc: list[float] | torch.Tensor) -> float:
    """The ceiling that per-step joint overlaps (the "block" objective's) put on a round's tau:
    1 plus their sum. No lossless verifier's tau exceeds it (each overlap bounds how often a
    prefix is accepted); block verification, the best one, need not reach it."""
    return 1.0 + sum(float(a) for a in acc)


def estimated_tau(acc: list[float] | torch.Tensor) -> float:
    """Chain acceptance length implied by per-step acceptance rates: 1 + sum_k prod_{s<k} a_s."""
    tau, run = 1.0, 1.0
    for a in acc:
        run *= float(a)
        tau += run
    return tau
