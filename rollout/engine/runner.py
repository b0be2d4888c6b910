"""The model runner: owns the tensors of one generate call and runs the target and the draft.

Vocabulary:
- **pending token**: the last emitted token of a row. It is not in the target's KV cache
  yet; it is the first input (the root) of the row's next verification block.
- **block**: the tokens one verification forward feeds per row: the pending token then
  the drafted tokens (chain) or tree nodes. ``offsets [B|1, T]`` give their positions
  relative to the row's length (``0..K`` for a chain, the node depth for a tree) and
  ``block_mask [B|1, T, T]`` which block tokens each one sees (None = causal).
- **draft pair j**: the draft head's input at draft slot j is the token ``x_{j+1}`` with
  the target feature ``f_j`` of the position before it (the feature that predicted it);
  its output predicts ``x_{j+2}``; its RoPE position is j (0 at the first prompt token).
  Speculative draft step s pairs the s-th drafted token with the draft's own output hidden
  state of step s-1, at position j + s. This is the convention ``trainers/drafter/ttt.py``
  trains with (training-time test), so inference sees what training saw.
- **waiting pairs**: pairs whose target features are known but which the draft has not
  consumed yet: the whole prompt after the prefill, the accepted path plus the pending
  token after each round. ``draft_root`` consumes them (that is the draft's step 0) and
  returns the draft logits and hidden state at each row's last pair. Rounds that do not
  draft (``spec.max_batch``) queue their pairs; the next ``draft_root`` consumes the queue
  in the same forward, exactly as if it had run every round.
- **speculation**: draft forwards beyond step 0 within one round; their KV entries live
  only in ``self._spec_past``, or (native draft steps, ``rollout.kernels.native_draft``) in the draft
  cache's slots right after the longest committed row, and are dropped when the next round
  starts.
- **capture** (plain decoding only): every target forward also keeps, per row, the
  features and final-norm outputs of the positions it ran (``captures``); the drafter's
  training data is made of them.

All row-indexed tensors follow the live order of ``rollout.engine.sequences.SequenceTable``.
"""

from __future__ import annotations

import functools
from contextlib import nullcontext

import torch

from rollout.eagle3_head import DraftOutput
from rollout.engine.attention import Positions, engine_attention, key_positions
from rollout.engine.chunking import prefill_chunks
from rollout.engine.kv_cache import RowKVCache
from rollout.kernels import fused_layers, native_draft, native_layers
from rollout.options import EngineOptions

DRAFT_POSITION_OFFSET = 0  # draft pair j sits at RoPE position j + this offset


