"""Measure a draft head's acceptance length tau with a simple batch-1 chain loop.

    python -m scripts.measure_acceptance [--head rollout/heads/smollm2-135m-eagle3] [--n-arith 16] [--n-general 8]

tau = tokens emitted per verifying target forward (accepted drafts + the recovered or
bonus token), chain of K drafts, lossless verification (``verifiers.verify_chain``).
Modes: sampled drafts at T = 1 (x ~ q) and greedy drafts at T = 0. The same loop runs
the trivial drafter (repeat the last token, q one-hot) for comparison, and the script
times one draft step against one target decoding step at batch 1.

Loop (positions as in ``trainers/ttt.py``): the draft's step-0 input at position i is
(features of token i, token i + 1). After the target prefill samples token P, the draft
holds step-0 entries for positions 0..P-1 and drafts x_1..x_K; the target verifies
[t_P, x_1..x_K] in one forward; both caches are cropped to the accepted path and the
draft gets step-0 entries for the newly committed positions from the verify features.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from rollout.eagle3 import Eagle3Head, causal_mask, default_head_path, load_eagle3
from rollout.models import TargetModel, load_embedded_target
from verifiers import get_rule, verify_chain


@dataclass
class ChainStats:
    emitted: int = 0  # tokens emitted by verifying forwards
    forwards: int = 0  # verifying target forwards
    draft_seconds: float = 0.0
    draft_steps: int = 0
    texts: list[str] = field(default_factory=list)

    @property
    def tau(self) -> float:
        return self.emitted / max(1, self.forwards)


def _pick(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """logits [1, V] -> token [1] (argmax at T = 0, else a sample at T)."""
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen).squeeze(1)


class _Draft:
    """The EAGLE-3 head's side of the loop: its KV cache and the logits for the next draft."""

    def __init__(self, head: Eagle3Head):
        self.head, self.kv, self.last_logits, self.last_hidden = head, None, None, None

    def extend(self, feats: torch.Tensor, next_tokens: torch.Tensor, start: int) -> None:
        """Step-0 entries for positions start.. (features [1, n, 3H], tokens [1, n] = the successors)."""
        n = next_tokens.shape[1]
        past = 0 if self.kv is None else self.kv[0].shape[2]
        out = self.head(next_tokens, feats, torch.arange(start, start + n)[None], causal_mask(1, n, past), past=self.kv)
        self.kv, self.last_logits, self.last_hidden = out.kv, out.logits[:, -1], out.hidden[:, -1:]

    def propose(self, k: int, temperature: float, gen: torch.Generator, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft k tokens from position ``pos`` on; returns tokens [1, k], logits over the target vocab [1, k, V]."""
        base = self.kv[0].shape[2]
        kv, hidden, logits = self.kv, self.last_hidden, self.last_logits
        toks, full = [], []
        for j in range(k):
            lt = self.head.to_target_logits(logits)  # [1, V]
            x = _pick(lt, temperature, gen)
            toks.append(x)
            full.append(lt)
            if j + 1 < k:
                out = self.head(x[:, None], hidden, torch.tensor([[pos + j + 1]]),
                                torch.ones(1, 1, kv[0].shape[2] + 1, dtype=torch.bool), past=kv)
                kv, hidden, logits = out.kv, out.hidden, out.logits[:, -1]
        self.kv = (self.kv[0][:, :, :base], self.kv[1][:, :, :base])  # drop speculative entries
        return torch.stack(toks, 1), torch.stack(full, 1)


@torch.no_grad()
def chain_generate(target: TargetModel, head: Eagle3Head | None, prompt: list[int], *, k: int, temperature: float,
                   max_new_tokens: int, eos_id: int, gen: torch.Generator, stats: ChainStats) -> list[int]:
    """Generate one response with chain speculation (head None: repeat-last-token drafts)."""
    rule = get_rule("lossless")
    ids = torch.tensor([prompt])
    cache = DynamicCache(config=target.config)
    out = target(ids, cache=cache)
    y = _pick(out.logits[:, -1], temperature, gen)  # t_P
    draft = _Draft(head) if head is not None else None
    n_pos = len(prompt)
    if draft is not None:
        draft.extend(out.features, torch.cat([ids[:, 1:], y[:, None]], 1), 0)
    emitted = [int(y)]
    v = target.vocab_size
    while emitted[-1] != eos_id and len(emitted) < max_new_tokens:
        t0 = time.perf_counter()
        if draft is not None:
            x, dl = draft.propose(k, temperature, gen, n_pos - 1)
            stats.draft_steps += k
        else:  # trivial drafter: repeat the last token, q one-hot
            x = y.repeat(1, k)
            dl = torch.full((1, k, v), float("-inf"))
            dl[0, :, int(y)] = 0.0
        stats.draft_seconds += time.perf_counter() - t0
        ver = target(torch.cat([y[:, None], x], 1), cache=cache)  # positions n_pos..n_pos+k
        res = verify_chain(rule, ver.logits, dl, x, temperature=temperature, generator=gen)
        n = int(res.num_emitted[0])
        new = res.tokens[0, :n]
        cache.crop(-(k + 1 - n))  # keep t_P and the accepted drafts (a negative count removes)
        if draft is not None:
            draft.extend(ver.features[:, :n], new[None], n_pos)
        stats.emitted += new.tolist().index(eos_id) + 1 if eos_id in new.tolist() else n  # nothing after EOS
        stats.forwards += 1
        emitted += new.tolist()
        n_pos += n
        y = new[-1:]
    if eos_id in emitted:
        emitted = emitted[: emitted.index(eos_id) + 1]
    return emitted[:max_new_tokens]


@torch.no_grad()
def step_costs(target: TargetModel, head: Eagle3Head, prompt: list[int], reps: int = 20) -> dict[str, float]:
    """Median seconds of one draft step and one target decoding step (1 token) at batch 1."""
    cache = DynamicCache(config=target.config)
    out = target(torch.tensor([prompt]), cache=cache)
    draft = _Draft(head)
    draft.extend(out.features, torch.tensor([prompt[1:] + [0]]), 0)
    n = len(prompt)
    t_draft, t_target = [], []
    for r in range(reps):
        t0 = time.perf_counter()
        head(torch.tensor([[5]]), draft.last_hidden, torch.tensor([[n]]), torch.ones(1, 1, n + 1, dtype=torch.bool),
             past=draft.kv)
        t_draft.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        target(torch.tensor([[5]]), cache=cache)
        t_target.append(time.perf_counter() - t0)
        cache.crop(-1)
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"draft_step_s": med(t_draft), "target_step_s": med(t_target), "ratio": med(t_draft) / med(t_target)}


def held_out_prompts(tok, n_arith: int, n_general: int, seed: int = 1234) -> dict[str, list[list[int]]]:
    from scripts.train_drafter import chat_ids
    from trainers.drafter_prompts import general_prompts
    from trainers.tasks.arithmetic import make_problems

    per = -(-n_arith // 4)
    arith = [p.prompt for d in (1, 2, 3, 4) for p in make_problems(per, d, "heldout", seed)][:n_arith]
    general = general_prompts(n_general, "heldout", seed)
    return {"arithmetic": [chat_ids(tok, t) for t in arith], "general": [chat_ids(tok, t) for t in general]}


def measure(target, head, prompts: list[list[int]], *, k: int, temperature: float, max_new_tokens: int,
            seed: int) -> ChainStats:
    stats = ChainStats()
    gen = torch.Generator().manual_seed(seed)
    eos = int(target.config.eos_token_id if not isinstance(target.config.eos_token_id, list)
              else target.config.eos_token_id[0])
    for p in prompts:
        chain_generate(target, head, p, k=k, temperature=temperature, max_new_tokens=max_new_tokens, eos_id=eos,
                       gen=gen, stats=stats)
    return stats


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--head", default=str(default_head_path()))
    ap.add_argument("--k", type=int, default=7)
    ap.add_argument("--n-arith", type=int, default=16)
    ap.add_argument("--n-general", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-trivial", action="store_true", help="skip the repeat-last-token baseline")
    args = ap.parse_args(argv)
    target, tok = load_embedded_target()
    head = load_eagle3(args.head, target)
    sets = held_out_prompts(tok, args.n_arith, args.n_general)
    report: dict[str, object] = {"k": args.k, "head": args.head}
    for kind, prompts in sets.items():
        for temperature in (1.0, 0.0):
            for name, h in (("eagle3", head), ("trivial", None)):
                if name == "trivial" and args.no_trivial:
                    continue
                t0 = time.time()
                s = measure(target, h, prompts, k=args.k, temperature=temperature,
                            max_new_tokens=args.max_new_tokens, seed=args.seed)
                key = f"{kind}/T={temperature:g}/{name}"
                report[key] = {"tau": round(s.tau, 3), "emitted": s.emitted, "forwards": s.forwards,
                               "seconds": round(time.time() - t0, 1)}
                print(key, report[key], flush=True)
    report["step_costs"] = step_costs(target, head, sets["arithmetic"][0])
    print(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
