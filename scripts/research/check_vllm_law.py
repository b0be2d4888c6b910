"""Does vLLM's EAGLE-3 engine sample from the target? The next-token law at the first positions
of one fixed prompt, against the Hugging Face copy of the target, for vLLM plain decoding,
vLLM + EAGLE-3 with vLLM's own rejection sampler, and vLLM + EAGLE-3 with our lossless
verifier; then the mean completion length of each on held-out prompts (with a lossless
verifier the lengths must agree with plain decoding up to sampling noise).

    python -m scripts.research.check_vllm_law --samples 2000 --positions 3 --head PATH

For each position j < positions and each prefix seen at least 200 times, the law of token j
given that prefix is tested with a chi-square test (cells with expected count < 5 pooled);
p-values far below 1e-3 mean the engine does not sample from the target.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")

import argparse  # noqa: E402
import math  # noqa: E402
from collections import Counter  # noqa: E402

import torch  # noqa: E402

from rollout.models import TargetConfig, load_embedded_target  # noqa: E402
from rollout.params import SamplingParams, SpecConfig, VerifierConfig  # noqa: E402

PROMPT = "What is 7 + 5? Answer with a number."


def chi2_pvalue(counts: Counter, lp: torch.Tensor, n: int) -> float:
    from scipy.stats import chi2

    cells = [(counts.get(t, 0), n * math.exp(float(lp[t]))) for t in lp.topk(50).indices.tolist()]
    cells = [(o, e) for o, e in cells if e >= 5]
    rest = (n - sum(o for o, _ in cells), n - sum(e for _, e in cells))
    if rest[1] >= 5:
        cells.append(rest)
    if len(cells) < 2:  # (nearly) all mass on one token: how many samples fell outside it
        from scipy.stats import poisson

        return float(poisson.sf(rest[0] - 1, max(rest[1], 1e-3)))
    stat = sum((o - e) ** 2 / e for o, e in cells)
    return float(chi2.sf(stat, len(cells) - 1))


def law_report(name: str, seqs: list[list[int]], model, prompt: list[int], positions: int) -> list[str]:
    lines = []
    for j in range(positions):
        for pre, n in Counter(tuple(s[:j]) for s in seqs if len(s) > j).most_common(3):
            if n < 200:
                break
            counts = Counter(s[j] for s in seqs if len(s) > j and tuple(s[:j]) == pre)
            with torch.no_grad():
                lp = torch.log_softmax(model.model(torch.tensor([prompt + list(pre)])).logits[0, -1].float(), -1)
            lines.append(f"{name:18s} position {j} after {str(pre):18s} n={n:5d}  chi-square p = "
                         f"{chi2_pvalue(counts, lp, n):.3g}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--positions", type=int, default=3)
    ap.add_argument("--head", default=None)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--length-prompts", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    from rollout.eagle3 import default_head_path
    from rollout.vllm.backend import VLLMBackend
    from rollout.chat import chat_ids
    from trainers.tasks.general import benchmark_prompts

    model, tok = load_embedded_target()
    prompt = chat_ids(tok, PROMPT)
    held = benchmark_prompts(tok, args.length_prompts, 0)
    head = args.head or str(default_head_path())
    opts = {"kv_cache_memory_bytes": 1 << 29, "max_model_len": 1024, "max_num_seqs": 128}
    chain = SpecConfig(mode="chain", num_draft_tokens=args.k)
    law = SamplingParams(temperature=1.0, max_new_tokens=args.positions)
    length = SamplingParams(temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(tok.eos_token_id,))
    lines = []
    for name, spec, rule in [("vllm-plain", SpecConfig(mode="off"), None),
                             ("vllm-eagle3-own", chain, None), ("vllm-eagle3-ours", chain, "lossless")]:
        be = VLLMBackend(TargetConfig(), None if spec.mode == "off" else head, spec, options=opts)
        if rule is None:
            be.configure(None, 0)
            outs = be.generate_raw([prompt] * args.samples, law, seed=1, num_logprobs=0)
            seqs = [list(o.outputs[0].token_ids) for o in outs]
            be.configure(None, 0)
            lens = [len(o.outputs[0].token_ids) for o in be.generate_raw(held, length, seed=2, num_logprobs=0)]
        else:
            seqs = be.generate([prompt] * args.samples, sampling=law, spec=spec, verifier=VerifierConfig(rule),
                               seed=1).completion_lists()
            lens = be.generate(held, sampling=length, spec=spec, verifier=VerifierConfig(rule),
                               seed=2).completion_lengths
        lines += law_report(name, seqs, model, prompt, args.positions)
        lines.append(f"{name:18s} mean completion length on {len(held)} held-out prompts: "
                     f"{sum(lens) / len(lens):.1f} (max {args.max_new_tokens})")
        print("\n".join(lines[-4:]), flush=True)
        del be
    print("\n".join(lines))


if __name__ == "__main__":
    main()
