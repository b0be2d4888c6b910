"""Measure a draft head's acceptance length tau on the engine (``rollout.engine.engine``).

    python -m scripts.measure_acceptance [--head rollout/heads/smollm2-135m-eagle3] [--n-arith 16] [--n-general 8]
        [--tree "s6,3,10;6,2,10"] [--temperatures 1,0]

tau = tokens emitted per row per verifying target forward (accepted drafts + the recovered
or bonus token; the engine's ``Timings.tau``: ``emitted / row_rounds``, reported as
``emitted`` and ``forwards``, with its standard error ``tau_se`` over the ``rows``: compare two
heads by it, as a few percent of tau is within one run's noise at small prompt counts),
chain of K drafts, lossless verification (``--verifier``: another rule). Modes: sampled drafts
at T = 1 (x ~ q) and greedy drafts at T = 0 (``--temperatures``: which of them, or other
temperatures; drafts are greedy at T = 0 and sampled above). A set of 0 prompts
(``--n-general 0``) is left out of the report. The same engine runs the trivial
drafter (repeat the last token, q one-hot) for comparison, and the script times one draft
step against one target decoding step at batch 1 (``rollout.engine.timing``).

``--tree`` adds trees on the same prompts (``depth,top_k,total_tokens``; an ``s`` in front
drafts sampled candidates, ``rollout.engine.sampled_tree``, measured at the temperatures above 0 only;
top-k trees at every one), on the same prompts and seeds as the chain (``--seeds N``: N calls per set
and mode, seeds ``--seed`` onwards, counters summed): their tau next to the chain's.
``--verifier`` verifies every chain and tree with another rule (``name`` or
``name:key=value,...``, e.g. ``overshoot:lenience=0.5``, or ``mars:theta=0.9,test=law`` for the
law's test on sampled chains, ``VerifierConfig.test``; default lossless); the trivial drafter
stays lossless. ``--drafter-weights int8`` rounds the head to int8 weights first (the hf backend's
``drafter_weights: int8``, ``rollout.kernels.quantize``): its tau next to the stored head's in another run.

``--policy runs/NAME/checkpoints/step_N`` measures on a training checkpoint's policy instead of
the embedded model as shipped, and ``--baseline-head DIR`` measures a second head on the same
prompts and seeds (``<set>/T=<t>/baseline``; its drafts use the same calls' seeds, so the two
heads' tau differ by the heads and by where their completions part): e.g. the head trained with
the policy (``drafter_training``, the checkpoint's ``drafter/`` folder) against the shipped one,
on that policy::

    python -m scripts.measure_acceptance --policy runs/grpo_drafter/checkpoints/step_000020 \
        --head runs/grpo_drafter/checkpoints/step_000020/drafter --baseline-head rollout/heads/smollm2-135m-eagle3
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from rollout.chat import chat_ids
from rollout.config import ConfigError
from rollout.eagle3 import DraftOutput, default_head_path, load_eagle3
from rollout.engine.engine import Engine
from rollout.engine.timing import step_costs
from rollout.kernels.quantize import DRAFTER_WEIGHTS, quantize_int8_
from rollout.models import load_embedded_target
from rollout.outputs import GenerationResult, tau_with_error
from rollout.params import SamplingParams, SpecConfig, VerifierConfig, check_test, tree_spec
from scripts.cli import checkpoint_folder, head_folder
from trainers.drift.study import parse_verifier
from trainers.grpo.checkpoint import read_policy
from trainers.tasks.general import heldout_prompts


class RepeatLastDraft(nn.Module):
    """The trivial drafter as a draft head: every draft step proposes the token it was given
    (q one-hot), so a round drafts the pending token K times."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.cfg = SimpleNamespace(vocab_size=vocab_size, draft_vocab_size=vocab_size, num_key_value_heads=1,
                                   head_dim=1)
        self.fc = nn.Linear(1, 1)  # the runner sizes the draft cache with this dtype
        self.register_buffer("target_ids", torch.arange(vocab_size))

    def forward(self, token_ids, hidden, position_ids, attn_mask, past=None, *, compute_logits=True) -> DraftOutput:
        b, t = token_ids.shape
        out = token_ids.float()[..., None]  # the "hidden" state carries the token it proposes
        kv = torch.zeros(b, 1, (0 if past is None else past[0].shape[2]) + t, 1, device=token_ids.device)
        return DraftOutput(self.draft_logits(out) if compute_logits else None, out, (kv, kv))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """One-hot logits (0 at the carried token, -inf elsewhere) of output states ``[..., 1]``."""
        logits = torch.full((*hidden.shape[:-1], self.cfg.vocab_size), float("-inf"), device=hidden.device)
        return logits.scatter_(-1, hidden.long(), 0.0)

    def to_target_logits(self, draft_logits: torch.Tensor) -> torch.Tensor:
        return draft_logits


