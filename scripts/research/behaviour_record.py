"""Seeded outputs of the engine, the verifiers, the drift diagnostics and a 2-step training run,
as SHA-256 digests of their exact bits: run before and after a change that must not change
behaviour, and compare the two JSON files.

    python -m scripts.research.behaviour_record --out before.json [--work DIR]

Only public entry points are used (``rollout.backend.build_backend``, ``verifiers``,
``python -m scripts.drift``, ``python -m scripts.train``), so the record is comparable across
a reorganisation of the modules behind them. Wall times and other measured durations are left
out of the digests.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HEAD = str(Path(__file__).resolve().parents[2] / "rollout" / "heads" / "smollm2-135m-eagle3")
# a key with one of these words (split at "_") names a duration, a speed, a memory figure or a host
TIME_WORDS = frozenset({"time", "times", "timings", "s", "sec", "seconds", "ms", "wall", "elapsed", "speed",
                        "throughput", "speedup", "rss", "mb", "gb", "date", "host", "hostname", "pid", "started", "finished",
                        "out", "dir"})  # (and the output folder, which differs between two records)


def digest(*tensors) -> str:
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(str((t.dtype, tuple(t.shape))).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def timeless(value):
    """``value`` with every key that names a time, a speed, a memory figure or a host left out."""
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in sorted(value.items())
                if not TIME_WORDS & set(str(k).lower().split("_"))}
    if isinstance(value, list):
        return [timeless(v) for v in value]
    return value


def json_digest(value) -> str:
    return hashlib.sha256(json.dumps(timeless(value), sort_keys=True, default=str).encode()).hexdigest()[:16]


def verifier_records() -> dict:
    import verifiers
    out = {}
    g = torch.Generator().manual_seed(0)
    b, k, v = 64, 4, 50
    target = torch.randn(b, k + 1, v, generator=g) * 2
    draft = target[:, :k] + torch.randn(b, k, v, generator=g)
    probs = torch.softmax(draft, -1)
    tokens = torch.multinomial(probs.reshape(-1, v), 1, generator=g).reshape(b, k)
    for name, params in (("lossless", {}), ("mars", {"theta": 0.9}), ("overshoot", {"lenience": 0.5})):
        rule = verifiers.get_rule(name, **params)
        res = verifiers.verify_chain(rule, target, draft, tokens, temperature=1.0,
                                     generator=torch.Generator().manual_seed(1))
        fields = [getattr(res, f) for f in sorted(vars(res)) if isinstance(getattr(res, f), torch.Tensor)]
        out[f"verify_chain/{name}"] = digest(*fields)
        out[f"induced_chain/{name}"] = digest(verifiers.induced_chain(rule, target[:, 0], draft[:, 0], temperature=1.0))
    return out


def engine_records() -> dict:
    from rollout.backend import WorkerSpec, build_backend
    from rollout.models import TargetConfig
    from rollout.params import SamplingParams, SpecConfig, VerifierConfig
    out = {}
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24)
    prompts = [[1, 9690, 198, 2683, 314, 253, 5356, 11173, 30]] * 2 + [[1, 4093, 1431, 314, 216, 33, 1232, 216, 34, 47]] * 2
    runs = {
        "plain": (SpecConfig(mode="off"), VerifierConfig()),
        "chain/lossless": (SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="sampled"), VerifierConfig()),
        "chain/mars": (SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="sampled"),
                       VerifierConfig(name="mars", params={"theta": 0.9})),
        "chain/overshoot": (SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="sampled"),
                            VerifierConfig(name="overshoot", params={"lenience": 0.5})),
        "tree/lossless": (SpecConfig(mode="tree"), VerifierConfig()),
    }
    spec0, ver0 = runs["chain/lossless"]
    backend = build_backend(WorkerSpec(target=TargetConfig(), drafter_path=HEAD, sampling=sampling, spec=spec0,
                                       verifier=ver0, threads=2))
    for name, (spec, verifier) in runs.items():
        batch = backend.generate(prompts, sampling=sampling, spec=spec, verifier=verifier, seed=7)
        out[f"engine/{name}"] = digest(batch.completion_ids, batch.completion_mask, batch.behaviour_logprobs,
                                       batch.target_logprobs, batch.kinds, batch.relaxed)
    return out


def run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)


def drift_records(work: Path, fresh: bool = True) -> dict:
    out_dir = work / "drift"
    if fresh:
        run([sys.executable, "-m", "scripts.drift", "--config", "configs/drift.yaml", "--quick", "--out", str(out_dir),
             "--no-plots", "--no-progress", "--threads", "2"])
    return {f"drift/{p.relative_to(out_dir)}": json_digest(json.loads(p.read_text()))
            for p in sorted(out_dir.rglob("*.json"))}


def train_records(work: Path, fresh: bool = True) -> dict:
    out_dir = work / "train"
    if fresh:
        run([sys.executable, "-m", "scripts.train", "--config", "configs/default.yaml", "--steps", "2",
             "--out-dir", str(out_dir), "--fresh"])
    out = {}
    for p in sorted(out_dir.rglob("*.jsonl")):
        rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
        out[f"train/{p.relative_to(out_dir)}"] = json_digest(rows)
    for p in sorted(out_dir.rglob("*.safetensors")):
        from safetensors.torch import load_file
        state = load_file(str(p))
        out[f"train/{p.relative_to(out_dir)}"] = digest(*(state[k] for k in sorted(state)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", help="folder for the drift and training outputs (default: a temporary one)")
    ap.add_argument("--digest-only", action="store_true",
                    help="digest the drift and training outputs already in --work (run nothing)")
    ap.add_argument("--only", choices=("verifiers", "engine", "drift", "train"), action="append")
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    work = Path(args.work or tempfile.mkdtemp(prefix="behaviour-"))
    parts = args.only or ["verifiers", "engine", "drift", "train"]
    record = {}
    for part in parts:
        record.update({"verifiers": verifier_records, "engine": engine_records,
                       "drift": lambda: drift_records(work, not args.digest_only),
                       "train": lambda: train_records(work, not args.digest_only)}[part]())
        print(f"{part}: done", flush=True)
    Path(args.out).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    print(json.dumps(record, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
