"""Running a drift study: generate under every configuration and reduce each batch to numbers.

Vocabulary as in ``trainers.drift.study``. The engine's debug records (the exact logits the
verifier saw, per emitted token) are turned into per-token drift by :func:`token_drift`
right after each batch and dropped, so memory stays bounded by one batch of records
(``batch_size x max_new_tokens`` rows of V floats, twice for sampled chains).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from rollout.chat import chat_ids
from rollout.params import SamplingParams
from trainers.drift.study import DriftConfig, RunSpec, plan_runs
from verifiers import distribution_metrics, induced_candidates, induced_chain, target_probs


# ----------------------------------------------------------------------------- per-token drift
def _pad_candidates(cands: list[torch.Tensor]) -> torch.Tensor:
    m = max((c.numel() for c in cands), default=0)
    out = torch.full((len(cands), m), -1, dtype=torch.long)
    for i, c in enumerate(cands):
        out[i, : c.numel()] = c
    return out


def token_drift(rule, records: list, sampling: SamplingParams, chunk: int = 32) -> dict[str, torch.Tensor]:
    """Per-record drift [N] from ``Engine`` debug records, in record order.

    Keys: tv, kl, entropy_P, entropy_p, uncovered (``verifiers.distribution_metrics``) and
    logP (log P(y) of the emitted token, to check the engine's behaviour log-probs).
    """
    t, tk, tp = sampling.temperature, sampling.top_k, sampling.top_p
    groups: dict[str, list[int]] = {"chain": [], "cand": [], "plain": []}
    for i, r in enumerate(records):
        kind = "chain" if r.draft_logits is not None else "cand" if r.candidates is not None else "plain"
        groups[kind].append(i)
    n = len(records)
    out = {k: torch.zeros(n, dtype=torch.float64) for k in ("tv", "kl", "entropy_P", "entropy_p", "uncovered", "logP")}
    for kind, idx in groups.items():
        for s in range(0, len(idx), chunk):
            part = idx[s:s + chunk]
            logits = torch.stack([records[i].target_logits for i in part]).float()  # [n, V]
            p = target_probs(logits, t, tk, tp)
            if kind == "chain":
                draft = torch.stack([records[i].draft_logits for i in part]).float()  # [n, V]
                P = induced_chain(rule, logits, draft, temperature=t, top_k=tk, top_p=tp)
            elif kind == "cand":
                cands = _pad_candidates([records[i].candidates for i in part])  # [n, m]
                P = induced_candidates(rule, logits, cands, temperature=t, top_k=tk, top_p=tp)
            else:  # no speculation at this position: the rule's fallback with no candidates
                P = induced_candidates(rule, logits, torch.full((len(part), 1), -1), temperature=t, top_k=tk, top_p=tp)
            pi = p if t == 0 or (tk is None and tp is None) else target_probs(logits, t)
            metrics = distribution_metrics(P, p, pi)
            tok = torch.tensor([records[i].token for i in part])
            metrics["logP"] = P.gather(-1, tok[:, None])[:, 0].log()
            where = torch.tensor(part)
            for key, val in metrics.items():
                out[key][where] = val.double()
    return out


# ----------------------------------------------------------------------------- prompts
@dataclass(frozen=True)
class PromptItem:
    ids: list[int]
    answer: str | None  # None for general instructions (no accuracy)
    difficulty: int  # 0 when unknown


def build_prompts(cfg: DriftConfig, tokenizer) -> list[PromptItem]:
    """The prompt set: ``cfg.prompts`` items (tasks: split evenly over the difficulties)."""
    from trainers.tasks.arithmetic import make_problems
    from trainers.tasks.problems import load_jsonl

    if cfg.source == "general":
        from trainers.tasks.general import general_prompts

        return [PromptItem(chat_ids(tokenizer, t), None, 0)
                for t in general_prompts(cfg.prompts, cfg.split, cfg.prompt_seed)]
    if cfg.source == "jsonl":
        problems = load_jsonl(cfg.jsonl_path)[: cfg.prompts]
    else:
        k = len(cfg.difficulties)
        counts = [cfg.prompts // k + (i < cfg.prompts % k) for i in range(k)]
        problems = [p for d, c in zip(cfg.difficulties, counts) if c
                    for p in make_problems(c, d, split=cfg.split, seed=cfg.prompt_seed)]
    return [PromptItem(chat_ids(tokenizer, p.prompt), p.answer, p.difficulty) for p in problems]


# ----------------------------------------------------------------------------- running
@dataclass
class RunData:
    """What one configuration produced, reduced to numbers (no logits are kept).

    tokens: per emitted token (all completions concatenated): tv, kl, entropy_P, entropy_p,
    uncovered, relaxed (0/1), position (index in the completion), logP_err (|log P(y) from
    the closed form - the engine's behaviour log-prob|). Per completion: seq_log_ratio
    (sum log p - log P from the engine's log-probs), reward (None without an answer),
    difficulty, length. timings: summed ``rollout.outputs.Timings`` counters, plus cpu_s, the
    process CPU time of the ``generate`` calls (robust to other jobs on a shared machine).
    """

    spec: RunSpec
    tokens: dict[str, list[torch.Tensor]] = field(default_factory=dict)
    seq_log_ratio: list[float] = field(default_factory=list)
    rewards: list[float | None] = field(default_factory=list)
    difficulties: list[int] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def token_array(self, key: str) -> torch.Tensor:
        parts = self.tokens.get(key, [])
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


TIMING_KEYS = ("total_s", "draft_s", "verify_s", "tokens", "emitted", "row_rounds", "target_forwards", "draft_forwards")


def _add_batch(data: RunData, res, batch: list[PromptItem], rule, sampling: SamplingParams, decode) -> None:
    """Reduce one ``generate`` result to numbers and append them to ``data``."""
    from trainers.tasks.rewards import exact_match_reward

    comps = res.completions
    records = res.debug or []
    if len(records) != sum(c.num_tokens for c in comps):
        raise RuntimeError(f"{data.spec.key}: {len(records)} debug records for "
                           f"{sum(c.num_tokens for c in comps)} emitted tokens")
    drift = token_drift(rule, records, sampling)
    behaviour = torch.tensor([comps[r.row].behaviour_logprobs[r.index] for r in records], dtype=torch.float64)
    extra = {
        "relaxed": torch.tensor([float(comps[r.row].relaxed[r.index]) for r in records], dtype=torch.float64),
        "position": torch.tensor([float(r.index) for r in records], dtype=torch.float64),
        "logP_err": (drift.pop("logP") - behaviour).abs(),
    }
    for key, val in {**drift, **extra}.items():
        data.tokens.setdefault(key, []).append(val)
    for item, c in zip(batch, comps):
        data.seq_log_ratio.append(float(sum(c.target_logprobs) - sum(c.behaviour_logprobs)))
        text = decode(c.completion_ids)
        data.rewards.append(None if item.answer is None else exact_match_reward(text, item.answer))
        data.difficulties.append(item.difficulty)
        data.lengths.append(c.num_tokens)
    t = res.timings
    for key in TIMING_KEYS:
        data.timings[key] = data.timings.get(key, 0.0) + float(getattr(t, key))


def run_batch(engine, data: RunData, batch: list[PromptItem], index: int, cfg: DriftConfig, tokenizer) -> None:
    """Generate batch number ``index`` under ``data.spec`` (seed ``cfg.seed + index``) and reduce it."""
    spec = data.spec
    sampling = cfg.sampling(getattr(tokenizer, "eos_token_id", None))
    cpu0 = time.process_time()
    res = engine.generate([it.ids for it in batch], sampling, cfg.spec(spec.mode), spec.verifier,
                          seed=cfg.seed + index, debug=True)
    data.timings["cpu_s"] = data.timings.get("cpu_s", 0.0) + time.process_time() - cpu0
    _add_batch(data, res, batch, spec.verifier.rule(), sampling,
               lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    # the records (full-vocabulary logits) are dropped with ``res`` here


def run_all(cfg: DriftConfig, target, head, tokenizer, *, progress: bool = True) -> list[RunData]:
    """Run every configuration of :func:`plan_runs` on the prompt set (tqdm bar when ``progress``).

    Batches are the outer loop and configurations the inner one, so that a load change on a
    shared machine slows every configuration alike (the speed comparisons stay fair).
    """
    from tqdm import tqdm

    from rollout.engine.engine import Engine

    items = build_prompts(cfg, tokenizer)
    runs = [RunData(spec) for spec in plan_runs(cfg)]
    if head is None and any(r.spec.mode != "off" for r in runs):
        raise ValueError("speculative modes need a draft head")
    engine = Engine(target, head, num_threads=cfg.num_threads)
    starts = range(0, len(items), cfg.batch_size)
    with tqdm(total=len(runs) * len(starts), unit="batch", disable=not progress, dynamic_ncols=True) as bar:
        for b, start in enumerate(starts):
            for data in runs:
                bar.set_postfix_str(f"batch {b + 1}/{len(starts)} {data.spec.key}")
                run_batch(engine, data, items[start:start + cfg.batch_size], b, cfg, tokenizer)
                bar.update(1)
    return runs


def load_models(cfg: DriftConfig):
    """(target, head, tokenizer) as named by ``cfg.target`` and ``cfg.head``."""
    from rollout.eagle3 import Eagle3Config, Eagle3Head, default_head_path, load_eagle3
    from rollout.models import TargetConfig, load_embedded_target, load_target

    target, tok = load_embedded_target() if cfg.target is None else load_target(TargetConfig(path=cfg.target))
    if tok is None:
        raise ValueError(f"target {cfg.target} has no tokenizer")
    if cfg.head == "random":
        with torch.random.fork_rng():
            torch.manual_seed(cfg.seed)
            head = Eagle3Head(Eagle3Config.for_target(target), target.embed_tokens).eval()
            with torch.no_grad():  # share the target's output embedding: drafts that sometimes agree
                head.lm_head.weight.copy_(target.model.get_output_embeddings().weight)
        return target, head, tok
    path = default_head_path() if cfg.head == "default" else cfg.head
    if cfg.head == "default" and not path.exists():
        raise FileNotFoundError(f"the shipped head {path} does not exist yet: pass --head PATH or --head random")
    return target, load_eagle3(path, target), tok
