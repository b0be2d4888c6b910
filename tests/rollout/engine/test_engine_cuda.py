"""The engine on CUDA (marker ``gpu``): the checks of ``test_engine.py`` and ``test_engine_sampling.py``
that say most about a device, on a tiny random target and a head trained on the CPU, then moved.

- plain greedy decoding equals the argmax of cache-free forwards on the device, and greedy speculation
  (chains, trees, sampled trees) equals plain greedy decoding token for token;
- lossless sampled runs (the rule test and block verification, chains and sampled trees): every
  emitted token's target log-prob equals a cache-free forward over prompt + completion on the
  device, and its behaviour log-prob equals it;
- a lossy rule's behaviour log-probs are its closed-form induced distribution at the logits the
  verifier saw (computed on the CPU).

Each test runs on ``cuda`` (``gpu``; skipped without a device) and, in the default run, on the
``cpu`` with the C++ verifiers and linear kernel bypassed (the PyTorch code CUDA runs), so each
body is known to pass there.
"""

from __future__ import annotations

import pytest
import torch
from test_engine_utils import (PROMPTS, assert_speculative_greedy_equals_plain, chi2_pvalue,  # noqa: F401
                               exact_three_token_law, induced_logprob, single_thread, tiny_target, trained_head)

from rollout.engine.engine import Engine
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from verifiers import TokenKind, block_tree, native, target_logprobs

SPECS = {
    "chain-sampled": SpecConfig(mode="chain", num_draft_tokens=3),
    "chain-greedy": SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy"),
    "tree": SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8),
    "tree-sampled": SpecConfig(mode="tree", depth=3, top_k=3, total_tokens=8, tree_candidates="sampled"),
}


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(autouse=True)
def torch_verifiers(monkeypatch):
    """The PyTorch verifiers on the CPU too (CUDA never runs the C++ ones), a sampled tree's block
    verification by the batched walk CUDA takes."""
    monkeypatch.setattr(block_tree, "walk_each_row", block_tree.walk_rows)
    with native.forced(False):
        yield


def _on(device: str, vocab: int, draft_vocab: int, seed: int, logit_scale: float = 3.0):
    """(target, head, engine) on ``device``: a tiny target, its head trained on the CPU, both moved."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = tiny_target(vocab=vocab, seed=seed, logit_scale=logit_scale)
    head = trained_head(target, draft_vocab=draft_vocab, seed=seed + 1)
    target, head = target.to(device), head.to(device)
    assert target.device.type == head.fc.weight.device.type == device
    return target, head, Engine(target, head, num_threads=1, linear="torch")


@pytest.fixture(scope="module", params=DEVICES)
def models(request, single_thread):
    """``test_engine_sampling.py``'s 64-token model (48 in the draft)."""
    return _on(request.param, 64, 48, 5)


@pytest.fixture(scope="module", params=DEVICES)
def small(request, single_thread):
    """``test_engine_sampling.py``'s 12-token model (9 in the draft), for exact laws."""
    return _on(request.param, 12, 9, 3, logit_scale=4.0)


def test_plain_greedy_matches_cache_free_argmax(models):
    """Plain greedy decoding equals the argmax of a cache-free forward after each prefix, on the device."""
    target, _, engine = models
    res = engine.generate(PROMPTS, SamplingParams(temperature=0, max_new_tokens=24))
    for prompt, comp in zip(PROMPTS, res.completions):
        seq = torch.tensor([prompt], device=target.device)
        with torch.no_grad():
            for _ in range(24):
                seq = torch.cat([seq, target(seq, use_cache=False).logits[:, -1:].argmax(-1)], 1)
        assert comp.completion_ids == seq[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(SPECS))
def test_speculative_greedy_equals_plain_greedy(models, name):
    assert_speculative_greedy_equals_plain(models[2], SPECS[name])


