"""The EAGLE-3 draft head: shapes, draft vocabulary mapping, KV cache, checkpoint formats."""

import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from rollout.eagle3 import Eagle3Config, Eagle3Head, causal_mask, load_eagle3, save_eagle3
from rollout.eagle3_io import HeadMismatchError
from rollout.models import TargetModel

V, H, VD = 300, 64, 100


def tiny_target(layers: int = 6, hidden: int = H, vocab: int = V, aux=None) -> TargetModel:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=True)
    return TargetModel(LlamaForCausalLM(cfg).eval(), aux)


def make_head(target: TargetModel, vd: int = VD, seed: int = 1) -> tuple[Eagle3Head, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head = Eagle3Head(Eagle3Config.for_target(target, draft_vocab_size=vd), target.embed_tokens)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if p.dim() == 1 else 0.0))
    ids = torch.randperm(target.vocab_size, generator=g)[:vd].sort().values
    head.set_draft_vocab(ids)
    return head.eval(), ids


def run(head, target, t=9, seed=2):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, target.vocab_size, (2, t), generator=g)
    feats = torch.randn(2, t, 3 * target.hidden_size, generator=g)
    pos = torch.arange(t).expand(2, t)
    with torch.no_grad():
        return head(tokens, feats, pos, causal_mask(2, t)), (tokens, feats, pos)


def test_d2t_t2d_and_target_logits():
    target = tiny_target()
    head, ids = make_head(target)
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
    assert torch.equal(head.target_ids, ids)
    assert torch.equal(torch.arange(VD) + head.d2t, ids)
    assert int(head.t2d.sum()) == VD and bool(head.t2d[ids].all())
    out, _ = run(head, target)
    assert out.logits.shape == (2, 9, VD) and out.hidden.shape == (2, 9, H)
    full = head.to_target_logits(out.logits)  # [2, 9, V]
    assert full.shape == (2, 9, V)
    assert torch.equal(full[..., ids], out.logits)
    assert torch.isneginf(full[..., ~head.t2d]).all()
    assert torch.equal(full.argmax(-1), ids[out.logits.argmax(-1)])


