"""Drafter training data: the target's own responses, with its features captured on the fly.

Vocabulary:
- **sample**: one chat-formatted prompt plus the response the target generated for it
  (sampled at T = 1, or greedy for a configured fraction of prompts), ending in EOS or cut
  at ``max_new_tokens``.
- **record** of a sample, per position k of prompt + response (length L):
  ``tokens[k]``; ``features[k]`` ``[3H]`` (inputs of the aux layers for token k);
  ``final[k]`` ``[H]`` the final-norm output, so the target logits at k are
  ``final[k] @ embed.T`` (tied embeddings); ``argmax[k]`` and ``lse[k]`` (log-sum-exp)
  of those logits. The last position has no successor: its features are zero.
- **dataset**: records concatenated flat (``offsets`` delimit samples), fp16 for the
  wide tensors. ``rollout.engine.engine`` generates them with feature capture on (plain
  decoding), so no second target pass is needed.
- **lossable** position k: ``argmax/final[k]`` predicts a response token, i.e.
  ``prompt_len - 1 <= k <= L - 2``.

Randomness: one seeded CPU ``torch.Generator`` drives the greedy/sampled draw per sample
and draws one engine seed per batch (the engine samples on the target's device with a
generator seeded from it), so generation is seeded on any device.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from rollout.config import ConfigError, check_int, check_number
from rollout.engine.engine import Engine
from rollout.models import TargetModel
from rollout.outputs import Capture
from rollout.params import SamplingParams


@dataclass(frozen=True)
class DrafterDataConfig:
    """Which prompts to answer and how.

    arithmetic_per_difficulty: train problems per difficulty from ``trainers.tasks``;
    difficulties: which difficulty levels; general_prompts: general instructions
    (``trainers.tasks.general``); heldout_arithmetic / heldout_general: held-out prompts
    per kind (held-out arithmetic is spread over ``difficulties``); max_new_tokens:
    response cap; greedy_fraction: share of samples answered greedily (the rest at T = 1);
    samples_per_prompt: how many times each *train* prompt is answered (independent
    samples; the prompt list is repeated, so the data can grow past the distinct prompts
    the generators make; held-out prompts are answered once); batch_size: generation batch;
    seed: prompt and sampling seed; cache_dir: where the generated dataset is stored
    (None: ``$HONEST_ROLLOUTS_CACHE`` or ``~/.cache/honest-rollouts`` + ``/drafter-data``);
    prompts_file: a JSONL file of prompts or conversations (``trainers/drafter/prompts.py``)
    answered instead of the built-in arithmetic and general prompts (whose count fields are then
    unused); heldout_fraction: the share of its records held out (at least one when > 0; 0 holds
    none out: no held-out report, no draft-temperature calibration).
    """

    arithmetic_per_difficulty: int = 100
    difficulties: tuple[int, ...] = (1, 2, 3, 4)
    general_prompts: int = 80
    heldout_arithmetic: int = 32
    heldout_general: int = 16
    max_new_tokens: int = 128
    greedy_fraction: float = 0.25
    samples_per_prompt: int = 1
    batch_size: int = 32
    seed: int = 0
    cache_dir: str | None = None
    prompts_file: str | None = None
    heldout_fraction: float = 0.1

    def __post_init__(self) -> None:
        object.__setattr__(self, "difficulties", tuple(self.difficulties))
        for name in ("arithmetic_per_difficulty", "general_prompts", "heldout_arithmetic", "heldout_general"):
            check_int(name, getattr(self, name), 0)
        if not self.difficulties or not set(self.difficulties) <= {1, 2, 3, 4}:
            raise ConfigError("difficulties", f"bad levels {self.difficulties}", allowed=(1, 2, 3, 4))
        check_int("max_new_tokens", self.max_new_tokens, 2)
        check_number("greedy_fraction", self.greedy_fraction, 0, 1)
        for name in ("batch_size", "samples_per_prompt"):
            check_int(name, getattr(self, name))
        if self.prompts_file is not None and not (isinstance(self.prompts_file, str)
                                                  and Path(self.prompts_file).expanduser().is_file()):
            raise ConfigError("prompts_file", f"not a file: {self.prompts_file!r} (a JSONL file of prompts, or null)")
        check_number("heldout_fraction", self.heldout_fraction, 0, 1, high_open=True)


@dataclass
class DrafterData:
    """Flat records of many samples; sample i spans ``offsets[i]:offsets[i+1]``."""

    tokens: torch.Tensor  # [N] int64
    features: torch.Tensor  # [N, 3H] fp16
    final: torch.Tensor  # [N, H] fp16
    argmax: torch.Tensor  # [N] int64 (-1 at the last position of a sample)
    lse: torch.Tensor  # [N] float32
    offsets: torch.Tensor  # [S + 1] int64
    prompt_lens: torch.Tensor  # [S] int64
    kinds: list[str]  # [S] "arithmetic" | "general"

    def __len__(self) -> int:
        return len(self.prompt_lens)

    def response_tokens(self) -> torch.Tensor:
        """All response tokens (the loss-masked targets), concatenated."""
        parts = [self.tokens[int(self.offsets[i]) + int(self.prompt_lens[i]): int(self.offsets[i + 1])]
                 for i in range(len(self))]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        torch.save(self.__dict__, tmp)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> DrafterData:
        from trainers.grpo.checkpoint import load_state

        fields = tuple(cls.__dataclass_fields__)
        return cls(**load_state(path, required=fields, advice="delete it to generate the data again"))

    @classmethod
    def concat(cls, parts: list[DrafterData]) -> DrafterData:
        sizes = torch.tensor([0] + [int(p.offsets[-1]) for p in parts]).cumsum(0)
        offsets = torch.cat([parts[0].offsets[:1]] + [p.offsets[1:] + sizes[i] for i, p in enumerate(parts)])
        return cls(
            tokens=torch.cat([p.tokens for p in parts]), features=torch.cat([p.features for p in parts]),
            final=torch.cat([p.final for p in parts]), argmax=torch.cat([p.argmax for p in parts]),
            lse=torch.cat([p.lse for p in parts]), offsets=offsets,
            prompt_lens=torch.cat([p.prompt_lens for p in parts]), kinds=[k for p in parts for k in p.kinds],
        )


@torch.no_grad()
def generate_batch(
    target: TargetModel, prompts: list[list[int]], greedy: list[bool], *, max_new_tokens: int,
    eos_id: int | tuple[int, ...],
    gen: torch.Generator,
) -> list[dict[str, torch.Tensor]]:
    """Answer a batch of tokenised prompts with ``rollout.engine.engine`` (plain decoding, feature
    capture on); return one record dict per prompt (see module doc). Greedy rows run at
    T = 0, the others at T = 1 with one seed drawn from ``gen`` (a generator on any device)."""
    engine = Engine(target, num_threads=torch.get_num_threads())
    seed = int(torch.randint(0, 2**62, (1,), generator=gen))
    recs: list[dict[str, torch.Tensor]] = [{} for _ in prompts]
    for temperature in (1.0, 0.0):
        rows = [r for r, g in enumerate(greedy) if g == (temperature == 0.0)]
        if not rows:
            continue
        sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, stop_token_ids=_ids(eos_id))
        res = engine.generate([prompts[r] for r in rows], sampling, seed=seed, capture=True)
        for r, done, cap in zip(rows, res.completions, res.captures):
            recs[r] = _record(target, done.prompt_ids + done.completion_ids, cap)
    return recs


def _record(target: TargetModel, tokens: list[int], cap: Capture) -> dict[str, torch.Tensor]:
    """A sample's record from its tokens and the engine's capture; the logits at each position
    are ``lm_head(final)`` through the family's logit rule (``TargetModel.logits``)."""
    assert len(cap.features) == len(tokens) - 1, (len(cap.features), len(tokens))
    logits = target.logits(cap.final)  # [L-1, V]
    return make_record(tokens, cap.features, cap.final, logits)


