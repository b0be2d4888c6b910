"""Block verification of sampled chains: lossless, with more accepted drafts than token by token.

``verify_chain(lossless, ..., test="block")`` at T > 0. Token-by-token verification accepts
each draft x_j with probability min(1, p_j(x_j) / q_j(x_j)) on its own; block verification
(Sun, Mendlovic, Leviathan et al., "Block Verification Accelerates Speculative Decoding",
ICLR 2025) decides the accepted prefix from the whole block at once. A draft whose ratio is
below 1 can then be rescued by a later draft whose ratio is above 1. The emitted sequence
still follows p, so **every emitted token's behaviour log-prob is log p(y)**, as in a lossless
chain, and the expected number of accepted drafts is never smaller than token by token gives
(the paper proves it optimal among verifiers that see only the block's conditionals).

Row b drafted x_0..x_{K-1}, x_j ~ q_j; p_j is the target at position j (p_K: the bonus
position). With the running weight w and the residual mass r at each prefix:

    w_0 = 1,  w_{j+1} = min(1, w_j p_j(x_j) / q_j(x_j))
    r_j = sum_v (w_j p_j(v) - q_j(v))+                   for j < K
    h_j = r_j / (r_j + 1 - w_j)  (h_0 = 1),  h_K = w_K
    n   = the largest j with u_j < h_j                      (accept x_0..x_{n-1})
    y   ~ p_K if n = K, else norm((w_n p_n - q_n)+)

h_j is the chance that the prefix of j drafts stands, given that no longer prefix did; the
walk runs from the full block down. With K = 1 this is the token-by-token rule exactly.
Why the emitted sequence follows p, and the exact check: ``tests/verifiers/test_block.py``
enumerates every block of a small vocabulary and checks that one round, continued by
sampling from p, gives p's law of every sequence.

Backends: on the CPU the fused C++ kernel (``csrc/block.cpp``, :mod:`.native`); the PyTorch code
below on other devices and as the fallback; the same uniforms, tested token for token.

Randomness, in this order from ``generator``: ``u_block = rand(B, K+1)`` (entry j is the test
of the prefix of j drafts), then ``u_final = rand(B)`` (inverse CDF of the final token).

Only the lossless rule: the law verified towards must be one fixed model of the prefix. The
laws of the lossy rules depend on q, and q on where the round started, so a block decision
that looks ahead would change what a lossy rule's recorded log-prob means.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import native
from .processing import CHUNK_ELEMENTS, draft_probs, process_logits, sample_inverse_cdf
from .results import ChainResult, TokenKind
from .sampled import check_sampled_chain, kernel_logits


def block_weights(p_x: Tensor, q_x: Tensor) -> Tensor:
    """w [B, K+1] (float64) from p_j(x_j), q_j(x_j) [B, K]: w_0 = 1, w_{j+1} = min(1, w_j p / q)."""
    ratio = torch.nan_to_num(p_x.double() / q_x.double(), nan=0.0)  # 0 / 0 (q underflowed): x is outside p
    w = [torch.ones_like(ratio[:, 0])]
    for j in range(ratio.shape[1]):
        w.append(torch.clamp(w[-1] * ratio[:, j], max=1.0))
    return torch.stack(w, dim=1)


def stop_probs(w: Tensor, r: Tensor) -> Tensor:
    """h [B, K+1] from w [B, K+1] and the residual masses r [B, K]: h_j = r_j / (r_j + 1 - w_j),
    1 where r_j + 1 - w_j = 0 (so h_0 = 1: w_0 = 1), h_K = w_K."""
    k = r.shape[1]
    den = r + 1 - w[:, :k]
    h = torch.where(den > 0, r / den.clamp(min=torch.finfo(den.dtype).tiny), torch.ones_like(r))
    return torch.cat([h, w[:, k:]], dim=1)


def expected_accepted(p: Tensor, q: Tensor, x: Tensor) -> tuple[Tensor, Tensor]:
    """Expected accepted drafts per row given its drafts, (token by token, as a block), float64 [B]
    each: p [B, K+1, V] the target's probabilities, q [B, K, V] the draft's, x [B, K] the drafts.
    Token by token: sum_k prod_{j<k} min(1, p_j(x_j) / q_j(x_j)); as a block: sum_n n h_n
    prod_{j>n} (1 - h_j)."""
    k = x.shape[1]
    p, q = p.double(), q.double()
    p_x, q_x = p[:, :k].gather(2, x[..., None])[..., 0], q.gather(2, x[..., None])[..., 0]
    token = (p_x / q_x).clamp(max=1).cumprod(1).sum(1)
    w = block_weights(p_x, q_x)
    h = stop_probs(w, (w[:, :k, None] * p[:, :k] - q).clamp(min=0).sum(-1))
    later = torch.cat([(1 - h[:, 1:]).flip(1).cumprod(1).flip(1), torch.ones_like(h[:, :1])], dim=1)
    steps = torch.arange(k + 1, device=p.device, dtype=torch.float64)
    return token, (steps * h * later).sum(1)


def _rows(target: Tensor, draft: Tensor, x: Tensor, u_block: Tensor, u_final: Tensor, temperature: float,
          top_k: int | None, top_p: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk of rows: (tokens [c, K+1] (the accepted drafts, then the final token; 0 after it),
    n [c], log p [c, K+1] at the emitted tokens, 0 after them)."""
    c, k1, _ = target.shape
    k = k1 - 1
    logp = torch.log_softmax(process_logits(target, temperature, top_k, top_p), dim=-1)  # [c, K+1, V]
    p = logp.exp()
    q = draft_probs(draft, temperature)  # [c, K, V]
    p_x = p[:, :k].gather(2, x[..., None])[..., 0]  # [c, K]
    q_x = q.gather(2, x[..., None])[..., 0]
    w = block_weights(p_x, q_x)  # [c, K+1]
    resid = (w[:, :k, None].float() * p[:, :k] - q).clamp_(min=0)  # [c, K, V]
    h = stop_probs(w, resid.sum(-1, dtype=torch.float64))
    steps = torch.arange(k1, device=target.device)
    n = torch.where(u_block < h, steps, 0).amax(1)  # [c]; 0 where no prefix stands (h_0 = 1 anyway)
    rows = torch.arange(c, device=target.device)
    weights = torch.where((n == k)[:, None], p[rows, n], resid[rows, n.clamp(max=k - 1)] if k else p[rows, n])
    weights = torch.where(weights.sum(-1, keepdim=True) > 0, weights, p[rows, n])  # p_n = q_n and w_n = 1
    y = sample_inverse_cdf(weights, u_final)
    tokens = torch.cat([x, x.new_zeros(c, 1)], dim=1)
    tokens[rows, n] = y
    lp = logp.gather(2, tokens[..., None])[..., 0].masked_fill(steps > n[:, None], 0.0)
    return tokens, n, lp