def test_kv_cache_two_calls_equal_one_call():
    target = tiny_target()
    head, _ = make_head(target)
    (full, (tokens, feats, pos)) = run(head, target, t=10)
    with torch.no_grad():
        a = head(tokens[:, :6], feats[:, :6], pos[:, :6], causal_mask(2, 6))
        b = head(tokens[:, 6:], feats[:, 6:], pos[:, 6:], causal_mask(2, 4, past_len=6), past=a.kv)
    torch.testing.assert_close(torch.cat([a.logits, b.logits], 1), full.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([a.hidden, b.hidden], 1), full.hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(b.kv[0], full.kv[0], rtol=1e-5, atol=1e-5)
    assert b.kv[0].shape == (2, 2, 10, 16)


def test_fc_applies_only_to_feature_width_input():
    target = tiny_target()
    head, _ = make_head(target)
    out, (tokens, feats, pos) = run(head, target, t=5)
    with torch.no_grad():
        fed_back = head(tokens, out.hidden, pos, causal_mask(2, 5))  # [2, 5, H]: no fc
        head.fc.weight.mul_(2.0)
        fed_back2 = head(tokens, out.hidden, pos, causal_mask(2, 5))
        from_features = head(tokens, feats, pos, causal_mask(2, 5))
    assert torch.equal(fed_back.logits, fed_back2.logits)
    assert not torch.allclose(from_features.logits, out.logits)
    with pytest.raises(ValueError, match="hidden must be"):
        head(tokens, torch.zeros(2, 5, 2 * H), pos, causal_mask(2, 5))


def test_mask_controls_what_a_position_sees():
    target = tiny_target()
    head, _ = make_head(target)
    out, (tokens, feats, pos) = run(head, target, t=6)
    mask = causal_mask(2, 6).clone()
    mask[:, 4, 1] = False
    with torch.no_grad():
        masked = head(tokens, feats, pos, mask)
    changed = (masked.logits - out.logits).abs().amax(dim=(0, 2)) > 1e-6
    assert changed.tolist() == [False, False, False, False, True, False]


def test_eagle_format_round_trip_exact(tmp_path):
    target = tiny_target()
    head, ids = make_head(target)
    save_eagle3(head, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == VD
    assert cfg["num_hidden_layers"] == 1 and cfg["eagle_aux_hidden_state_layer_ids"] == list(target.aux_layer_ids)
    loaded = load_eagle3(tmp_path, target)
    sd_a, sd_b = head.state_dict(), loaded.state_dict()
    assert sd_a.keys() == sd_b.keys() and "midlayer.self_attn.q_proj.weight" in sd_a
    assert not any(k.startswith("embed_tokens") for k in sd_a)
    for k in sd_a:
        assert torch.equal(sd_a[k], sd_b[k]), k
    assert loaded.embed_tokens is target.embed_tokens
    a, _ = run(head, target)
    b, _ = run(loaded, target)
    assert torch.equal(a.logits, b.logits)


def test_bf16_round_trip_exact(tmp_path):
    target = tiny_target()
    head, _ = make_head(target)
    head = head.to(torch.bfloat16)
    save_eagle3(head, tmp_path)
    loaded = load_eagle3(tmp_path, target, dtype=torch.bfloat16)
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert loaded.fc.weight.dtype == torch.bfloat16


def write_speculators(head: Eagle3Head, target: TargetModel, path) -> None:
    c = head.cfg
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
        "draft_vocab_size": c.draft_vocab_size, "eagle_aux_hidden_state_layer_ids": list(c.aux_layer_ids),
        "norm_before_residual": False,  # the EAGLE layer's residual (absent, speculators means true)
        "transformer_layer_config": {
            "model_type": "llama", "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "vocab_size": c.vocab_size,
            "max_position_embeddings": c.max_position_embeddings,
        },
    }
    weights = {k.replace("midlayer.", "layers.0."): v.clone() for k, v in head.state_dict().items()}
    weights["embed_tokens.weight"] = target.embed_tokens.weight.detach().clone()
    save_file(weights, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))


def test_speculators_format_loads_exactly(tmp_path):
    target = tiny_target()
    head, _ = make_head(target)
    write_speculators(head, target, tmp_path)
    loaded = load_eagle3(tmp_path, target)
    for k, v in head.state_dict().items():
        assert torch.equal(v, loaded.state_dict()[k]), k
    assert loaded.cfg.rope_theta == 10000.0  # absent from the config: the EAGLE default
    assert not loaded.cfg.variant and torch.equal(run(loaded, target)[0].logits, run(head, target)[0].logits)


@pytest.mark.parametrize(
    "other, needle",
    [
        (dict(hidden=32), "hidden size"),
        (dict(vocab=310), "vocabulary"),
        (dict(layers=4), "layer ids"),
        (dict(aux=(1, 3, 5)), "layer ids"),
    ],
)
def test_mismatched_head_is_refused(tmp_path, other, needle):
    head, _ = make_head(tiny_target(aux=(2, 3, 5)))
    save_eagle3(head, tmp_path)
    wrong = tiny_target(**other)
    with pytest.raises(HeadMismatchError, match=needle):
        load_eagle3(tmp_path, wrong)


def test_full_vocab_head_without_mapping(tmp_path):
    target = tiny_target()
    head = Eagle3Head(Eagle3Config.for_target(target), target.embed_tokens)
    save_eagle3(head, tmp_path)
    from safetensors.torch import load_file
    w = {k: v for k, v in load_file(str(tmp_path / "model.safetensors")).items() if k not in ("d2t", "t2d")}
    save_file(w, str(tmp_path / "model.safetensors"))
    loaded = load_eagle3(tmp_path, target)
    assert torch.equal(loaded.target_ids, torch.arange(V)) and bool(loaded.t2d.all())