@pytest.mark.parametrize("name,test", [("off", "rule"), ("chain-sampled", "rule"), ("tree", "rule"),
                                       ("tree-sampled", "rule"), ("chain-sampled", "block"),
                                       ("tree-sampled", "block")])
def test_lossless_logprobs_match_a_cache_free_forward(models, name, test):
    """Every emitted token's log p equals a plain forward over prompt + completion on the device
    (caches, masks and positions are right after rounds of mixed acceptance); lossless: the
    behaviour log-prob is log p."""
    target, _, engine = models
    spec = SpecConfig(mode="off") if name == "off" else SPECS[name]
    sampling = SamplingParams(temperature=1.0, top_p=0.95, max_new_tokens=40, stop_token_ids=(7,))
    res = engine.generate(PROMPTS * 2, sampling, spec, VerifierConfig("lossless", test=test), seed=5)
    assert len({c.num_tokens for c in res.completions}) > 1, "rows should finish at different times"
    if name != "off":
        assert sum(k == TokenKind.ACCEPTED for c in res.completions for k in c.kinds) > 20
    for comp in res.completions:
        seq = torch.tensor([comp.prompt_ids + comp.completion_ids], device=target.device)
        with torch.no_grad():
            logits = target(seq, use_cache=False).logits[0, len(comp.prompt_ids) - 1:-1].cpu()  # [C, V]
        lp = target_logprobs(logits, 1.0, None, 0.95)
        ref = lp.gather(1, torch.tensor(comp.completion_ids)[:, None])[:, 0].tolist()
        assert comp.target_logprobs == pytest.approx(ref, abs=2e-4)
        assert comp.behaviour_logprobs == pytest.approx(ref, abs=2e-4)


@pytest.mark.parametrize("name", ["chain-sampled", "tree-sampled"])
def test_lossy_behaviour_logprob_is_the_induced_distribution(models, name):
    """MARS (theta 0.5, T = 0.8, top-k 40): each emitted token's behaviour log-prob is the rule's
    closed form at the logits the verifier saw; the lossy branch fires."""
    _, _, engine = models
    verifier = VerifierConfig("mars", {"theta": 0.5})
    sampling = SamplingParams(temperature=0.8, top_k=40, max_new_tokens=32)
    rule, relaxed = verifier.rule(), 0
    for seed in (2, 3):
        res = engine.generate(PROMPTS, sampling, SPECS[name], verifier, seed=seed, debug=True)
        assert len(res.debug) == res.timings.tokens, "one debug record per emitted token"
        for rec in res.debug:
            comp = res.completions[rec.row]
            assert comp.completion_ids[rec.index] == rec.token
            assert comp.behaviour_logprobs[rec.index] == pytest.approx(induced_logprob(rule, rec, sampling), abs=1e-4)
        relaxed += sum(sum(c.relaxed) for c in res.completions)
    assert relaxed > 0, "the lossy branch should fire on this model"


@pytest.mark.parametrize("name,test", [("chain-sampled", "rule"), ("tree-sampled", "rule"),
                                       ("chain-sampled", "block"), ("tree-sampled", "block")])
def test_lossless_tokens_follow_the_target(small, name, test):
    """3000 completions of one prompt: the first two tokens (the second from inside a round) follow
    the target's exact law (chi-square); drafts were accepted, so the verifier decided them."""
    target, _, engine = small
    prompt, rows, v = [1, 5, 2, 7], 3000, target.vocab_size
    res = engine.generate([prompt] * rows, SamplingParams(max_new_tokens=3), SPECS[name],
                          VerifierConfig("lossless", test=test), seed=17)
    ys = torch.tensor([c.completion_ids for c in res.completions])
    two_token_law = exact_three_token_law(target, prompt).sum(2)
    assert chi2_pvalue(torch.bincount(ys[:, 0] * v + ys[:, 1], minlength=v * v), two_token_law) > 1e-3
    assert sum(c.kinds[1] == TokenKind.ACCEPTED for c in res.completions) > 0.1 * rows