def _native(target, draft, x, u_block, u_final, temperature, top_k, top_p) -> ChainResult:
    """The fused C++ kernel (``csrc/block.cpp``) on the same uniforms."""
    z, zd, t = kernel_logits(target, draft, temperature, top_k, top_p)
    try:
        tokens, num, logp, kinds = native.verify_block_native(z, zd, x, u_block, u_final, t)
    except native.NativeError as err:  # re-checked in PyTorch, which names the row and position
        check_sampled_chain(target, draft, x, temperature, top_k, top_p)
        raise AssertionError(f"the C++ block verifier flagged bad input (status {err.status}) that has none") from None
    return ChainResult(tokens, num, logp, logp.clone(), kinds, torch.zeros(tokens.shape, dtype=torch.bool))


def verify_chain_block(target_logits: Tensor, draft_logits: Tensor, draft_tokens: Tensor, *, temperature: float,
                       top_k: int | None, top_p: float | None, generator: torch.Generator) -> ChainResult:
    """Block verification (module docstring) of B chains (checked shapes, T > 0): target_logits
    [B, K+1, V], draft_logits [B, K, V] over the target vocabulary, draft_tokens [B, K] with
    x_j ~ q_j. Behaviour and target log-probs are both log p(y); nothing is relaxed."""
    b, k1, v = target_logits.shape
    dev = target_logits.device
    state = generator.get_state()  # restored if the inputs are rejected
    u_block = torch.rand(b, k1, generator=generator, device=dev, dtype=torch.float64)
    u_final = torch.rand(b, generator=generator, device=dev)
    x = draft_tokens.long()
    try:
        if dev.type == "cpu" and native.enabled():
            return _native(target_logits, draft_logits, x, u_block, u_final, temperature, top_k, top_p)
        check_sampled_chain(target_logits, draft_logits, x, temperature, top_k, top_p)
    except ValueError:
        generator.set_state(state)
        raise
    step = max(1, CHUNK_ELEMENTS // (k1 * v))
    parts = [_rows(target_logits[s:s + step], draft_logits[s:s + step], x[s:s + step], u_block[s:s + step],
                   u_final[s:s + step], temperature, top_k, top_p) for s in range(0, b, step)]
    tokens, n, lp = (torch.cat(part) for part in zip(*parts))
    k = k1 - 1
    steps = torch.arange(k1, device=dev)
    pad = steps > n[:, None]  # [B, K+1]
    final = torch.where(n == k, int(TokenKind.BONUS), int(TokenKind.RECOVERED))
    kinds = torch.where(steps < n[:, None], int(TokenKind.ACCEPTED), final[:, None])
    return ChainResult(tokens.masked_fill(pad, -1), n + 1, lp, lp.clone(),
                       kinds.masked_fill(pad, int(TokenKind.PAD)).to(torch.int8),
                       torch.zeros(b, k1, dtype=torch.bool, device=dev))