@pytest.mark.parametrize("use_head", [True, False])
def test_measured_drafters_are_lossless_at_t0(use_head):
    """measure_acceptance's drafters (the head, or the repeat-last-token drafter) on the engine
    reproduce plain greedy decoding; the trivial drafter proposes the pending token K times;
    ``measure`` reports the engine's counters at both temperatures."""
    from rollout.engine.engine import Engine
    from rollout.params import SamplingParams, SpecConfig
    from rollout.outputs import tau_with_error
    from scripts.measure_acceptance import RepeatLastDraft, measure

    target = tiny_target()
    head, _ = make_head(target, vd=V)  # full vocabulary: some drafts get accepted
    draft = head if use_head else RepeatLastDraft(V)
    prompt = torch.randint(3, V, (7,), generator=torch.Generator().manual_seed(5)).tolist()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(20):
            ids = torch.cat([ids, target(ids, use_cache=False).logits[:, -1:].argmax(-1)], 1)
    spec = SpecConfig(mode="chain", num_draft_tokens=4, draft_sampling="greedy")
    res = Engine(target, draft, num_threads=1).generate([prompt], SamplingParams(temperature=0, max_new_tokens=20),
                                                          spec, debug=True)
    assert res.completions[0].completion_ids == ids[0, 7:].tolist()
    assert 1.0 <= res.tau <= 5.0
    if not use_head:  # a candidate is the previous token: the pending one or an accepted repeat of it
        out = [prompt[-1]] + res.completions[0].completion_ids
        assert all(d.candidates is None or int(d.candidates[0]) in (-1, out[d.index]) for d in res.debug)
    for temperature in (0.0, 1.0):
        r = measure(target, None if not use_head else head, [prompt, prompt[:4]], k=3, temperature=temperature,
                    max_new_tokens=12, seed=0)
        assert r.timings.row_rounds >= 2 and 1.0 <= r.tau <= 4.0
        # the rows' step_emitted add up to the call's counters: tau_with_error's tau is the engine's
        rows = [c.step_emitted for c in r.completions]
        assert sum(map(sum, rows)) == r.timings.emitted and sum(map(len, rows)) == r.timings.row_rounds
        assert tau_with_error(rows)[0] == pytest.approx(r.tau)


def test_measure_trees_reports_each_tree_per_set_and_temperature():
    """measure_acceptance --tree: sampled trees at T = 1 only, top-k trees at T = 1 and 0, the
    engine's counters summed over the seeds; a bad tree exits naming the flag."""
    from scripts.measure_acceptance import main, measure_trees

    target = tiny_target()
    head, _ = make_head(target, vd=V)
    sets = {"a": [[5, 9, 3, 7]], "b": [[4, 8], [11, 6, 2]]}
    report = measure_trees(target, head, sets, "s3,2,4;2,2,3", max_new_tokens=8, seed=0, seeds=2)
    assert set(report) == {"a/T=1/tree s3,2,4", "b/T=1/tree s3,2,4", "a/T=1/tree 2,2,3", "a/T=0/tree 2,2,3",
                           "b/T=1/tree 2,2,3", "b/T=0/tree 2,2,3"}
    for key, r in report.items():
        rows = len(sets[key[0]])
        assert r["emitted"] >= 2 * rows * 7  # two seeds; every row runs to max_new_tokens (after its first token)
        assert r["tau"] == round(r["emitted"] / r["forwards"], 3) and 1.0 <= r["tau"] <= 4.0
    with pytest.raises(SystemExit):
        main(["--tree", "s3,2"])


