"""The speculative rollout engine (the ``hf`` backend): a step loop over rounds.

Vocabulary (see also ``rollout.engine.runner``, ``rollout.engine.tree`` and the ``verifiers`` package):
- **round**: draft (chain or tree) for every live row, verify the block in one target
  forward, emit tokens with the verifier, commit the accepted part of the caches, drop
  finished rows. ``spec.mode == "off"`` runs the same loop with an empty draft (one token
  per round), so speedups compare the same engine. With ``spec.max_batch`` a round over
  more unfinished rows than that is such a plain round too (the draft catches up later);
  with ``max_batch: auto`` :class:`rollout.engine.planner.RoundPlanner` picks, round by round,
  a plain round or how many tokens to draft, from the costs and acceptance measured in
  the call.
- **first token**: each row's first completion token is sampled from the prefill's p
  (a bonus token); from then on every round starts from the row's pending token.
- **capture**: ``generate(capture=True)`` (plain decoding) also returns the target's
  EAGLE-3 features at every position it ran, per row (the drafter's training data).

The engine only glues: :class:`rollout.engine.sequences.SequenceTable` does the bookkeeping,
:class:`rollout.engine.runner.ModelRunner` owns tensors and runs the models, ``rollout.engine.tree``
builds and walks trees, ``verifiers`` decides what is emitted. No Ray here.

Sampled chains use ``verify_chain`` (draft x ~ q; the rule's own test, or with ``verifier.test:
law`` rejection towards its law, ``block`` as a block). Greedy chains and top-k trees use the walk
over deterministic candidates (``verify_candidates`` node by node); sampled trees the walk over
sampled candidates (``rollout.engine.sampled_tree``; with ``block``, ``walk_block``). Randomness: one
``torch.Generator`` seeded per call drives the drafts and the verifier, so a call is
deterministic given its seed (and the batch composition), except under ``spec.max_batch: auto``,
whose per-round choice of drafting follows measured wall-clock costs (the law of each token is
the same either way; which draws it takes is not).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from rollout.architectures import family_of
from rollout.eagle3_io import check_head_fits
from rollout.engine.allocator import tune_malloc
from rollout.engine.draft_sampling import sample_draft
from rollout.engine.kv_cache import fill_from_tail
from rollout.engine.planner import RoundPlanner
from rollout.engine.runner import ModelRunner
from rollout.kernels import native_linear
from rollout.options import EngineOptions
from rollout.outputs import Capture, DebugRecord, GenerationResult, Timings
from rollout.params import SamplingParams, SpecConfig, VerifierConfig, check_test
from rollout.engine.sampled_tree import (ShapePlanner, draft_sampled_tree, draft_steps, fused_walk_usable, walk_block,
                                  walk_sampled)
from rollout.engine.sequences import RoundOutput, SequenceTable, prompt_budgets
from rollout.engine.tree import chain_tree, draft_tree, root_tree, walk
from verifiers import verify_chain


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class _Call:
    """State of one generate call shared by the round functions."""

    runner: ModelRunner
    table: SequenceTable
    rule: object
    generator: torch.Generator
    sampling: SamplingParams
    spec: SpecConfig
    timings: Timings
    debug: list[DebugRecord] | None
    record: list = field(default_factory=list)
    planner: RoundPlanner | None = None
    drafted_last: bool = False  # the previous round drafted (else the next draft catches up)
    shapes: ShapePlanner | None = None  # sampled trees' shapes (spec.tree_candidates 'sampled', T > 0)
    test: str = "rule"  # sampled chains' acceptance test (VerifierConfig.test)

    @property
    def verify_kw(self) -> dict:
        s = self.sampling
        return {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p, "generator": self.generator}


class Engine:
    """Batched speculative decoding over a ``TargetModel`` and an optional ``Eagle3Head``.

    num_threads: torch CPU threads (default: the cores this process may use).
    prefill_tokens: rows are prefilled in chunks of about this many tokens (bounds the
        memory of the prefill's full-vocabulary logits).
    linear: how the linear layers of target and head compute in forwards of few rows:
        ``auto`` (default) through ``rollout.kernels.native_linear``'s kernel where it is available
        (fp32 on an AVX-512 CPU), ``native`` (required), ``torch`` (always torch's GEMM).
    options: which of the engine's faster paths its forwards take
        (:class:`rollout.options.EngineOptions`, every one on by default; each off keeps a
        slower path with the same outputs, for A/B measurements). Handed to the model runner and,
        through it and :meth:`linear_routing`, to the kernels.

    A target whose architecture the engine does not reproduce exactly is refused here
    (``rollout.architectures.UnsupportedModelError``), before the first token.
    """

    def __init__(self, target, head=None, *, num_threads: int | None = None, prefill_tokens: int = 1024,
                 linear: str = "auto", options: EngineOptions = EngineOptions()):
        if not isinstance(options, EngineOptions):
            raise TypeError(f"options must be an EngineOptions, got {type(options).__name__}")
        family_of(target.model)
        if head is not None:
            check_head_fits(head, target)
        self.target, self.head = target, head
        self.prefill_tokens = prefill_tokens
        self.options = options
        self.use_native_linear = target.device.type == "cpu" and native_linear.resolve(linear)
        self._planners: dict[tuple, RoundPlanner] = {}  # see planner()
        self._trace_plans = False  # see trace_plans()
        if target.device.type == "cpu":
            torch.set_num_threads(num_threads or available_cores())
            tune_malloc()  # vocabulary-sized temporaries reuse freed memory (rollout/engine/allocator.py)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None,
                 spec: SpecConfig | None = None, verifier: VerifierConfig | None = None, seed: int = 0,
                 *, debug: bool = False, capture: bool = False) -> GenerationResult:
        """Complete every prompt (token id lists of any lengths); see the module docstring.

        debug: keep, per emitted token, the logits the verifier saw (``result.debug``).
        capture: keep, per row, the target's features at every position it ran
            (``result.captures``, :class:`rollout.outputs.Capture`); plain decoding only.
        """
        sampling = sampling or SamplingParams()
        spec = spec or SpecConfig(mode="off")
        verifier = verifier or VerifierConfig()
        if capture and spec.speculative:
            raise ValueError(f"capture needs plain decoding (spec.mode 'off'), got spec.mode={spec.mode!r}")
        if spec.speculative and self.head is None:
            raise ValueError(f"spec.mode={spec.mode!r} needs a draft head; this engine has none (use mode 'off')")
        check_test(spec, verifier, sampling.temperature)
        if not prompts:
            return GenerationResult([], Timings(), [] if debug else None, [] if capture else None)
        budgets = prompt_budgets(prompts, sampling.max_new_tokens, self.target.config.max_position_embeddings,
                                 self.target.vocab_size)
        start = time.perf_counter()
        dev = self.target.device
        head = self.head if spec.speculative else None  # plain decoding pays nothing for the draft
        call = _Call(runner=ModelRunner(self.target, head, self.prefill_tokens, capture, self.options),
                     table=SequenceTable(prompts, budgets, sampling.stop_token_ids), rule=verifier.rule(),
                     generator=torch.Generator(dev).manual_seed(seed), sampling=sampling, spec=spec,
                     timings=Timings(), debug=[] if debug else None,
                     planner=self.planner(spec, verifier, sampling) if spec.auto else None, test=verifier.test)
        if spec.sampled_tree and sampling.temperature > 0:
            call.shapes = ShapePlanner(spec.total_tokens, spec.depth, spec.top_k)
        with torch.inference_mode(), self.linear_routing(head):
            self._prefill(call, prompts, max(budgets))
            call.timings.setup_s = time.perf_counter() - start
            while len(call.table):
                try:
                    self._round(call)
                except ValueError as err:  # the verifiers name a batch row; say which prompt it is
                    raise ValueError(f"{err} [round {call.timings.rounds + 1} of this call: batch row r is "
                                     f"prompt {_rows_text(call.table.live)}[r]]") from err
        t = call.timings
        t.total_s = time.perf_counter() - start
        t.other_s = max(0.0, t.total_s - t.draft_s - t.verify_s)
        completions = call.table.completions()
        t.tokens = sum(c.num_tokens for c in completions)
        captures = [Capture(f, x) for f, x in call.runner.captures()] if capture else None
        return GenerationResult(completions, t, _trim_debug(call.debug, completions), captures)

    def planner(self, spec: SpecConfig, verifier: VerifierConfig, sampling: SamplingParams) -> RoundPlanner:
        """The round planner of ``max_batch: auto`` calls with these settings, kept across calls:
        the step costs it measured stay, its acceptance counts decay at each call
        (``RoundPlanner.new_call``). One per speculation config, verifier and sampling setting
        (they set the acceptance); :meth:`forget_plans` drops them all."""
        key = self._plan_key(spec, verifier, sampling)
        planner = self._planners.get(key)
        if planner is None:
            planner = self._planners[key] = RoundPlanner.for_spec(spec)
            planner.trace = [] if self._trace_plans else None
        else:
            planner.new_call()
        return planner

    @staticmethod
    def _plan_key(spec: SpecConfig, verifier: VerifierConfig, sampling: SamplingParams) -> tuple:
        return repr(spec), repr(verifier), sampling.temperature, sampling.top_k, sampling.top_p

    def trace_plans(self, on: bool = True) -> None:
        """Have the planners of ``max_batch: auto`` calls record every round (``RoundPlanner.trace``:
        the choice, why, the rates compared, the round's seconds and emitted tokens; read them with
        :meth:`plan_trace`). Planners already made start recording now; ``on=False`` stops and drops
        the records."""
        self._trace_plans = on
        for planner in self._planners.values():
            planner.trace = ([] if planner.trace is None else planner.trace) if on else None

    def plan_trace(self, spec: SpecConfig, verifier: VerifierConfig, sampling: SamplingParams) -> list[dict] | None:
        """The round records of the planner for these settings (None: no such planner, or not
        tracing); the list itself, so a caller can slice it per run. Starts no call."""
        planner = self._planners.get(self._plan_key(spec, verifier, sampling))
        return planner.trace if planner is not None else None

    def forget_plans(self) -> None:
        """Drop what the planners learned (e.g. after moving the engine to another machine)."""
        self._planners.clear()

    def linear_routing(self, head=None):
        """The context in which this engine's forwards run: the target's (and ``head``'s) linear
        layers on the native kernel when the engine uses it (``linear``), else unchanged; fused and
        packed as the engine's options say."""
        if not self.use_native_linear:
            return native_linear.routed(options=self.options)
        return native_linear.routed(self.target, head, options=self.options)

    # ------------------------------------------------------------------ rounds
    def _prefill(self, call: _Call, prompts: list[list[int]], max_new: int) -> None:
        t0 = time.perf_counter()
        spec = call.spec
        capacity = max(len(p) for p in prompts) + max_new + spec.block_size + spec.max_emitted + 2
        logits = call.runner.start(prompts, capacity)  # [B, V]
        tree = root_tree(torch.zeros(len(prompts), dtype=torch.long, device=logits.device))
        res = walk(call.rule, tree, logits[:, None], record=self._record(call), **call.verify_kw)
        call.timings.verify_s += time.perf_counter() - t0
        call.timings.target_forwards += 1
        call.runner.set_first_tokens(res.tokens[:, 0])
        self._finish_round(call, res, first=True)

    def _round(self, call: _Call) -> None:
        """One round; with a planner, it picks the draft length k (0 = plain) and learns from
        the round's cost and acceptance."""
        spec, b = call.spec, len(call.table)
        t0 = time.perf_counter()
        if call.planner is not None:
            k = call.planner.choose(b, remaining=call.table.max_remaining())
        else:
            k = (spec.num_draft_tokens if spec.mode == "chain" else 1) if spec.drafts_at(b) else 0
        draft_s, counts = self._run_round(call, k, t0)
        if call.planner is not None:
            call.planner.observe(b, k, time.perf_counter() - t0 - (draft_s if k else 0.0), draft_s, counts,
                                 catch_up=not call.drafted_last)
        call.drafted_last = k > 0

    def _run_round(self, call: _Call, k: int, t0: float) -> tuple[float, list[int]]:
        """A round drafting ``k`` chain tokens (or a tree when k > 0 in tree mode; a plain round
        when k = 0). Returns its drafting seconds and the tokens each row emitted."""
        spec, runner = call.spec, call.runner
        drafting = k > 0
        if drafting and spec.mode == "chain" and spec.draft_sampling == "sampled":
            return self._chain_round(call, t0, k)
        if not drafting:
            tree = root_tree(runner.pending)
            if spec.speculative:
                call.timings.plain_rounds += 1
                call.timings.plain_row_rounds += len(call.table)
        elif spec.mode == "chain":
            drafts, _ = self._draft_chain(call, k)
            tree = chain_tree(runner.pending, runner.draft_ids[drafts])
        elif call.shapes is not None:
            tree = draft_sampled_tree(runner, runner.pending, call.shapes.shape, call.sampling.temperature,
                                      call.generator)
            call.timings.draft_forwards += draft_steps(call.shapes.shape)
        else:
            tree = draft_tree(runner, runner.pending, spec.depth, spec.top_k, spec.total_tokens)
            call.timings.draft_forwards += spec.depth
        t1 = time.perf_counter()
        logits, feats = runner.verify_forward(tree.tokens, tree.depths, tree.mask)  # [B, T, V], [B, T, 3H]
        if call.test == "block" and tree.draft_logits is not None and call.sampling.temperature > 0:
            walker = walk_block
        else:
            walker = walk_sampled if fused_walk_usable(tree, call.rule, logits.device) else walk
        res = walker(call.rule, tree, logits, record=self._record(call), **call.verify_kw)
        t2 = time.perf_counter()
        self._tick(call, t1 - t0, t2 - t1)
        host = res.num_emitted.tolist()
        if drafting and call.shapes is not None:
            call.shapes.observe(res.path, host)
        path = None if tree.mask is None or _is_prefix(res.path, host) else res.path
        runner.commit(res.num_emitted, host, res.tokens.clamp(min=0), feats, path)
        self._finish_round(call, res)
        return t1 - t0, host

    def _chain_round(self, call: _Call, t0: float, k: int) -> tuple[float, list[int]]:
        runner = call.runner
        drafts, draft_logits = self._draft_chain(call, k)  # [B, K] draft ids, [B, K, Vd]
        tokens = runner.draft_ids[drafts]  # [B, K]
        t1 = time.perf_counter()
        block = torch.cat([runner.pending[:, None], tokens], dim=1)  # [B, K+1]
        offsets = torch.arange(block.shape[1], device=block.device)[None]
        logits, feats = runner.verify_forward(block, offsets, None)  # [B, K+1, V]
        full_draft = self.head.to_target_logits(draft_logits)  # [B, K, V]
        res = verify_chain(call.rule, logits, full_draft, tokens, test=call.test, **call.verify_kw)
        t2 = time.perf_counter()
        self._tick(call, t1 - t0, t2 - t1)
        counts = res.num_emitted
        if call.debug is not None:
            call.record = [(k, None, logits[:, k], None, full_draft[:, k] if k < tokens.shape[1] else None)
                           for k in range(block.shape[1])]
        host = counts.tolist()
        runner.commit(counts, host, res.tokens.clamp(min=0), feats, None)
        self._finish_round(call, res)
        return t1 - t0, host

    def _draft_chain(self, call: _Call, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft k tokens per row: draft ids ``[B, k]`` and their draft logits ``[B, k, Vd]``."""
        runner = call.runner
        temperature = call.sampling.temperature
        greedy = call.spec.draft_sampling == "greedy" or temperature == 0
        step = runner.draft_root()
        logits, hidden = step.logits, step.hidden  # [B, Vd], [B, H]
        uniforms = None  # [k, B]: drawn at once, the same stream as one draw of B per draft
        if not greedy:
            uniforms = torch.rand(k, logits.shape[0], generator=call.generator, dtype=torch.float64,
                                  device=logits.device)
        fused = runner.draft_chain(logits, hidden, k, temperature, uniforms)  # one C++ call (greedy: no uniforms)
        if fused is not None:  # the same bits as the loop
            call.timings.draft_forwards += k
            return fused
        ids, all_logits = [], [logits]
        for s in range(k):
            ids.append(sample_draft(logits, temperature, greedy, call.generator,
                                    None if uniforms is None else uniforms[s]))
            if s == k - 1:
                break
            seen = torch.ones(len(ids[-1]), 1, s, dtype=torch.bool, device=logits.device) if s else None
            step = runner.draft_step(runner.draft_ids[ids[-1]][:, None], hidden[:, None], s + 1, seen)
            logits, hidden = step.logits[:, 0], step.hidden[:, 0]
            all_logits.append(logits)
        call.timings.draft_forwards += k
        return torch.stack(ids, 1), torch.stack(all_logits, 1)

    def _tick(self, call: _Call, draft_s: float, verify_s: float) -> None:
        t = call.timings
        t.draft_s += draft_s
        t.verify_s += verify_s
        t.target_forwards += 1
        t.rounds += 1
        t.row_rounds += len(call.table)

    def _finish_round(self, call: _Call, res, first: bool = False) -> None:
        """Hand the emitted tokens to the bookkeeping; drop finished rows everywhere."""
        counts = res.num_emitted
        if not first:
            call.timings.emitted += int(counts.sum())
        table = call.table
        before = table.completion_lengths()
        if call.debug is not None:
            self._keep_records(call, counts, res.tokens, before)
        out = RoundOutput(tokens=res.tokens.cpu().numpy(), counts=counts.cpu().numpy(),
                          behaviour_logprobs=res.behaviour_logprobs.cpu().numpy(),
                          target_logprobs=res.target_logprobs.cpu().numpy(),
                          kinds=res.kinds.cpu().numpy(), relaxed=res.relaxed.cpu().numpy())
        done = table.append(out, first=first)
        if any(done):
            rows = fill_from_tail(done)  # (only the rows that move are copied in the caches)
            if rows:
                call.runner.keep(rows)
            table.keep(rows)

    # ------------------------------------------------------------------ debug
    @staticmethod
    def _record(call: _Call) -> list | None:
        if call.debug is None:
            return None
        call.record = []
        return call.record

    @staticmethod
    def _keep_records(call: _Call, counts: torch.Tensor, tokens: torch.Tensor, before: list[int]) -> None:
        """Turn this round's raw records into DebugRecords (one per emitted token)."""
        live = call.table.live
        counts_h = counts.tolist()
        for level, rows, logits, cands, drafts in call.record:  # rows None: every row
            rows = range(len(live)) if rows is None else rows.tolist()
            for i, r in enumerate(rows):
                if level >= counts_h[r]:
                    continue
                call.debug.append(DebugRecord(
                    row=live[r], index=before[r] + level, step_position=level, token=int(tokens[r, level]),
                    target_logits=logits[i].clone(), draft_logits=None if drafts is None else drafts[i].clone(),
                    candidates=None if cands is None else cands[i].clone()))
        call.record = []


def _rows_text(live: list[int]) -> str:
    """The unfinished prompts' indices, as a list (the first 16 of a long one)."""
    return str(live) if len(live) <= 16 else f"[{', '.join(map(str, live[:16]))}, ...]"


def _is_prefix(path: torch.Tensor, counts: list[int]) -> bool:
    """Whether every row's committed nodes (``path [B, W]``, the first ``counts`` entries) are the
    block's first nodes, so that the caches commit a prefix (a tree walk along node order)."""
    if max(counts) <= 1:
        return True
    steps = torch.arange(path.shape[1], device=path.device)
    used = steps[None] < torch.tensor(counts, device=path.device)[:, None]
    return bool(((path == steps) | ~used).all())


def _trim_debug(debug: list[DebugRecord] | None, completions) -> list[DebugRecord] | None:
    """Drop records of tokens cut by stop/length truncation."""
    if debug is None:
        return None
    return [d for d in debug if d.index < completions[d.row].num_tokens]