def make_record(tokens: list[int], features: torch.Tensor, final: torch.Tensor,
                logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """One sample's record: the features and final-norm outputs of positions 0..n-2 (n tokens),
    the argmax and logsumexp of ``logits``, which are the target's at the last ``len(logits)`` of
    those positions (all of them, or a suffix such as a completion's); argmax -1 and lse 0 at the
    positions before, and at position n - 1, which has no successor, zeros throughout."""
    n, m = len(tokens), len(logits)
    assert len(features) == len(final) == n - 1 and m <= n - 1, (len(features), len(final), m, n)
    argmax = torch.full((n,), -1, dtype=torch.long)
    lse = torch.zeros(n)
    argmax[n - 1 - m: n - 1] = logits.argmax(-1).cpu()
    lse[n - 1 - m: n - 1] = torch.logsumexp(logits.float(), -1).cpu()
    z = lambda x: torch.cat([x, torch.zeros_like(x[:1])])  # noqa: E731
    return {"tokens": torch.tensor(tokens, dtype=torch.long), "features": z(features).half().cpu(),
            "final": z(final).half().cpu(), "argmax": argmax, "lse": lse}


def records_to_data(records: list[dict[str, torch.Tensor]], prompt_lens: list[int], kinds: list[str]) -> DrafterData:
    lens = torch.tensor([len(r["tokens"]) for r in records])
    return DrafterData(
        tokens=torch.cat([r["tokens"] for r in records]).long(),
        features=torch.cat([r["features"] for r in records]), final=torch.cat([r["final"] for r in records]),
        argmax=torch.cat([r["argmax"] for r in records]).long(), lse=torch.cat([r["lse"] for r in records]),
        offsets=torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]),
        prompt_lens=torch.tensor(prompt_lens, dtype=torch.long), kinds=list(kinds),
    )