def test_measure_acceptance_verifies_with_the_given_rule():
    """--verifier reaches the engine for chains and sampled trees: overshoot at lenience 0.2
    accepts more than lossless on the same prompts and seeds; a bad spec exits."""
    from rollout.params import VerifierConfig
    from scripts.measure_acceptance import main, measure_seeds, measure_trees

    target = tiny_target()
    head, _ = make_head(target, vd=V)
    sets = {"a": [[5, 9, 3, 7], [4, 8], [11, 6, 2]]}
    lenient = VerifierConfig("overshoot", {"lenience": 0.2})
    chain = {name: measure_seeds(target, head, sets["a"], range(3), k=3, temperature=1.0, max_new_tokens=16,
                                 verifier=v)["tau"] for name, v in (("lossless", None), ("overshoot", lenient))}
    tree = {name: measure_trees(target, head, sets, "s3,2,4", max_new_tokens=16, seed=0, seeds=3,
                                verifier=v)["a/T=1/tree s3,2,4"]["tau"]
            for name, v in (("lossless", None), ("overshoot", lenient))}
    assert chain["overshoot"] > chain["lossless"] and tree["overshoot"] > tree["lossless"], (chain, tree)
    with pytest.raises(SystemExit):
        main(["--verifier", "overshoot:lenience=2"])