class ModelRunner:
    """Target + optional EAGLE-3 head, their KV caches, pending tokens and draft inputs.

    options: the engine's (``rollout.options.EngineOptions``): ``share_prompts`` (see
    ``start``) and the kernels' options, which every forward hands on (``stack_kernel``,
    ``rollout.kernels.native_draft``)."""

    def __init__(self, target, head=None, prefill_tokens: int = 1024, capture: bool = False,
                 options: EngineOptions = EngineOptions()):
        self.target, self.head = target, head
        self.options = options
        self.capture = capture  # keep every forwarded position's features (see ``captures``)
        self.prefilled_rows = 0  # rows the last ``start`` prefilled
        cfg = target.config
        self.device = target.device
        self.dtype = target.dtype
        self.num_kv_heads = int(cfg.num_key_value_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.prefill_tokens = prefill_tokens
        # a layer with a sliding window needs every forward's key positions (rollout.engine.attention)
        self._windowed = getattr(cfg, "sliding_window", None) is not None
        if head is not None:
            self.draft_ids = head.target_ids.to(self.device)  # [Vd] target id of each draft id
        self.cache: RowKVCache | None = None
        self.draft_kv: RowKVCache | None = None
        self.drop_speculation()

    @property
    def batch(self) -> int:
        return 0 if self.cache is None else self.cache.batch

    # ------------------------------------------------------------------ prefill
    def start(self, prompts: list[list[int]], capacity: int) -> torch.Tensor:
        """Allocate the caches and prefill every prompt; return the last logits ``[B, V]``.

        Identical prompts (GRPO's group of samples per prompt) are prefilled once: the first
        rows of the cache take the distinct prompts, and every row then copies its prompt's
        KV slots, last logits and features. Rows run in chunks of about ``prefill_tokens``
        tokens, each padded to its longest prompt; where sorting the prompts by length pads
        fewer tokens (``rollout.engine.chunking``), the cache's first rows take them in that order, and
        every row then copies its own the same way. Each row's prefill is independent of the
        other rows of its forward (per-row attention, batch-invariant linear layers): the values
        are the same bits as prefilling every row, except where a row lands in a chunk padded
        to another length, which moves them by float rounding (log-probs by about 1e-5 on
        SmolLM2), as chunking itself does. Identical prompts are not shared with ``capture``
        (every row keeps its own positions), nor with ``EngineOptions(share_prompts=False)``."""
        b, p_max = len(prompts), max(len(p) for p in prompts)
        self._rows = list(range(b))  # the call's row index of each live row
        self._captured: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(b)]
        self.cache = RowKVCache(self.target.num_layers, b, self.num_kv_heads, self.head_dim, capacity,
                                self.dtype, self.device)
        ids = torch.zeros(b, p_max, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        ids = ids.to(self.device)
        plen = torch.tensor([len(p) for p in prompts], device=self.device)  # [B]
        slots: dict[tuple[int, ...], int] = {}  # distinct prompt -> its index among the distinct ones
        source = [slots.setdefault(tuple(p), len(slots)) for p in prompts]  # each row's distinct prompt
        share = self.options.share_prompts and not self.capture and len(slots) < b
        distinct = [source.index(j) for j in range(len(slots))] if share else list(range(b))  # a row of each
        chunks = prefill_chunks([len(prompts[r]) for r in distinct], self.prefill_tokens)
        order = [distinct[j] for chunk in chunks for j in chunk]  # the row each prefilled cache row runs
        u_ids, u_plen = ids[order], plen[order]
        feats = None
        last_logits = []
        r0 = 0
        for chunk in chunks:
            rows = slice(r0, r0 + len(chunk))
            r0 = rows.stop
            p_chunk = int(u_plen[rows].max())
            logits, f, final = self._prefill_chunk(u_ids[rows, :p_chunk], u_plen[rows], rows)
            last_logits.append(logits)
            if self.capture:
                called = order[rows]
                self._record(f, final, called, [len(prompts[r]) for r in called])
            if self.head is not None:
                if feats is None:
                    feats = f.new_zeros(len(order), p_max, f.shape[-1])
                feats[rows, :p_chunk] = f
        logits = torch.cat(last_logits)
        if order != list(range(b)):  # every row takes its prompt's prefill from the cache row that ran it
            ran = {r: j for j, r in enumerate(order)}
            index = torch.tensor([ran[distinct[source[i]] if share else i] for i in range(b)], device=self.device)
            for kv in (*self.cache.keys, *self.cache.values):
                kv[:, :, :p_max] = kv[:, :, :p_max].index_select(0, index)
            logits = logits.index_select(0, index)
            feats = feats.index_select(0, index) if feats is not None else None
        self.prefilled_rows = len(order)
        self.cache.set_lengths(plen)
        self._prompt_ids, self._plen = ids, plen
        self._waiting_feats = feats  # [B, P, 3H] until the first token is known
        return logits

    def _prefill_chunk(self, ids: torch.Tensor, plen: torch.Tensor, rows: slice):
        """Prefill rows ``rows``: logits ``[b, V]`` at each row's last prompt token, the
        features ``[b, t, 3H]`` (None without a head or capture) and the final norm's output
        ``[b, t, H]`` (None unless capturing) of every prompt token."""
        b, t = ids.shape
        self.cache.prepare(t, rows)
        pos = torch.arange(t, device=self.device)
        key_ok = (pos[None, :] < plen[:, None])  # [b, t]
        causal = pos[None, :] <= pos[:, None]  # [t, t]
        mask = causal[None] & (key_ok[:, None, :] | torch.eye(t, dtype=torch.bool, device=self.device)[None])
        last = (plen - 1)[:, None, None]
        hidden, feats = self._body_forward(ids, pos[None].expand(b, t), mask[:, None])
        last_hidden = hidden.gather(1, last.expand(b, 1, hidden.shape[-1]))[:, 0]  # [b, H]
        return self.target.logits(last_hidden), feats, hidden

    def stack_kernel(self, base):
        """The kernels the target's forwards get (``TargetModel.body``): its decoder stack as one
        loop with the native layer kernel (``rollout.kernels``), or None where they do not apply;
        both under this runner's options."""
        options = self.options
        return fused_layers.stack_forward(base, functools.partial(native_layers.run, options=options), options)

    def _positions(self, query: torch.Tensor, lengths: torch.Tensor, kv_len: int) -> Positions | None:
        """A forward's query and key positions, for targets with sliding-window layers (else None)."""
        return Positions(query, key_positions(lengths, query, kv_len)) if self._windowed else None

    def _body_forward(self, ids, positions, mask):
        """The target's decoder stack only (final norm included, no lm_head): the prefill
        needs logits at one position per row, not over the whole prompt. Captures the
        EAGLE-3 features (``TargetModel.capture``) when there is a head or a capture."""
        features = self.head is not None or self.capture
        b, t = ids.shape
        with engine_attention(self.target, self._positions(positions, positions.new_zeros(b), t)):
            lean = self.target.body(ids, positions, mask, self.cache, self.stack_kernel)
            if lean is not None:
                return lean[0], lean[1].features() if features else None
            with self.target.capture() if features else nullcontext() as cap:
                out = self.target.model.base_model(input_ids=ids, position_ids=positions, attention_mask=mask,
                                                   cache=self.cache, use_cache=True)
        return out.last_hidden_state, cap.features() if features else None

    def _record(self, feats: torch.Tensor, final: torch.Tensor, rows, lengths: list[int]) -> None:
        """Capture: keep the first ``lengths[i]`` positions of ``feats/final [b, t, .]`` for
        the call's row ``rows[i]``."""
        for i, (r, n) in enumerate(zip(rows, lengths)):
            self._captured[r].append((feats[i, :n], final[i, :n]))

    def captures(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per row of the call: the features ``[n, 3H]`` and final norm outputs ``[n, H]`` of
        the ``n`` positions the target ran for it, in order (capture only)."""
        return [(torch.cat([f for f, _ in parts]), torch.cat([x for _, x in parts])) for parts in self._captured]

    def set_first_tokens(self, tokens: torch.Tensor) -> None:
        """Record the first sampled token ``[B]``: it is pending, and closes the prompt's draft pairs."""
        self.pending = tokens
        if self.head is None:
            return
        b = tokens.shape[0]
        shifted = torch.cat([self._prompt_ids[:, 1:], self._prompt_ids.new_zeros(b, 1)], dim=1)  # x_{j+1}
        shifted.scatter_(1, (self._plen - 1)[:, None], tokens[:, None])
        cap = self.cache.capacity
        h = self.head.cfg
        self.draft_kv = RowKVCache(1, b, h.num_key_value_heads, h.head_dim, cap, self.head.fc.weight.dtype,
                                   self.device)
        self._set_waiting(shifted, self._waiting_feats, self._plen)
        self._wait_more: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # skipped rounds' pairs
        self._wait_consumed = False

    def _set_waiting(self, tokens: torch.Tensor, feats: torch.Tensor, counts: torch.Tensor) -> None:
        self._wait_tokens, self._wait_feats, self._wait_counts = tokens, feats, counts
        self._wait_host = counts.tolist()

    def _merge_waiting(self) -> None:
        """Lay the pairs of rounds the draft skipped (``_wait_more``) after the waiting ones,
        row by row, so that ``draft_root`` consumes them all in one forward."""
        if not self._wait_more:
            return
        parts = [(self._wait_tokens, self._wait_feats, self._wait_counts), *self._wait_more]
        b, f = self.batch, self._wait_feats.shape[-1]
        host = [sum(c) for c in zip(*(part[2].tolist() for part in parts))]
        width, pad = max(host), max(part[0].shape[1] for part in parts)
        tokens = self._wait_tokens.new_zeros(b, width + pad)
        feats = self._wait_feats.new_zeros(b, width + pad, f)
        offset = torch.zeros(b, dtype=torch.long, device=self.device)
        for t, x, c in parts:  # in order: a part's padding is overwritten by the next part
            idx = offset[:, None] + torch.arange(t.shape[1], device=self.device)
            tokens.scatter_(1, idx, t)
            feats.scatter_(1, idx[..., None].expand(-1, -1, f), x)
            offset = offset + c
        self._set_waiting(tokens[:, :width], feats[:, :width], offset)
        self._wait_more = []

    # ------------------------------------------------------------------ target
    def verify_forward(self, tokens: torch.Tensor, offsets: torch.Tensor, block_mask: torch.Tensor | None):
        """Run the target on the block ``tokens [B, T]``; return logits ``[B, T, V]`` and
        features ``[B, T, 3H]``. The block's KV is written but not committed."""
        b, t = tokens.shape
        _, kv_len = self.cache.prepare(t)
        lengths = self.cache.lengths
        positions = lengths[:, None] + offsets  # [B, T]
        keys = torch.arange(kv_len, device=self.device)
        if block_mask is None:
            mask = keys[None, None, :] <= (lengths[:, None] + torch.arange(t, device=self.device))[:, :, None]
        else:
            rel = keys[None, :] - lengths[:, None]  # [B, L]
            in_block = (rel >= 0) & (rel < t)
            seen = block_mask.expand(b, t, t).gather(2, rel.clamp(0, t - 1)[:, None, :].expand(b, t, kv_len))
            mask = (rel < 0)[:, None, :] | (seen & in_block[:, None, :])  # [B, T, L]
        with engine_attention(self.target, self._positions(positions, lengths, kv_len)):
            out = self.target(tokens, position_ids=positions, attention_mask=mask[:, None], cache=self.cache,
                              final=self.capture, stack=self.stack_kernel)
        if self.capture:  # plain rounds only: the block is the pending token, committed whatever comes
            self._record(out.features, out.final, self._rows, [t] * b)
        return out.logits, out.features

    def commit(self, counts: torch.Tensor, host_counts: list[int], emitted: torch.Tensor,
               features: torch.Tensor, path: torch.Tensor | None) -> None:
        """Commit ``counts [B]`` block tokens per row (the root and the accepted drafts).

        emitted [B, W]: the tokens emitted this round (the last valid one becomes pending);
        features [B, T, 3H]: the block's target features; path [B, W]: block offsets of the
        committed tokens when they are not the block's prefix (trees), else None.
        """
        self.cache.commit(counts, host_counts, path)
        self.pending = emitted.gather(1, (counts - 1)[:, None])[:, 0]
        if self.head is not None:
            w = emitted.shape[1]
            feats = features[:, :w] if path is None else features.gather(
                1, path[:, :, None].expand(-1, -1, features.shape[-1]))
            if self._wait_consumed:  # (the queue is empty: draft_root merged it)
                self._set_waiting(emitted, feats, counts)
            else:  # a round without drafting: the draft catches up on these pairs later
                self._wait_more.append((emitted, feats, counts))
            self._wait_consumed = False

    def keep(self, rows: list[int]) -> None:
        """Drop finished rows: keep ``rows`` (distinct, any order: row rows[i] becomes row i) of every
        row-indexed tensor."""
        idx = torch.tensor(rows, dtype=torch.long, device=self.device)
        self._rows = [self._rows[r] for r in rows]
        self.cache.keep(rows)
        self.pending = self.pending.index_select(0, idx)
        if self.draft_kv is not None:
            self.draft_kv.keep(rows)
            self._set_waiting(self._wait_tokens.index_select(0, idx), self._wait_feats.index_select(0, idx),
                              self._wait_counts.index_select(0, idx))
            self._wait_more = [tuple(t.index_select(0, idx) for t in part) for part in self._wait_more]

    # ------------------------------------------------------------------ draft
    def draft_root(self) -> DraftOutput:
        """Draft step 0: consume the waiting pairs; return logits ``[B, Vd]`` and hidden
        ``[B, H]`` at each row's last pair (they predict the first drafted token)."""
        self._merge_waiting()
        kv, counts = self.draft_kv, self._wait_counts
        b, t = self.batch, max(self._wait_host)
        lc = max(kv.host_lengths)
        hidden_out = []
        rows_per_chunk = max(1, self.prefill_tokens // t)
        for r0 in range(0, b, rows_per_chunk):
            rows = slice(r0, min(b, r0 + rows_per_chunk))
            hidden = self._draft_root_chunk(rows, t, lc)
            last = (counts[rows] - 1)[:, None, None]
            hidden_out.append(hidden.gather(1, last.expand(-1, 1, hidden.shape[-1]))[:, 0])
        kv.commit(counts, self._wait_host)
        self._wait_consumed = True
        self.drop_speculation()
        hidden = torch.cat(hidden_out)
        # the lm_head at each row's last pair only: a catch-up over the prompt or many skipped
        # rounds had paid the draft vocabulary's logits at every pair it consumed
        return DraftOutput(self.head.draft_logits(hidden), hidden)

    def _draft_root_chunk(self, rows: slice, t: int, lc: int):
        kv, counts = self.draft_kv, self._wait_counts[rows]
        d_len = kv.lengths[rows]  # [b]
        b = d_len.shape[0]
        ar = torch.arange(t, device=self.device)
        pos = d_len[:, None] + ar + DRAFT_POSITION_OFFSET  # [b, t]
        past_ok = torch.arange(lc, device=self.device)[None, :] < d_len[:, None]  # [b, lc]
        new_ok = (ar[None, :] <= ar[:, None])[None] & ((ar[None, None, :] < counts[:, None, None])
                                                      | torch.eye(t, dtype=torch.bool, device=self.device))
        mask = torch.cat([past_ok[:, None, :].expand(b, t, lc), new_ok], dim=2)  # [b, t, lc + t]
        keys, values = kv.keys[0][rows], kv.values[0][rows]
        tokens, feats = self._wait_tokens[rows, :t], self._wait_feats[rows, :t]
        # one C++ call, its new keys and values in the slots after the longest row (the layout the
        # head's forward concatenates): the same bits; then moved to each row's own slots below
        out = native_draft.step(self.head, tokens, feats, pos, mask, keys, values, lc, logits=False,
                                options=self.options)
        if out is not None:
            hidden, new_k, new_v = out[1], keys[:, :, lc:lc + t].clone(), values[:, :, lc:lc + t].clone()
        else:
            past = (keys[:, :, :lc], values[:, :, :lc]) if lc else None
            d = self.head(tokens, feats, pos, mask, past, compute_logits=False)
            hidden, new_k, new_v = d.hidden, d.kv[0][:, :, lc:], d.kv[1][:, :, lc:]
        slots = d_len[:, None] + ar  # [b, t]; slots past the count are scratch, overwritten later
        idx = slots[:, None, :, None].expand(b, new_k.shape[1], t, new_k.shape[3])
        keys.scatter_(2, idx, new_k)
        values.scatter_(2, idx, new_v)
        return hidden

    def drop_speculation(self) -> None:
        """Forget this round's speculative draft entries (the next step is the round's first)."""
        self._spec_past = None
        self._spec_cached = 0  # speculative entries in the cache's slots after the longest row

    def _committed(self, lc: int) -> torch.Tensor:
        """``[B, lc]`` bool: the draft cache slots each row has committed (what every draft query sees)."""
        return torch.arange(lc, device=self.device)[None, :] < self.draft_kv.lengths[:, None]

    def draft_chain(self, logits: torch.Tensor, hidden: torch.Tensor, k: int, temperature: float,
                    uniforms: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Right after ``draft_root``: its ``logits [B, Vd]`` and ``hidden [B, H]``, then k - 1 draft
        steps, the k drafts sampled (``uniforms [k, B]``; None: greedy, the argmax) as
        ``rollout.engine.draft_sampling.sample_draft`` does, from one C++ call (``rollout.kernels.native_draft.chain``).
        Returns the draft ids ``[B, k]`` and their logits ``[B, k, Vd]``, the same as the loop over
        ``draft_step`` gives, or None where the call does not fit (nothing written; the caller runs
        the loop)."""
        if self._spec_past is not None or self._spec_cached:
            return None
        kv = self.draft_kv
        lc = max(kv.host_lengths)
        committed = self._committed(lc)  # [B, lc]
        levels = torch.arange(1, k, device=self.device)[:, None]  # [k - 1, 1]
        positions = kv.lengths[None, :] - 1 + levels + DRAFT_POSITION_OFFSET  # [k - 1, B]
        out = native_draft.chain(self.head, logits, hidden, k, temperature, uniforms, self.draft_ids, committed,
                                 positions, kv.keys[0], kv.values[0], lc, options=self.options)
        if out is not None:
            self._spec_cached += k - 1
        return out

    def draft_step(self, tokens: torch.Tensor, hidden: torch.Tensor, level: int,
                   spec_visible: torch.Tensor | None) -> DraftOutput:
        """One speculative draft forward of ``tokens [B, T]`` (draft ids mapped to target ids
        by the caller) with input hidden ``[B, T, H]`` at tree level ``level`` (>= 1).

        spec_visible [B, T, S]: which of the S earlier speculative slots of this round each
        query sees (None when S = 0). Every query also sees the committed draft cache and
        itself. Returns logits ``[B, T, Vd]``, output hidden ``[B, T, H]`` and the kv (None where
        the step ran in one C++ call, ``rollout.kernels.native_draft``: its entries are in the cache).
        """
        kv = self.draft_kv
        b, t = tokens.shape
        lc = max(kv.host_lengths)
        parts = [self._committed(lc)[:, None, :].expand(b, t, lc)]
        if spec_visible is not None:
            parts.append(spec_visible)
        parts.append(torch.eye(t, dtype=torch.bool, device=self.device)[None].expand(b, t, t))
        mask = torch.cat(parts, dim=2)
        pos = (kv.lengths - 1 + level + DRAFT_POSITION_OFFSET)[:, None].expand(b, t)
        if self._spec_past is None:  # the earlier entries (if any) sit in the cache: one C++ call
            out = native_draft.step(self.head, tokens, hidden, pos, mask, kv.keys[0], kv.values[0],
                                    lc + self._spec_cached, options=self.options)
            if out is not None:
                self._spec_cached += t
                return DraftOutput(*out)
        past = self._spec_past if self._spec_past is not None else kv.kv(0, lc + self._spec_cached)
        d = self.head(tokens, hidden, pos, mask, past)
        self._spec_past = d.kv
        return d
