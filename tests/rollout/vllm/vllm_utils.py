"""What the live vllm test modules share (each module holds one engine: sampled drafts in
``test_vllm_backend.py``, greedy drafts in ``test_vllm_greedy.py``): the Hugging Face copy of the
embedded target and the chat prompt (fixtures), the engine factory, and the exact checks that
read the logits the plug-in itself verified (``backend.record``).

Not a test module (pytest does not collect it); the modules import it after
``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import pytest
import torch

from rollout.models import TargetConfig, load_embedded_target
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from verifiers import induced_candidates, induced_chain

HEAD = Path(__file__).resolve().parents[3] / "rollout" / "heads" / "smollm2-135m-eagle3"
PROMPT_TEXT = "What is 7 + 5? Answer with a number."


@pytest.fixture(scope="module")
def hf():
    model, tok = load_embedded_target()
    return model, tok


@pytest.fixture(scope="module")
def prompt(hf):
    _, tok = hf
    text = tok.apply_chat_template([{"role": "user", "content": PROMPT_TEXT}], tokenize=False,
                                   add_generation_prompt=True)
    return tok(text, add_special_tokens=False)["input_ids"]


def build_vllm(spec: SpecConfig):
    """The vllm backend for ``spec`` built as the Ray actor builds it (``build_backend``)."""
    from rollout.backend import RolloutBackend, WorkerSpec, build_backend

    ws = WorkerSpec(target=TargetConfig(), drafter_path=str(HEAD), sampling=SamplingParams(), spec=spec,
                    verifier=VerifierConfig(), backend="vllm",
                    backend_options={"kv_cache_memory_bytes": 1 << 29, "max_model_len": 512, "max_num_seqs": 128})
    be = build_backend(ws)
    assert isinstance(be, RolloutBackend) and be.name == "vllm" and be.version == 0
    return be


def hf_logprobs(model, seqs: list[list[int]]) -> torch.Tensor:
    """log p of the next token after each sequence (T = 1), [N, V] (equal lengths)."""
    with torch.no_grad():
        logits = model.model(torch.tensor(seqs)).logits[:, -1].float()
    return torch.log_softmax(logits, -1)


def chi2_pvalue(observed: list[int], expected: list[float]) -> float:
    from scipy.stats import chi2

    stat = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    return float(chi2.sf(stat, len(observed) - 1))


def prefix_law_test(counts: Counter, probs: dict, n: int) -> float:
    """Chi-square p-value of observed prefix counts against exact probabilities (cells with an
    expected count < 5 pooled into one 'other' cell)."""
    cells = [(counts.get(k, 0), n * p) for k, p in probs.items() if n * p >= 5]
    rest_o = n - sum(o for o, _ in cells)
    rest_e = n - sum(e for _, e in cells)
    if rest_e >= 5:
        cells.append((rest_o, rest_e))
    if len(cells) < 2:  # (nearly) all mass on one token: how many samples fell outside it
        from scipy.stats import poisson

        return float(poisson.sf(rest_o - 1, max(rest_e, 1e-3)))
    return chi2_pvalue([o for o, _ in cells], [e for _, e in cells])


def generate_recorded(backend, prompts, sampling: SamplingParams, spec: SpecConfig, verifier: VerifierConfig,
                      seed: int):
    """(batch, records): one ``generate`` with the plug-in recording every verified group."""
    backend.record = True
    try:
        batch = backend.generate(prompts, sampling=sampling, spec=spec, verifier=verifier, seed=seed)
        records = backend.records()
    finally:
        backend.record = False
    return batch, records


def induced_at(rule, rec: dict, b: int, j: int) -> torch.Tensor:
    """Closed-form P [V] at position j of row b of a recorded group: ``induced_chain`` where the
    draft was sampled from q (``draft_probs``), ``induced_candidates`` where it is a greedy draft
    (one deterministic candidate), and the bonus position (no candidate: P = p) likewise."""
    s = rec["setting"]
    kw = {"temperature": s.temperature, "top_k": s.top_k, "top_p": s.top_p}
    logits = rec["target_logits"][b, j:j + 1].double()  # float64: the closed form, not another float32 rounding
    k = rec["draft_tokens"].shape[1]
    if rec["draft_probs"] is not None and j < k:
        return induced_chain(rule, logits, rec["draft_probs"][b, j:j + 1].double().log() * s.temperature, **kw)[0]
    cand = rec["draft_tokens"][b, j:j + 1, None].long() if j < k else torch.full((1, 1), -1, dtype=torch.long)
    return induced_candidates(rule, logits, cand, **kw)[0]


def check_closed_form(rule, records: list[dict], batch, min_checked: int = 20) -> int:
    """Each emitted token's behaviour log-prob equals log P(y) of the closed form within 1e-4,
    and the batch carries only verified values (after each completion's first token, which
    comes from vLLM's plain sampler; truncation at max_new_tokens drops some). Returns how
    many tokens were checked."""
    assert records
    checked = 0
    for rec in records:
        for b in range(rec["tokens"].shape[0]):
            for j in range(int((rec["tokens"][b] >= 0).sum())):
                y = int(rec["tokens"][b, j])
                want = math.log(float(induced_at(rule, rec, b, j)[y]))
                got = float(rec["behaviour"][b, j])
                assert abs(want - got) <= 1e-4, f"row {b} position {j} token {y}: {got} vs closed form {want}"
                checked += 1
    assert checked > min_checked
    mask = batch.completion_mask
    emitted = sorted(round(float(v), 5) for rec in records for b in range(rec["tokens"].shape[0])
                     for v in rec["behaviour"][b][: int((rec["tokens"][b] >= 0).sum())])
    carried = sorted(round(float(v), 5) for v in batch.behaviour_logprobs[:, 1:][mask[:, 1:]])
    assert Counter(carried) - Counter(emitted) == Counter()  # every carried value was verified
    return checked


def check_lossless_law(backend, model, prompt: list[int], spec: SpecConfig, n_samples: int, seed: int,
                       min_prefix: int = 200) -> int:
    """Lossless through vLLM: behaviour log-prob == target log-prob (processed) token by token,
    and the next-token law at positions 0, 1, 2 (given each of the 3 most frequent prefixes
    seen at least ``min_prefix`` times) is the target's (chi-square, p > 1e-3). Returns how
    many (position, prefix) laws were tested."""
    batch = backend.generate([prompt] * n_samples, sampling=SamplingParams(temperature=1.0, max_new_tokens=3),
                             spec=spec, verifier=VerifierConfig("lossless"), seed=seed)
    seqs = batch.completion_lists()
    assert all(len(s) == 3 for s in seqs)
    mask = batch.completion_mask
    assert (batch.behaviour_logprobs[mask] - batch.target_logprobs[mask]).abs().max() <= 1e-4
    assert (batch.kinds[:, 1:] >= 0).all() and batch.tau > 1.0
    tested = 0
    for j in range(3):
        prefixes = Counter(tuple(s[:j]) for s in seqs)
        for pre, n in prefixes.most_common(3):
            if n < min_prefix:
                break
            counts = Counter(s[j] for s in seqs if tuple(s[:j]) == pre)
            lp = hf_logprobs(model, [prompt + list(pre)])[0]
            probs = {tok: math.exp(float(lp[tok])) for tok in lp.topk(50).indices.tolist()}
            p = prefix_law_test(counts, probs, n)
            assert p > 1e-3, f"position {j} after {pre}: chi-square p = {p:.2e} over {n} samples"
            tested += 1
    assert tested >= 3
    # target log-probs agree with the Hugging Face copy of the target
    lp0 = hf_logprobs(model, [prompt])[0]
    first = torch.tensor([s[0] for s in seqs[:20]])
    torch.testing.assert_close(batch.target_logprobs[:20, 0], lp0[first], atol=2e-3, rtol=0)
    return tested


FAMILY_LAYERS = 4
FAMILY_AUX = (1, 2, 3)  # distinct and increasing, as vLLM captures them; layer 1's input feeds the copy head


def build_family(family: str, out: Path, vocab: int = 96, seed: int = 0):
    """A tiny random causal LM of ``family`` (a transformers ``model_type``: ``qwen3``,
    ``qwen2``, ...) saved to ``out / "target"`` (no tokenizer: the engine is given token ids),
    and an EAGLE-3 head for it in our format at ``out / "head"``, drafting over the whole
    vocabulary. Returns (target folder, head folder, the target as a ``TargetModel``).

    The target is made a near-bigram model so that a head can draft it: its decoder layers are
    damped (each adds a tenth of its output; the family's own attention and MLP still run) and
    its lm_head row of token y is the unit embedding of f^-1(y) for a random permutation f,
    so that p(. | ..., x) peaks (about 0.5) at f(x). The head drafts the token after next from
    the layer-1 feature (about the embedding of x): its fc passes that feature through, its
    decoder layer is nearly silent, its norm is the target's and its lm_head row of y is the
    target's row of f^-1(y), peaking at f(f(x)). Head dimension 32: the smallest vLLM's CPU
    attention takes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rollout.eagle3 import Eagle3Config, Eagle3Head, save_eagle3
    from rollout.models import TargetModel

    torch.manual_seed(seed)
    h, heads, head_dim = 64, 2, 32
    cfg = AutoConfig.for_model(family, vocab_size=vocab, hidden_size=h, intermediate_size=128,
                               num_hidden_layers=FAMILY_LAYERS, num_attention_heads=heads, num_key_value_heads=1,
                               head_dim=head_dim, max_position_embeddings=512, tie_word_embeddings=False,
                               bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    inv = torch.argsort(torch.randperm(vocab))  # f^-1
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.randn(vocab, h))
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(0.1)
            layer.mlp.down_proj.weight.mul_(0.1)
        model.lm_head.weight.copy_(0.6 * (emb / emb.norm(dim=-1, keepdim=True))[inv])
    model.save_pretrained(out / "target")
    target = TargetModel(model, FAMILY_AUX)
    hc = Eagle3Config(hidden_size=h, intermediate_size=128, num_attention_heads=heads, num_key_value_heads=1,
                      head_dim=head_dim, vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=h,
                      aux_layer_ids=FAMILY_AUX)
    head = Eagle3Head(hc, target.embed_tokens).eval()
    which = FAMILY_AUX.index(1)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, which * h:(which + 1) * h] = torch.eye(h)
        head.midlayer.self_attn.o_proj.weight.mul_(0.05)
        head.midlayer.mlp.down_proj.weight.mul_(0.05)
        head.norm.weight.copy_(model.model.norm.weight)
        head.lm_head.weight.copy_(model.lm_head.weight[inv])
    save_eagle3(head, out / "head")
    return out / "target", out / "head", target


def cache_free_logprobs(model, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """log softmax (T = 1) of a cache-free forward over prompt + completion at each completion
    token: [len(completion)] log p(y_t | prefix)."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model.model(ids, use_cache=False).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def cache_free_greedy(model, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy decoding by cache-free forwards: (n tokens, the smallest top-1 / top-2 logit gap
    met, which tells how far the argmax was from a tie)."""
    seq, gap = list(prompt), float("inf")
    with torch.no_grad():
        for _ in range(n):
            logits = model.model(torch.tensor([seq]), use_cache=False).logits[0, -1].float()
            top = logits.topk(2)
            gap = min(gap, float(top.values[0] - top.values[1]))
            seq.append(int(top.indices[0]))
    return seq[len(prompt):], gap