class _ByteTokenizer:
    """A stand-in tokenizer for measure_acceptance's prompts: the template is the text, each id
    a byte of it within the tiny vocabulary."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        return " ".join(m["content"] for m in messages)[:24]

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + b % (V - 3) for b in text.encode()]}


def test_measure_acceptance_main_leaves_out_an_empty_set_and_takes_temperatures(monkeypatch, capsys):
    """measure_acceptance end to end on a tiny target: ``--n-general 0`` leaves the general set
    out of the report (it once divided by its zero forwards), ``--temperatures`` picks the
    temperatures (chains and trees alike), and bad counts or temperatures exit naming the flag."""
    import scripts.measure_acceptance as ma

    target = tiny_target()
    head, _ = make_head(target, vd=V)
    monkeypatch.setattr(ma, "load_embedded_target", lambda: (target, _ByteTokenizer()))
    monkeypatch.setattr(ma, "load_eagle3", lambda path, t: head)
    report = ma.main(["--n-arith", "2", "--n-general", "0", "--temperatures", "1", "--no-trivial", "--k", "3",
                      "--max-new-tokens", "6", "--tree", "s2,2,3;2,2,3"])
    measured = {key for key in report if "/" in key}
    assert measured == {"arithmetic/T=1/eagle3", "arithmetic/T=1/tree s2,2,3", "arithmetic/T=1/tree 2,2,3"}
    entry = report["arithmetic/T=1/eagle3"]
    assert entry["forwards"] > 0 and report["step_costs"]["target_step_s"] > 0
    assert entry["rows"] == 2 and 0 <= entry["tau_se"] < entry["tau"]  # two prompts, one seed
    report = ma.main(["--n-arith", "0", "--n-general", "1", "--temperatures", "0", "--k", "2", "--max-new-tokens", "4",
                      "--tree", "s2,2,3;2,2,3"])
    assert {key for key in report if "/" in key} == {"general/T=0/eagle3", "general/T=0/trivial",
                                                      "general/T=0/tree 2,2,3"}  # no sampled tree at T = 0
    for argv, flag in ((["--n-arith", "0", "--n-general", "0"], "--n-arith and --n-general"),
                       (["--n-general", "-1"], "--n-general"), (["--k", "0"], "--k"), (["--seeds", "0"], "--seeds"),
                       (["--temperatures", "1,x"], "--temperatures"), (["--temperatures", "-1"], "--temperatures"),
                       (["--temperatures", "nan"], "--temperatures"), (["--temperatures", ","], "--temperatures")):
        with pytest.raises(SystemExit):
            ma.main(argv)
        assert flag in capsys.readouterr().err, argv


@pytest.mark.slow
def test_shipped_head_loads_and_beats_trivial_drafter():
    from rollout.eagle3 import default_head_path
    from rollout.models import load_embedded_target
    from scripts.measure_acceptance import held_out_prompts, measure

    path = default_head_path()
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size <= 30 * 2**20, f"shipped head is {size / 2**20:.1f} MB"
    target, tok = load_embedded_target()
    head = load_eagle3(path, target)
    assert head.cfg.vocab_size == target.vocab_size and head.cfg.aux_layer_ids == target.aux_layer_ids
    prompts = held_out_prompts(tok, n_arith=4, n_general=0)["arithmetic"]
    for temperature in (0.0, 1.0):
        eagle = measure(target, head, prompts, k=7, temperature=temperature, max_new_tokens=48, seed=0)
        trivial = measure(target, None, prompts, k=7, temperature=temperature, max_new_tokens=48, seed=0)
        assert eagle.tau > trivial.tau + 0.25, (temperature, eagle.tau, trivial.tau)


def test_logit_scale_round_trips_and_scales_the_draft_distribution(tmp_path):
    import dataclasses

    target = tiny_target()
    head, _ = make_head(target)
    plain, _ = run(head, target)
    head.cfg = dataclasses.replace(head.cfg, logit_scale=1.3)
    scaled, (tokens, feats, pos) = run(head, target)
    torch.testing.assert_close(scaled.logits, 1.3 * plain.logits)
    with torch.no_grad():  # training reads logits_from_hidden: never scaled
        torch.testing.assert_close(head.logits_from_hidden(scaled.hidden), plain.logits)
    save_eagle3(head, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["draft_logit_scale"] == 1.3
    loaded = load_eagle3(tmp_path, target)
    assert loaded.cfg.logit_scale == 1.3
    assert torch.equal(run(loaded, target)[0].logits, scaled.logits)
    with pytest.raises(Exception, match="logit_scale"):
        dataclasses.replace(head.cfg, logit_scale=0.0)


def test_measure_acceptance_on_a_checkpoints_policy_against_a_baseline_head(monkeypatch, capsys, tmp_path):
    """``--policy`` measures on a training checkpoint's weights, ``--baseline-head`` a second head
    on the same prompts and seeds; a folder that is not a checkpoint is refused naming the flag."""
    import json

    from safetensors.torch import save_file

    import scripts.measure_acceptance as ma

    target = tiny_target()
    trained, _ = make_head(target, vd=V)
    baseline, _ = make_head(target, vd=V)
    with torch.no_grad():
        for p in baseline.parameters():
            p.mul_(0.0)  # drafts nothing the target agrees with, beyond chance
    ckpt = tmp_path / "step_000003"
    ckpt.mkdir()
    policy = {k: v.detach().clone() * 1.5 for k, v in target.model.state_dict().items()}
    save_file(policy, str(ckpt / "policy.safetensors"))
    (ckpt / "state.json").write_text(json.dumps({"step": 3}))
    for name in ("trained", "baseline"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
    monkeypatch.setattr(ma, "load_embedded_target", lambda: (target, _ByteTokenizer()))
    monkeypatch.setattr(ma, "load_eagle3", lambda path, t: trained if path.endswith("trained") else baseline)
    report = ma.main(["--n-arith", "3", "--n-general", "0", "--temperatures", "1", "--no-trivial", "--k", "3",
                      "--max-new-tokens", "8", "--policy", str(ckpt), "--head", str(tmp_path / "trained"),
                      "--baseline-head", str(tmp_path / "baseline")])
    for name, v in target.model.state_dict().items():  # measured on the checkpoint's weights
        assert torch.equal(v, policy[name]), name
    a, b = report["arithmetic/T=1/eagle3"], report["arithmetic/T=1/baseline"]
    assert a["rows"] == b["rows"] == 3 and a["tau"] != b["tau"]
    assert report["policy"] == str(ckpt) and report["baseline_head"] == str(tmp_path / "baseline")
    assert f"head tau {a['tau']:.3f}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        ma.main(["--policy", str(tmp_path / "trained")])
    err = capsys.readouterr().err
    assert "--policy" in err and "no training checkpoint" in err and "policy.safetensors" in err
