"""Drafter data generation on the engine: the sampling law, seeding on any device, and several
samples per prompt."""

import math

import pytest
import torch
from test_drafter import V, tiny_target

from rollout.config import ConfigError, from_dict, load_yaml
from rollout.eagle3 import Eagle3Config, Eagle3Head
from trainers.drafter.data import DrafterDataConfig, draft_vocab, generate_batch, generate_dataset
from trainers.drafter.train import DrafterConfig, train_drafter

PROMPTS = [[5, 17, 40, 8], [9, 33, 101, 7, 12], [44, 3, 250]]


def _dataset(target, seed: int, samples_per_prompt: int = 1, greedy_fraction: float = 0.0):
    return generate_dataset(target, PROMPTS, ["arithmetic", "general", "arithmetic"], max_new_tokens=10,
                            batch_size=2, greedy_fraction=greedy_fraction, gen=torch.Generator().manual_seed(seed),
                            desc="test", samples_per_prompt=samples_per_prompt)


def test_sampled_rows_follow_softmax_and_greedy_rows_the_recorded_argmax():
    """The engine draws a sampled row's first response token from softmax(logits) at the prompt
    (Monte Carlo over many rows, 4 sigma); a greedy row's response tokens are the argmax the
    record holds at the position before each; the last position is padding."""
    target = tiny_target(init_range=0.3)
    prompt, n, gen = PROMPTS[0], 1500, torch.Generator().manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # many tiny forwards
    try:
        recs = generate_batch(target, [prompt] * n, [False] * n, max_new_tokens=1, eos_id=2, gen=gen)
        recs += generate_batch(target, [prompt] * 2, [False, True], max_new_tokens=6, eos_id=2, gen=gen)
    finally:
        torch.set_num_threads(threads)
    with torch.no_grad():
        p = torch.softmax(target(torch.tensor([prompt])).logits[0, -1].double(), -1)
    first = torch.tensor([int(r["tokens"][len(prompt)]) for r in recs[:n]])
    freq = torch.bincount(first, minlength=V).double() / n
    assert bool(((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-3).all())
    g, plen = recs[-1], len(prompt)
    assert g["tokens"][plen:].tolist() == g["argmax"][plen - 1:-1].tolist()
    assert int(g["argmax"][-1]) == -1 and not g["features"][-1].any() and len(g["features"]) == len(g["tokens"])


def test_generation_is_seeded():
    target = tiny_target(init_range=0.3)
    a, b, c = _dataset(target, 0), _dataset(target, 0), _dataset(target, 1)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.features, b.features)
    assert not torch.equal(a.tokens, c.tokens) if len(a.tokens) == len(c.tokens) else True
    assert a.tokens.tolist() != c.tokens.tolist()


def test_samples_per_prompt_answers_each_prompt_independently():
    target = tiny_target(init_range=0.3)
    one = _dataset(target, 0)
    two = _dataset(target, 0, samples_per_prompt=2)
    assert len(one) == len(PROMPTS) and len(two) == 2 * len(PROMPTS)
    assert two.kinds == ["arithmetic", "general", "arithmetic"] * 2
    responses = []
    for i in range(len(two)):
        lo, hi, plen = int(two.offsets[i]), int(two.offsets[i + 1]), int(two.prompt_lens[i])
        assert two.tokens[lo: lo + plen].tolist() == PROMPTS[i % len(PROMPTS)]  # prompts in order, repeated
        responses.append(two.tokens[lo + plen: hi].tolist())
    assert any(responses[i] != responses[i + len(PROMPTS)] for i in range(len(PROMPTS))), \
        "the second sample of a prompt at T = 1 should be an independent draw"
    assert len(two.response_tokens()) > len(one.response_tokens())


def test_samples_per_prompt_config():
    assert DrafterDataConfig().samples_per_prompt == 1
    with pytest.raises(ConfigError, match="samples_per_prompt"):
        DrafterDataConfig(samples_per_prompt=0)
    gpu = from_dict(DrafterConfig, load_yaml("configs/drafter_gpu.yaml"))
    assert gpu.data.samples_per_prompt == 2 and gpu.device == "cuda" and gpu.max_steps == 966
    assert gpu.data.arithmetic_per_difficulty == 1100 and gpu.data.general_prompts == 6000


