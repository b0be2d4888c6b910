"""Train an EAGLE-3 head for a target on the target's own responses.

    python -m scripts.train_drafter --config configs/drafter.yaml --export rollout/heads/smollm2-135m-eagle3
    python -m scripts.train_drafter --config configs/drafter_any.yaml --target PATH --data prompts.jsonl --export OUT

The target is the embedded SmolLM2 or any Hugging Face causal LM folder (``target.path`` or
``--target``, with its tokenizer and chat template); the head's shapes (hidden size, heads,
kv heads, head_dim, intermediate size, RoPE) come from the target's config
(``Eagle3Config.for_target``), its feature layers from ``target.aux_layer_ids`` (default
``(2, N // 2, N - 3)``; ``--aux-layer-ids``).

Steps: load the target; build prompts (arithmetic problems from ``trainers.tasks`` and
general instructions, or the records of a JSONL file, ``data.prompts_file`` or ``--data``:
see ``trainers/drafter/prompts.py``; chat template applied); generate the responses and
features once and cache them; pick the draft vocabulary by response-token frequency (or start from a
trained head, ``init: head``, and keep its vocabulary); train with
training-time test (checkpoints in ``out_dir``, resumed automatically); report held-out
teacher-forced acceptance; calibrate the draft temperature on the held-out set
(``draft_logit_scale``); export the head in the EAGLE format (``--export``). One writer per
``out_dir``: the training holds ``<out_dir>/.lock`` (``trainers.grpo.run_lock``), and a second one
is refused naming it (exit 2).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from rollout.chat import chat_ids
from rollout.config import ConfigError, from_dict, load_yaml
from rollout.eagle3 import Eagle3Config, Eagle3Head, default_head_path, load_eagle3, save_eagle3
from rollout.engine.allocator import tune_malloc
from rollout.models import DTYPES, load_target, resolve_device
from scripts.cli import positive_int
from trainers.drafter.data import DrafterData, DrafterDataConfig, draft_vocab, generate_dataset, stop_ids
from trainers.drafter.prompts import PromptFileError, read_prompt_file, split_records
from trainers.drafter.train import DrafterConfig, calibrate_logit_scale, evaluate, init_from_target, train_drafter
from trainers.grpo.run_lock import RunLock, RunLockedError
from trainers.tasks.arithmetic import make_problems
from trainers.tasks.general import general_prompts, heldout_prompts


def prompt_sets(d: DrafterDataConfig) -> dict[str, tuple[list[str | list[dict]], list[str]]]:
    """{"train": (prompts, kinds), "heldout": (prompts, kinds)}: each prompt a user message's text
    or a conversation (a list of messages), the held-out set possibly empty (a prompt file with
    ``heldout_fraction: 0``)."""
    if d.prompts_file is not None:
        records = read_prompt_file(Path(d.prompts_file).expanduser())
        train, held = split_records(records, d.heldout_fraction, torch.Generator().manual_seed(d.seed), d.prompts_file)
        return {split: ([list(r.messages) for r in rs], [r.kind for r in rs]) for split, rs in
                (("train", train), ("heldout", held))}
    train = [p.prompt for lv in d.difficulties for p in make_problems(d.arithmetic_per_difficulty, lv, "train", d.seed)]
    gen_train = general_prompts(d.general_prompts, "train", d.seed)
    return {
        "train": (train + gen_train, ["arithmetic"] * len(train) + ["general"] * len(gen_train)),
        "heldout": heldout_prompts(d.heldout_arithmetic, d.difficulties, d.seed + 1, d.heldout_general),
    }


def data_path(cfg: DrafterConfig) -> Path:
    """Cache file named by a hash of everything that determines the generated data."""
    data = dataclasses.asdict(cfg.data) | {"cache_dir": None}
    if data["samples_per_prompt"] == 1:  # the default: keep the keys of data cached before the field existed
        del data["samples_per_prompt"]
    if data["prompts_file"] is None:  # likewise
        del data["prompts_file"], data["heldout_fraction"]
    else:  # the file's content, not only its name
        data["prompts_file"] = hashlib.sha256(Path(data["prompts_file"]).expanduser().read_bytes()).hexdigest()
    key = json.dumps({"data": data, "target": cfg.target.path,
                      "dtype": cfg.target.dtype, "aux": cfg.target.aux_layer_ids, "format": 1}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    root = cfg.data.cache_dir or str(Path(os.environ.get("HONEST_ROLLOUTS_CACHE") or "~/.cache/honest-rollouts") / "drafter-data")
    return Path(root).expanduser() / f"data-{digest}.pt"


def load_or_generate(cfg: DrafterConfig, target, tok, regenerate: bool) -> tuple[DrafterData, DrafterData | None]:
    """The train and held-out data (None: no held-out prompts), from the cache or generated."""
    path = data_path(cfg)
    if path.is_file() and not regenerate:
        print(f"data: cached {path}")
        blob = torch.load(path, weights_only=True)
        return DrafterData(**blob["train"]), (DrafterData(**blob["heldout"]) if "heldout" in blob else None)
    if tok is None or not getattr(tok, "chat_template", None):
        raise ConfigError("target.path", f"the target at {cfg.target.path} has no tokenizer with a chat template: "
                          "the prompts are rendered through it")
    gen = torch.Generator().manual_seed(cfg.data.seed)
    out = {}
    for split, (texts, kinds) in prompt_sets(cfg.data).items():
        if not texts:
            continue
        t0 = time.time()
        n = cfg.data.samples_per_prompt if split == "train" else 1
        out[split] = generate_dataset(target, [chat_ids(tok, t) for t in texts], kinds,
                                      max_new_tokens=cfg.data.max_new_tokens, batch_size=cfg.data.batch_size,
                                      greedy_fraction=cfg.data.greedy_fraction, gen=gen, desc=f"generate {split}",
                                      samples_per_prompt=n, eos_ids=stop_ids(target, tok))
        n_resp = len(out[split].response_tokens())
        print(f"data: {split}: {len(texts)} prompts x {n}, {n_resp} response tokens, {int(out[split].offsets[-1])} "
              f"positions in {time.time() - t0:.0f} s")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save({k: v.__dict__ for k, v in out.items()}, tmp)
    tmp.replace(path)
    return out["train"], out.get("heldout")


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/drafter.yaml")
    ap.add_argument("--export", default=None, help="folder to write the trained head to (EAGLE format)")
    ap.add_argument("--no-resume", action="store_true", help="ignore a checkpoint in out_dir")
    ap.add_argument("--regenerate-data", action="store_true")
    ap.add_argument("--data-only", action="store_true", help="generate (or check) the cached data and stop")
    ap.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (overrides the config; 1 is "
                    "faster than 2 when other processes load the CPU)")
    ap.add_argument("--stop-at", type=positive_int, default=None, help="stop at this optimizer step (resume later)")
    ap.add_argument("--target", default=None, help="a Hugging Face model folder (overrides target.path)")
    ap.add_argument("--data", default=None, help="a JSONL file of prompts or conversations (overrides "
                    "data.prompts_file; see trainers/drafter/prompts.py)")
    ap.add_argument("--aux-layer-ids", default=None, help="the three target layers whose inputs feed the head, "
                    "e.g. 2,14,25 (overrides target.aux_layer_ids; default (2, N // 2, N - 3))")
    args = ap.parse_args(argv)
    try:
        cfg = with_overrides(from_dict(DrafterConfig, load_yaml(args.config)), args)
    except ConfigError as err:
        ap.exit(2, f"error: {err}\n")
    # one writer per out_dir (its checkpoints): a second training of it is refused naming the first
    lock = contextlib.nullcontext() if args.data_only else RunLock(cfg.out_dir, "scripts.train_drafter")
    try:
        with lock:
            return run(cfg, args, ap)
    except RunLockedError as err:
        ap.exit(2, f"error: {err}\n")


def run(cfg: DrafterConfig, args: argparse.Namespace, ap: argparse.ArgumentParser) -> dict:
    """Data, head, training, calibration and export (``out_dir``'s lock held unless --data-only)."""
    tune_malloc()
    if args.threads or cfg.threads:
        torch.set_num_threads(args.threads or cfg.threads)
    device = resolve_device(cfg.device)
    try:
        target, tok = load_target(cfg.target)
        target = target.to(device)
        train, heldout = load_or_generate(cfg, target, tok, args.regenerate_data)
    except (PromptFileError, ConfigError) as err:
        ap.exit(2, f"error: {err}\n")
    if args.data_only:
        return {"train_samples": len(train), "heldout_samples": len(heldout) if heldout is not None else 0}
    head = initial_head(cfg, target, train, device)
    c = head.cfg
    print(f"head: hidden {c.hidden_size}, {c.num_attention_heads} heads / {c.num_key_value_heads} kv heads of "
          f"{c.head_dim}, intermediate {c.intermediate_size}, features of layers {c.aux_layer_ids} "
          f"(target: {target.num_layers} layers, hidden {target.hidden_size}, vocab {target.vocab_size})")
    _, coverage = _coverage_on(train, head.target_ids)
    held_cov = _coverage_on(heldout, head.target_ids)[1] if heldout is not None else None
    print(f"draft vocab {c.draft_vocab_size}: covers {coverage:.4f} of train and "
          f"{'(no held-out set)' if held_cov is None else f'{held_cov:.4f}'} of held-out response tokens")
    for p in target.parameters():
        p.requires_grad_(False)
    before = None
    if cfg.init == "head" and heldout is not None:  # the starting point's held-out acceptance, at its own logit scale
        before = evaluate(head, heldout, cfg, device, scale=head.cfg.logit_scale)
        print(f"held-out before training: {json.dumps(before)}")
    t0 = time.time()
    report = train_drafter(cfg, head, train, heldout, resume=not args.no_resume, stop_at=args.stop_at)
    report.update(train_seconds=round(time.time() - t0, 1), coverage_train=coverage, coverage_heldout=held_cov,
                  init=cfg.init, objective=cfg.objective)
    if before is not None:
        report["heldout_before"] = before
    head = head.to(DTYPES[cfg.export_dtype]).float()  # the weights inference loads
    if heldout is not None:
        scale, taus = calibrate_logit_scale(head, heldout, cfg, device)
        head.cfg = dataclasses.replace(head.cfg, logit_scale=scale)
        report.update(logit_scale=scale, est_tau_t1_by_logit_scale={str(k): round(v, 4) for k, v in taus.items()})
    print(json.dumps(report, indent=1))
    if args.export:
        save_eagle3(head.to(DTYPES[cfg.export_dtype]), args.export)
        print(f"exported to {args.export}")
    return report


def with_overrides(cfg: DrafterConfig, args: argparse.Namespace) -> DrafterConfig:
    """``cfg`` with the command line's ``--target``, ``--data`` and ``--aux-layer-ids`` (validated
    as the config's own fields: ConfigError names the field)."""
    target, data = cfg.target, cfg.data
    if args.target is not None:
        target = dataclasses.replace(target, path=args.target)
    if args.aux_layer_ids is not None:
        try:
            ids = tuple(int(i) for i in args.aux_layer_ids.split(","))
        except ValueError:
            raise ConfigError("target.aux_layer_ids", f"--aux-layer-ids takes three integers like 2,8,13, got "
                              f"{args.aux_layer_ids!r}") from None
        target = dataclasses.replace(target, aux_layer_ids=ids)
    if args.data is not None:
        data = dataclasses.replace(data, prompts_file=args.data)
    return dataclasses.replace(cfg, target=target, data=data)


def initial_head(cfg: DrafterConfig, target, train: DrafterData, device) -> Eagle3Head:
    """The head training starts from: a trained head (``init: head``, its draft vocabulary and
    logit scale kept), or a new one whose draft vocabulary is the most frequent response tokens
    of ``train``, seeded by ``cfg.seed`` and initialised from the target (``init_from_target``)."""
    if cfg.init == "head":
        path = default_head_path() if cfg.init_head == "default" else Path(cfg.init_head)
        head = load_eagle3(path, target).to(device)
        if head.cfg.draft_vocab_size != cfg.draft_vocab_size:
            raise ConfigError("draft_vocab_size", f"the head at {path} drafts over {head.cfg.draft_vocab_size} "
                              f"tokens; set draft_vocab_size: {head.cfg.draft_vocab_size} to start from it")
        print(f"init: the head at {path} (logit scale {head.cfg.logit_scale})")
        target.attach_to(head)
        return head.train()
    size = min(cfg.draft_vocab_size, target.vocab_size)  # a small vocabulary is drafted over whole
    ids, _ = draft_vocab(train, size, target.vocab_size)
    torch.manual_seed(cfg.seed)  # the head's random initial weights: the same config gives the same head
    head = Eagle3Head(Eagle3Config.for_target(target, size), target.embed_tokens).to(device)
    head.set_draft_vocab(ids)
    init_from_target(head, target, cfg.init)
    target.attach_to(head)
    return head


def _coverage_on(data: DrafterData, ids: torch.Tensor) -> tuple[int, float]:
    resp = data.response_tokens()
    hit = torch.isin(resp, ids)
    return int(hit.sum()), float(hit.float().mean()) if len(resp) else 0.0


if __name__ == "__main__":
    main()