def held_out_prompts(tok, n_arith: int, n_general: int, seed: int = 1234) -> dict[str, list[list[int]]]:
    """The held-out sets by kind, as token ids; a kind with no prompts is left out."""
    texts, kinds = heldout_prompts(n_arith, (1, 2, 3, 4), seed, n_general)
    sets = {kind: [chat_ids(tok, t) for t, k in zip(texts, kinds) if k == kind] for kind in ("arithmetic", "general")}
    return {kind: prompts for kind, prompts in sets.items() if prompts}


def parse_temperatures(text: str) -> tuple[float, ...]:
    """``--temperatures``: a comma list of temperatures >= 0 (e.g. ``1,0``)."""
    try:
        temps = tuple(float(t) for t in text.split(",") if t.strip())
    except ValueError:
        temps = ()
    if not temps or any(not t >= 0 or t == float("inf") for t in temps):
        raise ValueError(f"a comma list of finite temperatures >= 0, e.g. 1,0; got {text!r}")
    return temps


def measure(target, head, prompts: list[list[int]], *, k: int, temperature: float, max_new_tokens: int,
            seed: int, spec: SpecConfig | None = None, verifier: VerifierConfig | None = None) -> GenerationResult:
    """One engine call on ``prompts`` (head None: the trivial drafter): its completions (each row's
    ``step_emitted``) and counters (``timings``); ``spec`` None: the chain of ``k`` drafts;
    ``verifier`` None: lossless."""
    eos = target.config.eos_token_id
    eos = int(eos[0] if isinstance(eos, list) else eos)
    engine = Engine(target, head if head is not None else RepeatLastDraft(target.vocab_size),
                    num_threads=torch.get_num_threads())
    if spec is None:
        spec = SpecConfig(mode="chain", num_draft_tokens=k, draft_sampling="sampled" if temperature > 0 else "greedy")
    sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=(eos,))
    return engine.generate(prompts, sampling, spec, verifier if head is not None else None, seed=seed)


def measure_seeds(target, head, prompts: list[list[int]], seeds: range, **kw) -> dict:
    """The report entry of one prompt set and mode: the engine's counters of :func:`measure`
    summed over one call per seed in ``seeds`` (``kw``: its other arguments), their tau, and
    tau's standard error with each row of each call as one unit (``tau_se``,
    :func:`rollout.outputs.tau_with_error`; ``rows`` of them)."""
    t0, emitted, rounds, rows = time.time(), 0, 0, []
    for seed in seeds:
        result = measure(target, head, prompts, seed=seed, **kw)
        emitted, rounds = emitted + result.timings.emitted, rounds + result.timings.row_rounds
        rows += [c.step_emitted for c in result.completions]
    _, se = tau_with_error(rows)
    return {"tau": round(emitted / rounds, 3), "tau_se": round(se, 3), "rows": len(rows), "emitted": emitted,
            "forwards": rounds, "seconds": round(time.time() - t0, 1)}