def generate_dataset(
    target: TargetModel, prompts: list[list[int]], kinds: list[str], *, max_new_tokens: int, batch_size: int,
    greedy_fraction: float, gen: torch.Generator, desc: str = "generate", samples_per_prompt: int = 1,
    eos_ids: tuple[int, ...] | None = None,
) -> DrafterData:
    """Answer every prompt ``samples_per_prompt`` times (batched by similar length) and collect
    the records in order: the whole prompt list, then again for each further sample (each
    sample draws its own greedy/sampled choice and its own tokens)."""
    assert len(prompts) == len(kinds) and prompts, "need at least one prompt and one kind per prompt"
    assert samples_per_prompt >= 1, samples_per_prompt
    prompts, kinds = list(prompts) * samples_per_prompt, list(kinds) * samples_per_prompt
    greedy = (torch.rand(len(prompts), generator=gen) < greedy_fraction).tolist()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    records: dict[int, dict[str, torch.Tensor]] = {}
    bar = tqdm(total=len(prompts), desc=desc, unit="prompt")
    for start in range(0, len(order), batch_size):
        idx = order[start: start + batch_size]
        out = generate_batch(target, [prompts[i] for i in idx], [greedy[i] for i in idx],
                             max_new_tokens=max_new_tokens, eos_id=eos_ids or stop_ids(target), gen=gen)
        records.update(zip(idx, out))
        bar.update(len(idx))
        bar.set_postfix(tokens=sum(len(r["tokens"]) for r in records.values()))
    bar.close()
    return records_to_data([records[i] for i in range(len(prompts))], [len(p) for p in prompts], kinds)


def _ids(ids) -> tuple[int, ...]:
    return tuple(int(i) for i in ids) if isinstance(ids, (list, tuple)) else (int(ids),)


def stop_ids(target: TargetModel, tokenizer=None) -> tuple[int, ...]:
    """The tokens that end a response: the target config's ``eos_token_id`` (one id or a list),
    else its generation config's, else the tokenizer's."""
    gen_cfg = getattr(target.model, "generation_config", None)
    for eos in (target.config.eos_token_id, getattr(gen_cfg, "eos_token_id", None),
                getattr(tokenizer, "eos_token_id", None)):
        if eos is not None and eos != []:
            return _ids(eos)
    raise ConfigError("target.path", "the target names no end-of-sequence token (eos_token_id in config.json, "
                      "generation_config.json or the tokenizer)")


def draft_vocab(data: DrafterData, size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent response tokens (ties: lower id), sorted by id, and their coverage."""
    counts = torch.bincount(data.response_tokens(), minlength=vocab_size).double()
    counts += torch.linspace(1e-6, 0, vocab_size, dtype=torch.float64)  # deterministic tie break
    top = counts.topk(size).indices.sort().values
    real = torch.bincount(data.response_tokens(), minlength=vocab_size)
    coverage = float(real[top].sum()) / max(1, int(real.sum()))
    return top, coverage


@dataclass
class Batch:
    """Samples padded so that every prompt ends at column ``align - 1`` (left) and responses
    share columns ``align..`` (right padding after). All tensors ``[B, W, ...]``."""

    tokens: torch.Tensor  # [B, W] int64 (0 at padding)
    features: torch.Tensor  # [B, W, 3H] float32
    final: torch.Tensor  # [B, W, H] float32
    argmax: torch.Tensor  # [B, W] int64 (-1 where undefined)
    lse: torch.Tensor  # [B, W] float32
    valid: torch.Tensor  # [B, W] bool (a real token)
    pos: torch.Tensor  # [B, W] int64 position ids (0 at the first real token)
    lossable: torch.Tensor  # [B, W] bool (target logits at k predict a response token)
    align: int


def collate(data: DrafterData, idx: list[int], device: torch.device | str = "cpu") -> Batch:
    """Pad samples ``idx`` of ``data`` into one :class:`Batch` on ``device``."""
    plens = [int(data.prompt_lens[i]) for i in idx]
    lens = [int(data.offsets[i + 1] - data.offsets[i]) for i in idx]
    align = max(plens)
    width = align + max(n - p for n, p in zip(lens, plens))
    b, h = len(idx), data.final.shape[1]
    out = Batch(
        tokens=torch.zeros(b, width, dtype=torch.long), features=torch.zeros(b, width, data.features.shape[1]),
        final=torch.zeros(b, width, h), argmax=torch.full((b, width), -1, dtype=torch.long),
        lse=torch.zeros(b, width), valid=torch.zeros(b, width, dtype=torch.bool),
        pos=torch.zeros(b, width, dtype=torch.long), lossable=torch.zeros(b, width, dtype=torch.bool), align=align,
    )
    for r, i in enumerate(idx):
        lo, n, start = int(data.offsets[i]), lens[r], align - plens[r]
        sl = slice(start, start + n)
        out.tokens[r, sl] = data.tokens[lo: lo + n]
        out.features[r, sl] = data.features[lo: lo + n].float()
        out.final[r, sl] = data.final[lo: lo + n].float()
        out.argmax[r, sl] = data.argmax[lo: lo + n]
        out.lse[r, sl] = data.lse[lo: lo + n]
        out.valid[r, sl] = True
        out.pos[r, sl] = torch.arange(n)
        out.lossable[r, align - 1: start + n - 1] = True
    if str(device) != "cpu":
        out = Batch(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in out.__dict__.items()})
    return out