def test_data_cache_key_keeps_old_caches_and_separates_samples():
    import dataclasses

    from scripts.train_drafter import data_path

    cfg = from_dict(DrafterConfig, load_yaml("configs/drafter.yaml"))
    two = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, samples_per_prompt=2))
    assert data_path(cfg) != data_path(two)
    assert data_path(cfg).name == "data-2d02cc6619d3.pt"  # the key before samples_per_prompt existed


@pytest.mark.gpu
def test_generate_and_train_a_step_on_cuda(tmp_path):
    """On CUDA with a CPU generator (as scripts/train_drafter.py passes): seeded generation and
    one training step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    target = tiny_target(init_range=0.3).to("cuda")
    a, b = _dataset(target, 0, samples_per_prompt=2, greedy_fraction=0.3), _dataset(target, 0, samples_per_prompt=2,
                                                                                     greedy_fraction=0.3)
    assert torch.equal(a.tokens, b.tokens) and len(a) == 2 * len(PROMPTS)
    head = Eagle3Head(Eagle3Config.for_target(target, 64), target.embed_tokens).to("cuda")  # as train_drafter does
    head.set_draft_vocab(draft_vocab(a, 64, V)[0])
    for p in target.parameters():
        p.requires_grad_(False)
    cfg = DrafterConfig(draft_vocab_size=64, batch_size=3, epochs=1, max_steps=2, ttt_steps=3, warmup_steps=1,
                        out_dir=str(tmp_path), device="cuda")
    before = head.fc.weight.detach().clone()
    report = train_drafter(cfg, head, a, progress=False, log=lambda *_: None)
    assert report["steps"] == 2 and torch.isfinite(torch.tensor(report["loss"]))
    assert not torch.equal(before, head.fc.weight.detach())


def test_each_sample_of_a_prompt_draws_its_own_greedy_or_sampled_choice():
    """With ``greedy_fraction`` 0.5 and several samples per prompt, the greedy/sampled draw is made
    per sample, not once per prompt: some prompt gets both a greedy answer (each response token the
    recorded argmax before it) and a sampled one."""
    target = tiny_target(init_range=0.3)
    data = _dataset(target, 0, samples_per_prompt=4, greedy_fraction=0.5)
    greedy = []
    for i in range(len(data)):
        lo, hi, plen = int(data.offsets[i]), int(data.offsets[i + 1]), int(data.prompt_lens[i])
        greedy.append(data.tokens[lo + plen: hi].tolist() == data.argmax[lo + plen - 1: hi - 1].tolist())
    per_prompt = [{greedy[i] for i in range(p, len(data), len(PROMPTS))} for p in range(len(PROMPTS))]
    assert any(len(kinds) == 2 for kinds in per_prompt), greedy


@pytest.mark.parametrize("m", [6, 3, 0], ids=["every-position", "a-suffix", "none"])
def test_make_record_puts_each_logit_rows_argmax_and_lse_at_its_position(m):
    """A record of n tokens: positions 0..n-2 carry the features and final outputs; the logits
    given for the last m of them fill argmax and lse there (the row's own argmax and
    logsumexp), -1 and 0 before; position n - 1 is zeros throughout."""
    from trainers.drafter.data import make_record

    g = torch.Generator().manual_seed(m)
    n, h, v = 7, 4, 11
    features, final = torch.randn(n - 1, 3 * h, generator=g), torch.randn(n - 1, h, generator=g)
    logits = torch.randn(m, v, generator=g) * 3
    rec = make_record(list(range(10, 10 + n)), features, final, logits)
    assert rec["tokens"].tolist() == list(range(10, 10 + n))
    assert rec["features"].dtype == rec["final"].dtype == torch.float16
    assert torch.equal(rec["features"][:-1], features.half()) and not rec["features"][-1].any()
    assert torch.equal(rec["final"][:-1], final.half()) and not rec["final"][-1].any()
    for j in range(n):
        r = j - (n - 1 - m)  # the logit row of position j
        if 0 <= r < m:
            assert int(rec["argmax"][j]) == max(range(v), key=lambda t: float(logits[r, t]))
            assert float(rec["lse"][j]) == pytest.approx(math.log(sum(math.exp(float(x)) for x in logits[r])),
                                                         rel=1e-6)
        else:
            assert int(rec["argmax"][j]) == -1 and float(rec["lse"][j]) == 0.0
    with pytest.raises(AssertionError):
        make_record(list(range(n)), features[:-1], final, logits)