def measure_trees(target, head, sets: dict[str, list[list[int]]], trees: str, *, max_new_tokens: int,
                  seed: int, seeds: int, verifier: VerifierConfig | None = None,
                  temperatures: tuple[float, ...] = (1.0, 0.0)) -> dict:
    """tau of each ``--tree`` config on each prompt set (summed over ``seeds`` calls from ``seed``)
    at each of ``temperatures`` (sampled trees at those above 0 only)."""
    report = {}
    for text in (t for t in trees.split(";") if t.strip()):
        spec = tree_spec(text)
        temps = [t for t in temperatures if t > 0 or not spec.sampled_tree]
        for kind, prompts in sets.items():
            for temperature in temps:
                key = f"{kind}/T={temperature:g}/tree {text.strip()}"
                report[key] = measure_seeds(target, head, prompts, range(seed, seed + seeds), k=0,
                                            temperature=temperature, max_new_tokens=max_new_tokens, spec=spec,
                                            verifier=verifier)
                print(key, report[key], flush=True)
    return report


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=str(default_head_path()), type=head_folder)
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--n-arith", type=int, default=16, help="held-out arithmetic prompts (difficulties 1-4)")
    ap.add_argument("--n-general", type=int, default=8, help="held-out general instructions (0: none)")
    ap.add_argument("--temperatures", default="1,0",
                    help="sampling temperatures to measure chains at (comma list; drafts greedy at 0, sampled above)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-trivial", action="store_true", help="skip the repeat-last-token baseline")
    ap.add_argument("--tree", default="", help="trees to measure too (';' list of depth,top_k,total_tokens; "
                    "'s' in front: sampled candidates)")
    ap.add_argument("--seeds", type=int, default=1,
                    help="calls per set and mode (seeds --seed onwards), counters summed")
    ap.add_argument("--verifier", default="lossless",
                    help="the rule chains and trees are verified with: name or name:key=value,... "
                         "(test=law: rejection towards the rule's law on sampled chains)")
    ap.add_argument("--drafter-weights", default="stored", choices=DRAFTER_WEIGHTS,
                    help="int8: round the head's linear layers to int8 weights first (rollout.kernels.quantize)")
    ap.add_argument("--policy", default=None, type=checkpoint_folder, metavar="CHECKPOINT",
                    help="measure on a training checkpoint's policy (runs/NAME/checkpoints/step_N; default: the "
                         "embedded model as shipped)")
    ap.add_argument("--baseline-head", default=None, type=head_folder, metavar="DIR",
                    help="a second head measured on the same prompts and seeds (reported as 'baseline')")
    args = ap.parse_args(argv)
    for flag, value, least in (("--n-arith", args.n_arith, 0), ("--n-general", args.n_general, 0), ("--k", args.k, 1),
                               ("--seeds", args.seeds, 1), ("--max-new-tokens", args.max_new_tokens, 1)):
        if value < least:
            ap.error(f"{flag}: must be at least {least}, got {value}")
    if args.n_arith + args.n_general == 0:
        ap.error("--n-arith and --n-general are both 0: no prompts to measure")
    try:
        temperatures = parse_temperatures(args.temperatures)
    except ValueError as err:
        ap.error(f"--temperatures: {err}")
    try:
        [tree_spec(t) for t in args.tree.split(";") if t.strip()]
    except (ValueError, ConfigError) as err:
        ap.error(f"--tree: {err}")
    try:
        verifier = parse_verifier(args.verifier)
        for text in (t for t in args.tree.split(";") if t.strip()):
            check_test(tree_spec(text), verifier)
    except (ValueError, ConfigError) as err:
        ap.error(f"--verifier: {err}")
    target, tok = load_embedded_target()
    if args.policy:
        target.model.load_state_dict(read_policy(Path(args.policy))[0])
    heads = {"eagle3": load_eagle3(args.head, target)}
    if args.baseline_head:
        heads["baseline"] = load_eagle3(args.baseline_head, target)
    if args.drafter_weights == "int8":
        for h in heads.values():
            quantize_int8_(h)
    head = heads["eagle3"]
    sets = held_out_prompts(tok, args.n_arith, args.n_general)
    report: dict[str, object] = {"k": args.k, "head": args.head, "verifier": args.verifier,
                                 "drafter_weights": args.drafter_weights, "policy": args.policy,
                                 "baseline_head": args.baseline_head}
    for kind, prompts in sets.items():
        for temperature in temperatures:
            for name, h in (*heads.items(), ("trivial", None)):
                if name == "trivial" and args.no_trivial:
                    continue
                key = f"{kind}/T={temperature:g}/{name}"
                report[key] = measure_seeds(target, h, prompts, range(args.seed, args.seed + args.seeds), k=args.k,
                                            temperature=temperature, max_new_tokens=args.max_new_tokens,
                                            verifier=verifier)
                print(key, report[key], flush=True)
            if "baseline" in heads:
                a, b = report[f"{kind}/T={temperature:g}/eagle3"], report[f"{kind}/T={temperature:g}/baseline"]
                print(f"{kind}/T={temperature:g}: head tau {a['tau']:.3f} +- {a['tau_se']:.3f} against the baseline's "
                      f"{b['tau']:.3f} +- {b['tau_se']:.3f} ({a['tau'] / b['tau'] - 1:+.1%})", flush=True)
    if args.tree:
        report.update(measure_trees(target, head, sets, args.tree, max_new_tokens=args.max_new_tokens,
                                    seed=args.seed, seeds=args.seeds, verifier=verifier, temperatures=temperatures))
    first = next(iter(sets.values()))[:1]  # the step costs on one held-out prompt
    costs = step_costs(Engine(target, head, num_threads=torch.get_num_threads()), first, [1], 20)
    report["step_costs"] = {"draft_step_s": costs["draft"], "target_step_s": costs[1],
                            "ratio": costs["draft"] / costs[1]}
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
