"""Drafter training: TTT mask, TTT == chain drafting, loss goes down, exact resume, init, data."""

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rollout.config import from_dict, load_yaml
from rollout.eagle3 import Eagle3Config, Eagle3Head, causal_mask
from rollout.models import TargetModel
from trainers.drafter.data import DrafterData, collate, draft_vocab, generate_batch, records_to_data
from trainers.drafter.train import DrafterConfig, epoch_batches, init_from_target, lr_at, train_drafter
from trainers.drafter.ttt import estimated_tau, ttt_entropy_floor, ttt_forward, ttt_loss, ttt_mask
from trainers.tasks.general import general_prompts

V = 300


def tiny_target(layers: int = 6, init_range: float = 0.02) -> TargetModel:
    """A random Llama; a larger ``init_range`` gives peaked (learnable) next-token distributions."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True, eos_token_id=2, initializer_range=init_range)
    return TargetModel(LlamaForCausalLM(cfg).eval())


def tiny_data(target: TargetModel, n: int = 12, seed: int = 0, max_new: int = 12):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, V, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    recs = generate_batch(target, prompts, [i % 3 == 0 for i in range(n)], max_new_tokens=max_new, eos_id=2, gen=g)
    return records_to_data(recs, [len(p) for p in prompts], ["arithmetic"] * n)


def make_head(target: TargetModel, data, vd: int = 120) -> Eagle3Head:
    torch.manual_seed(1)
    head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=vd), target.embed_tokens)
    ids, _ = draft_vocab(data, vd, V)
    head.set_draft_vocab(ids)
    return head


def test_ttt_mask_is_exactly_eagle3():
    valid = torch.tensor([[False, True, True, True, True, True, True],
                          [True, True, True, True, True, False, False]])
    first, step = 2, 3
    m = ttt_mask(valid, first, step)
    t, tq = 7, 5
    assert m.shape == (2, tq, t + step * tq)
    for b in range(2):
        for qi in range(tq):
            i = first + qi
            for j in range(t):  # step-0 keys: causal over real tokens (own column always)
                assert m[b, qi, j] == ((j <= i and bool(valid[b, j])) or j == i)
            for s in range(1, step + 1):  # steps 1..s: own position only
                block = m[b, qi, t + (s - 1) * tq: t + s * tq]
                assert block.tolist() == [k == qi for k in range(tq)]


def test_ttt_equals_chain_drafting_at_inference():
    """Step s at column i of the unrolled TTT forward == the s-th draft of an inference chain."""
    target = tiny_target()
    data = tiny_data(target)
    head = make_head(target, data).eval()
    batch = collate(data, list(range(4)))
    steps = 4
    with torch.no_grad():
        outs = ttt_forward(head, batch, steps)
        for r in range(4):
            lo = batch.align - int(data.prompt_lens[r])  # first real column of row r
            n = int(batch.valid[r].sum())
            i = lo + n - 2 - steps  # a column whose unrolled steps stay inside the sample
            assert i >= outs[1][0]
            feats, toks = batch.features[r: r + 1, lo: i + 1], batch.tokens[r: r + 1, lo + 1: i + 2]
            pos = torch.arange(i + 1 - lo)[None]
            out = head(toks, feats, pos, causal_mask(1, i + 1 - lo))
            step0 = head.logits_from_hidden(outs[0][1][r, i])
            torch.testing.assert_close(out.logits[0, -1], step0, rtol=1e-4, atol=1e-4)
            hidden, kv = out.hidden[:, -1:], out.kv
            for s in range(1, steps):
                tok = batch.tokens[r: r + 1, i + 1 + s: i + 2 + s]
                p = torch.tensor([[i - lo + s]])
                out = head(tok, hidden, p, torch.ones(1, 1, kv[0].shape[2] + 1, dtype=torch.bool), past=kv)
                hidden, kv = out.hidden, out.kv
                first, hid = outs[s]
                torch.testing.assert_close(out.logits[0, 0], head.logits_from_hidden(hid[r, i - first]),
                                           rtol=1e-4, atol=1e-4)


def test_init_from_target_reproduces_next_layer_input():
    target = tiny_target()
    data = tiny_data(target, n=3)
    head = make_head(target, data)
    init_from_target(head, target, "layer")
    ids = data.tokens[: int(data.offsets[1])][None]
    with torch.no_grad():
        feats = target(ids, use_cache=False).features
        ref = target.model(input_ids=ids, output_hidden_states=True).hidden_states
        out = head(ids, feats, torch.arange(ids.shape[1])[None], causal_mask(1, ids.shape[1]))
    torch.testing.assert_close(out.hidden, ref[target.aux_layer_ids[2] + 1], rtol=1e-4, atol=1e-4)


def test_few_steps_reduce_the_loss(tmp_path):
    target = tiny_target(init_range=0.3)
    data = tiny_data(target, n=16)
    head = make_head(target, data)
    cfg = DrafterConfig(draft_vocab_size=120, batch_size=8, epochs=30, lr=3e-3, warmup_steps=2,
                        ttt_steps=3, out_dir=str(tmp_path), init="random")
    batch = collate(data, list(range(16)))
    with torch.no_grad():
        before, _ = ttt_loss(head, batch, 3, 0.8)
    train_drafter(cfg, head, data, progress=False, log=lambda *_: None)
    with torch.no_grad():
        after, per_step = ttt_loss(head, batch, 3, 0.8)
    floor = ttt_entropy_floor(head, batch, 3, 0.8)  # loss - floor = weighted KL(target || draft)
    assert float(after) - floor < 0.5 * (float(before) - floor), (float(before), float(after), floor)
    assert len(per_step) == 3


def test_resume_continues_identically(tmp_path):
    target = tiny_target()
    data = tiny_data(target, n=16)
    cfg = DrafterConfig(draft_vocab_size=120, batch_size=4, epochs=2, lr=1e-3, warmup_steps=2, ttt_steps=3,
                        save_every=100, out_dir=str(tmp_path / "a"))
    straight = make_head(target, data)
    init_from_target(straight, target, "lm_head")
    train_drafter(cfg, straight, data, progress=False, log=lambda *_: None)
    cfg_b = dataclasses.replace(cfg, out_dir=str(tmp_path / "b"))
    first = make_head(target, data)
    init_from_target(first, target, "lm_head")
    train_drafter(cfg_b, first, data, progress=False, log=lambda *_: None, stop_at=5)  # interrupted mid-epoch 2
    second = make_head(target, data)  # a fresh process: new head, state from the checkpoint
    train_drafter(cfg_b, second, data, progress=False, log=lambda *_: None)
    for k, v in straight.state_dict().items():
        assert torch.equal(v, second.state_dict()[k]), k
    assert not torch.equal(first.fc.weight, second.fc.weight)


def test_draft_vocab_is_most_frequent_sorted():
    target = tiny_target()
    data = tiny_data(target, n=8)
    ids, coverage = draft_vocab(data, 20, V)
    counts = torch.bincount(data.response_tokens(), minlength=V)
    assert bool((ids[1:] > ids[:-1]).all())
    assert counts[ids].min() >= counts[torch.ones(V, dtype=torch.bool).index_fill_(0, ids, False)].max()
    assert coverage == pytest.approx(float(counts[ids].sum()) / float(counts.sum()))


def test_general_prompts_distinct_and_split():
    train, held = general_prompts(300, "train", seed=0), general_prompts(50, "heldout", seed=1)
    assert len(set(train)) == 300 and len(set(held)) == 50 and not set(train) & set(held)


def test_estimated_tau():
    assert estimated_tau([1.0] * 7) == 8.0
    assert estimated_tau([0.5, 0.5]) == pytest.approx(1.75)


def test_shipped_config_loads():
    cfg = from_dict(DrafterConfig, load_yaml("configs/drafter.yaml"))
    assert cfg.ttt_steps == 7 and cfg.step_weight == 0.8 and cfg.betas == (0.9, 0.95) and cfg.grad_clip == 0.5


def test_calibrate_logit_scale_picks_the_best_draft_temperature():
    from trainers.drafter.train import calibrate_logit_scale, evaluate

    target = tiny_target(init_range=0.3)
    data = tiny_data(target, n=12)
    head = make_head(target, data)
    cfg = DrafterConfig(draft_vocab_size=120, batch_size=6, ttt_steps=3)
    grid = (0.5, 1.0, 2.0, 4.0)
    best, taus = calibrate_logit_scale(head, data, cfg, torch.device("cpu"), grid)
    assert set(taus) == set(grid) and taus[best] == max(taus.values())
    assert len({round(t, 6) for t in taus.values()}) == len(grid)  # the scale changes T = 1 acceptance
    report = evaluate(head, data, cfg, torch.device("cpu"), scale=2.0)
    assert taus[2.0] == pytest.approx(report["arithmetic"]["est_tau_t1"])


def test_draft_vocab_breaks_ties_towards_the_lower_id():
    """Tokens as frequent as each other: the lower ids make the draft vocabulary."""
    tokens = torch.tensor([1, 9, 9, 5, 5, 7, 7, 3, 3])  # prompt token 1, then 9, 5, 7 and 3 twice each
    data = records_to_data([{"tokens": tokens, "features": torch.zeros(9, 3), "final": torch.zeros(9, 1),
                             "argmax": torch.zeros(9, dtype=torch.long), "lse": torch.zeros(9)}], [1], ["general"])
    ids, coverage = draft_vocab(data, 2, 12)
    assert ids.tolist() == [3, 5] and coverage == pytest.approx(0.5)


def test_concatenated_data_keeps_each_samples_span():
    """``DrafterData.concat``: the samples of every part, in order, each spanning its own tokens."""
    g = torch.Generator().manual_seed(0)
    lens = [5, 3, 7, 4, 6]
    recs = [{"tokens": torch.randint(0, V, (n,), generator=g), "features": torch.randn(n, 6, generator=g).half(),
             "final": torch.randn(n, 2, generator=g).half(), "argmax": torch.randint(0, V, (n,), generator=g),
             "lse": torch.randn(n, generator=g)} for n in lens]
    plens, kinds = [2, 1, 3, 2, 2], ["arithmetic", "general", "arithmetic", "general", "general"]
    whole = records_to_data(recs, plens, kinds)
    parts = [records_to_data(recs[a:b], plens[a:b], kinds[a:b]) for a, b in ((0, 2), (2, 3), (3, 5))]
    joined = DrafterData.concat(parts)
    for name, value in whole.__dict__.items():
        other = getattr(joined, name)
        assert value == other if isinstance(value, list) else torch.equal(value, other), name


def test_the_learning_rate_warms_up_from_its_first_step():
    """``lr_at``: linear warmup whose first step already moves the weights (lr / warmup_steps), the
    peak at the last warmup step, then cosine decay to ``lr * min_lr_ratio`` at the end."""
    cfg = DrafterConfig(lr=1e-3, warmup_steps=4, min_lr_ratio=0.1)
    assert [lr_at(cfg, s, 20) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])
    assert lr_at(cfg, 4, 20) == pytest.approx(1e-3) and lr_at(cfg, 20, 20) == pytest.approx(1e-4)
    assert lr_at(dataclasses.replace(cfg, warmup_steps=0), 0, 20) == pytest.approx(1e-3)


def test_epoch_batches_group_similar_lengths():
    """``epoch_batches``: every sample once per epoch, in batches of ``batch_size`` cut from chunks of
    8 batches of the shuffled samples, each chunk sorted by length: within a chunk the batches do not
    overlap in length (less padding)."""
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(5, 500, (160,), generator=g).tolist()
    batches = epoch_batches(lengths, 4, torch.Generator().manual_seed(0))
    assert sorted(i for b in batches for i in b) == list(range(160)) and {len(b) for b in batches} == {4}
    perm = torch.randperm(160, generator=torch.Generator().manual_seed(0)).tolist()
    for start in range(0, 160, 32):
        chunk = set(perm[start: start + 32])
        spans = sorted((min(lengths[i] for i in b), max(lengths[i] for i in b)) for b in batches if set(b) <= chunk)
        assert len(spans) == 8 and all(hi <= lo for (_, hi), (lo, _) in zip(spans, spans[1:])), spans


def test_each_epoch_draws_its_own_batch_order_reproducibly(tmp_path, monkeypatch):
    """The batches of each epoch are a fresh shuffle (an order repeated every epoch would show the
    head the same sequence of batches each time), drawn from the run's seed: the same seed gives the
    same orders again (what resume relies on), another seed other ones."""
    import trainers.drafter.train as train_module

    target = tiny_target()
    data = tiny_data(target, n=16)

    def orders(seed: int, name: str) -> list:
        seen = []
        real = train_module.epoch_batches
        monkeypatch.setattr(train_module, "epoch_batches", lambda *a: seen.append(real(*a)) or seen[-1])
        cfg = DrafterConfig(draft_vocab_size=120, batch_size=4, epochs=3, lr=1e-3, warmup_steps=1, ttt_steps=1,
                            save_every=100, seed=seed, out_dir=str(tmp_path / name))
        train_drafter(cfg, make_head(target, data), data, progress=False, log=lambda *_: None)
        monkeypatch.setattr(train_module, "epoch_batches", real)
        return seen

    first = orders(0, "a")
    assert len(first) == 3
    assert all(sorted(i for b in order for i in b) == list(range(16)) for order in first)  # every sample once
    assert first[0] != first[1] and first[1] != first[2] and first[0] != first[2]
    assert orders(0, "b") == first
    assert orders(1, "c") != first
