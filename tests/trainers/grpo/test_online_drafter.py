"""Training the EAGLE-3 head during GRPO (``trainers/grpo/online_drafter.py``): its records are
the drafter data the engine captures, a round trains the head and nothing of the policy, the
actors draft with the shipped head, and a resumed run continues the same head."""

from __future__ import annotations

import copy

import pytest
import torch

from rollout.config import ConfigError
from rollout.eagle3 import load_eagle3
from rollout.models import TargetConfig, load_target
from tests.trainers.conftest import write_config
from trainers.grpo.config import load_train_config
from trainers.grpo.online_drafter import OnlineDrafter, OnlineDrafterConfig, rollout_records, teacher_forced_tau


@pytest.fixture(scope="module")
def target(tiny_policy_dir):
    t, _ = load_target(TargetConfig(path=str(tiny_policy_dir)))
    return t


def _sequences(target, n=6, new=10, seed=0):
    """Prompts of different lengths, the first two each answered twice more (groups that share a
    prompt), and their completions, sampled by the engine (plain decoding, features captured),
    and those captures."""
    from rollout.engine.engine import Engine
    from rollout.params import SamplingParams

    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(5, 400, (4 + 3 * i,), generator=g).tolist() for i in range(n)]
    prompts += prompts[:2] * 2
    res = Engine(target, num_threads=1).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=new),
                                                 seed=seed, capture=True)
    seqs = [c.prompt_ids + c.completion_ids for c in res.completions]
    return seqs, [len(p) for p in prompts], res.captures


@pytest.mark.parametrize("shared", [True, False], ids=["prompt-cached", "rows-whole"])
def test_records_match_the_engines_capture(target, shared, monkeypatch):
    from trainers.drafter.data import _record

    if not shared:  # a model whose forward takes no KV cache (or an unknown name for it)
        monkeypatch.setattr("trainers.grpo.online_drafter.cache_kwarg", lambda model: None)

    seqs, plens, caps = _sequences(target)
    seqs[-1] = seqs[-1][: plens[-1]]  # an empty completion
    assert len({tuple(s[:p]) for s, p in zip(seqs, plens)}) == 6
    data = rollout_records(target, seqs, plens, batch=2)  # groups of 3 in two forwards
    assert data.kinds == ["rollout"] * len(seqs) and data.prompt_lens.tolist() == plens
    for i, (seq, cap, plen) in enumerate(zip(seqs, caps, plens)):
        ref = _record(target, seq, cap) if len(cap.features) == len(seq) - 1 else None
        lo, hi = int(data.offsets[i]), int(data.offsets[i + 1])
        assert data.tokens[lo:hi].tolist() == seq
        if ref is None:  # the cut row: its prompt's features, no completion to predict
            assert (data.argmax[lo:hi] == -1).all() and not data.lse[lo:hi].any()
            continue
        torch.testing.assert_close(data.features[lo:hi].float(), ref["features"].float(), atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(data.final[lo:hi].float(), ref["final"].float(), atol=2e-3, rtol=2e-3)
        # argmax and lse where they predict a completion token; -1 and 0 before
        assert torch.equal(data.argmax[lo + plen - 1: hi], ref["argmax"][plen - 1:]), i
        torch.testing.assert_close(data.lse[lo + plen - 1: hi], ref["lse"][plen - 1:], atol=1e-4, rtol=1e-5)
        assert (data.argmax[lo: lo + plen - 1] == -1).all() and not data.lse[lo: lo + plen - 1].any()
    with pytest.raises(ValueError, match="sequence 1: prompt length 9"):
        rollout_records(target, [[1, 2, 3], [1] * 8], [2, 9], batch=2)


def test_the_feature_pass_leaves_no_packed_copy_of_the_policy(target):
    from rollout.kernels import native_linear

    if not native_linear.available():
        pytest.skip("the native kernel is unavailable here: nothing is packed")
    seqs, plens, _ = _sequences(target, n=2, new=4, seed=9)
    layers = [m for m in target.model.modules() if isinstance(m, torch.nn.Linear)]
    with native_linear.routed(target.model):
        assert any(native_linear.panels_of(m) is not None for m in target.model.modules())
    rollout_records(target, seqs, plens, batch=2)
    assert all(native_linear.panels_of(m) is None for m in target.model.modules()), "a packed copy stayed"
    assert not any(m.weight in native_linear.weight_check.stamps for m in layers)


def _drafter(target, head_dir, tmp_path, **cfg):
    return OnlineDrafter(OnlineDrafterConfig(**{"every": 1, "lr": 3e-3, "updates": 4, "batch_size": 4, **cfg}),
                         head_dir, target, tmp_path, seed=5)


@pytest.fixture
def trainable(target):
    """The target as the GRPO trainer holds it: parameters that take gradients."""
    was = [p.requires_grad for p in target.model.parameters()]
    target.model.requires_grad_(True)
    yield target
    for p, w in zip(target.model.parameters(), was):
        p.requires_grad_(w)
        p.grad = None


def test_a_round_trains_the_head_and_not_the_policy(trainable, tiny_head_dir, tmp_path):
    target = trainable
    seqs, plens, _ = _sequences(target, n=8, new=12)
    drafter = _drafter(target, tiny_head_dir, tmp_path)
    policy_before = {k: v.clone() for k, v in target.model.state_dict().items()}
    head_before = {k: v.clone() for k, v in drafter.head.state_dict().items()}
    data = rollout_records(target, seqs, plens, batch=8)
    tau0 = teacher_forced_tau(drafter.head, data, steps=4, batch=8)[0]
    first = drafter.train_round(0, seqs, plens)
    assert first["drafter_est_tau"] == pytest.approx(tau0, rel=1e-6)  # scored before it trains on them
    assert first["drafter_est_tau_initial"] == first["drafter_est_tau"]  # nothing trained yet
    for step in range(1, 6):
        last = drafter.train_round(step, seqs, plens)
    assert last["drafter_loss"] < first["drafter_loss"] - 0.05, (first, last)
    assert last["drafter_est_tau"] > first["drafter_est_tau"], (first, last)
    assert last["drafter_est_tau_initial"] == pytest.approx(tau0, rel=1e-6)  # the loaded head, kept aside
    assert len(drafter.window) == min(len(seqs) * 6, drafter.cfg.buffer) and drafter.rounds == 6
    assert any(not torch.equal(v, head_before[k]) for k, v in drafter.head.state_dict().items())
    for name, v in target.model.state_dict().items():  # nothing of the policy moved or got a gradient
        assert torch.equal(v, policy_before[name]), name
    assert all(p.grad is None for p in target.model.parameters())
    exported = load_eagle3(drafter.export_path, target)  # what the actors load: bf16 values of the head
    for name, v in exported.state_dict().items():
        assert torch.equal(v, drafter.head.state_dict()[name].to(torch.bfloat16).to(v.dtype)), name


def test_train_on_batch_is_the_round_on_each_rows_prompt_and_completion(target, tiny_head_dir, tmp_path):
    """The loop and the TRL plug-in hand a generation over as it is: padded prompts of several
    lengths; the features are taken in eval mode and the policy's mode is restored."""
    from rollout.engine.engine import Engine
    from rollout.params import SamplingParams

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 400, (3 + 4 * i,), generator=g).tolist() for i in range(4)] * 2
    res = Engine(target, num_threads=1).generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=9), seed=3)
    batch = res.to_batch(pad_id=7)
    seqs = [c.prompt_ids + c.completion_ids for c in res.completions]
    a, b = (_drafter(target, tiny_head_dir, tmp_path / name) for name in "ab")
    modes = []
    hook = target.model.model.register_forward_pre_hook(lambda module, args: modes.append(module.training))
    target.model.train()
    try:
        ra = a.train_on_batch(2, batch)
        assert target.model.training and modes and not any(modes)
        target.model.eval()
        rb = b.train_round(2, seqs, [len(p) for p in prompts])
    finally:
        hook.remove()
        target.model.eval()
    assert {k: ra[k] for k in ("drafter_loss", "drafter_est_tau")} == {k: rb[k] for k in ("drafter_loss",
                                                                                        "drafter_est_tau")}
    for name, v in a.head.state_dict().items():
        assert torch.equal(v, b.head.state_dict()[name]), name


def test_export_writes_the_head_only_when_it_changed(target, tiny_head_dir, tmp_path, monkeypatch):
    import shutil

    from trainers.grpo import online_drafter

    writes = []
    real = online_drafter.save_eagle3
    monkeypatch.setattr(online_drafter, "save_eagle3", lambda head, path: (writes.append(path), real(head, path))[1])
    seqs, plens, _ = _sequences(target, n=4, new=8, seed=4)
    d = _drafter(target, tiny_head_dir, tmp_path)
    assert d.export() == d.export() == d.export_path and not writes  # the configured head's folder, copied once
    assert (d.export_path / "model.safetensors").read_bytes() == (tiny_head_dir / "model.safetensors").read_bytes()
    d.train_round(0, seqs, plens)
    assert len(writes) == 1
    d.export()  # a checkpoint right after the round: the folder already holds this head
    assert len(writes) == 1
    d.load_state_dict(copy.deepcopy(d.state_dict()))  # a resume: written again
    d.export()
    assert len(writes) == 2
    shutil.rmtree(d.export_path)  # the folder gone: written again
    d.export()
    assert len(writes) == 3
    exported = load_eagle3(d.export_path, target)
    for name, v in exported.state_dict().items():
        assert torch.equal(v, d.head.state_dict()[name].to(torch.bfloat16).to(v.dtype)), name


def test_before_the_first_round_the_configured_head_ships_unrounded(target, tiny_head_dir, tmp_path):
    """A checkpoint taken before any round holds the head the actors have, not a bf16 copy of it."""
    head = load_eagle3(tiny_head_dir, target)
    assert any(not torch.equal(v, v.to(torch.bfloat16).to(v.dtype)) for v in head.state_dict().values())
    d = _drafter(target, tiny_head_dir, tmp_path)
    shipped = load_eagle3(d.export(), target).state_dict()
    for name, v in head.state_dict().items():
        assert torch.equal(shipped[name], v), name


def test_a_resume_keeps_the_configs_optimizer_settings(target, tiny_head_dir, tmp_path, caplog):
    """A resumed round uses the lr the config now gives (say, lowered after a divergence), not the saved one."""
    seqs, plens, _ = _sequences(target, n=4, new=8, seed=6)
    a = _drafter(target, tiny_head_dir, tmp_path / "a", lr=3e-3)
    a.train_round(0, seqs, plens)
    b = _drafter(target, tiny_head_dir, tmp_path / "b", lr=1e-6, betas=(0.8, 0.9))
    with caplog.at_level("WARNING"):
        b.load_state_dict(copy.deepcopy(a.state_dict()))
    group = b.optimizer.param_groups[0]
    assert group["lr"] == 1e-6 and group["betas"] == (0.8, 0.9)
    assert "drafter_training.lr 0.003 -> 1e-06" in caplog.text and "drafter_training.betas" in caplog.text
    assert b.optimizer.state_dict()["state"]  # the moments came back
    before = {k: v.clone() for k, v in b.head.state_dict().items() if v.is_floating_point()}
    b.train_round(1, seqs, plens)
    moved = max(float((b.head.state_dict()[k] - v).abs().max()) for k, v in before.items())
    assert 0 < moved < 1e-4  # lr 1e-6 steps (lr 3e-3 moves the weights by ~1e-2)


def test_the_window_keeps_copies_not_the_whole_round(target, tiny_head_dir, tmp_path):
    seqs, plens, _ = _sequences(target, n=6, new=8, seed=7)
    d = _drafter(target, tiny_head_dir, tmp_path, buffer=2)
    d.train_round(0, seqs, plens)
    assert len(d.window) == 2
    for w in d.window:
        for name in ("tokens", "features", "final", "argmax", "lse"):
            t = getattr(w, name)
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size(), name


def test_a_round_with_nothing_to_predict_does_not_move_the_head(target, tiny_head_dir, tmp_path):
    seqs, plens, _ = _sequences(target, n=4, new=8, seed=8)
    d = _drafter(target, tiny_head_dir, tmp_path, buffer=16)
    d.train_round(0, seqs, plens)
    m = d.train_round(1, [s[:p] for s, p in zip(seqs, plens)], plens)  # every completion empty
    assert m["drafter_updates"] > 0 and "drafter_loss" in m  # the window still holds round 0's samples
    assert "drafter_est_tau" not in m  # nothing fresh to score
    d = _drafter(target, tiny_head_dir, tmp_path / "b", buffer=4)
    d.train_round(0, seqs, plens)
    before = {k: v.clone() for k, v in d.head.state_dict().items()}
    d.window = []
    m = d.train_round(1, [s[:p] for s, p in zip(seqs, plens)], plens)
    assert m["drafter_updates"] == 0.0 and "drafter_loss" not in m and "drafter_est_tau" not in m
    for name, v in d.head.state_dict().items():
        assert torch.equal(v, before[name]), name


def test_state_round_trip_continues_the_same_head(target, tiny_head_dir, tmp_path):
    seqs, plens, _ = _sequences(target, n=6, new=8, seed=1)
    a = _drafter(target, tiny_head_dir, tmp_path / "a", buffer=8)
    a.train_round(0, seqs, plens)
    b = _drafter(target, tiny_head_dir, tmp_path / "b", buffer=8)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # as a checkpoint holds it: no shared tensors
    fresh = _drafter(target, tiny_head_dir, tmp_path / "c", buffer=8)
    fresh.head.load_state_dict(a.head.state_dict())  # the head alone: no optimizer moments, no window
    ra, rb, rc = (d.train_round(1, seqs[::-1], plens[::-1]) for d in (a, b, fresh))
    assert ra["drafter_loss"] == rb["drafter_loss"] and ra["drafter_est_tau"] == rb["drafter_est_tau"]
    assert rc["drafter_loss"] != ra["drafter_loss"]  # the window and the moments matter
    for name, v in a.head.state_dict().items():
        assert torch.equal(v, b.head.state_dict()[name]), name


def test_a_non_finite_head_loss_stops_before_the_head_ships(target, tiny_head_dir, tmp_path):
    from trainers.grpo.guards import NonFiniteError

    seqs, plens, _ = _sequences(target, n=4, new=8, seed=2)
    drafter = _drafter(target, tiny_head_dir, tmp_path)
    with torch.no_grad():
        drafter.head.fc.weight[0, 0] = float("nan")
    with pytest.raises(NonFiniteError, match="step 4: drafter loss is not finite .*update 1 of the head's round"):
        drafter.train_round(3, seqs, plens)
    assert not drafter.export_path.exists() and drafter.rounds == 0


@pytest.mark.parametrize("values, field", [
    ({"every": -1}, "every"), ({"objective": "block"}, "objective"), ({"objective": "ce", "ce_weight": 0.1}, "ce_weight"),
    ({"export_dtype": "int8"}, "export_dtype"), ({"lr": 0}, "lr"), ({"buffer": 0}, "buffer"),
    ({"betas": [0.9]}, "betas"), ({"betas": [False, 0.9]}, "betas"), ({"score_initial": "yes"}, "score_initial"),
])
def test_bad_settings_name_the_field(values, field):
    with pytest.raises(ConfigError) as err:
        OnlineDrafterConfig(**values)
    assert err.value.field == field, str(err.value)


def test_the_cross_entropy_weight_follows_the_objective():
    assert OnlineDrafterConfig().ce_weight == 0.1 and OnlineDrafterConfig(objective="ce").ce_weight == 0.0
    assert OnlineDrafterConfig(objective="tv", ce_weight=0.0).ce_weight == 0.0


def test_training_needs_a_drafter(tmp_path, tiny_policy_dir):
    path = write_config(tmp_path / "c.yaml", tiny_policy_dir, None, tmp_path / "out", rollout={"spec": {"mode": "off"}},
                        drafter_training={"every": 1})
    with pytest.raises(ConfigError) as err:
        load_train_config(path)
    assert err.value.field == "drafter_training.every" and "model.drafter None" in str(err.value)


def _length_reward(text, answer, cfg=None) -> float:
    return float(len(text) % 3)  # uneven rewards: a policy gradient that is not 0


def test_grpo_run_trains_ships_and_resumes_the_head(tmp_path, tiny_policy_dir, tiny_head_dir, local_ray, monkeypatch,
                                                    capsys):
    from trainers.grpo.loop import GRPOTrainer

    monkeypatch.setattr("trainers.grpo.loop.answer_reward", _length_reward)
    settings = dict(drafter_training={"every": 1, "lr": 3e-3, "updates": 2, "batch_size": 4},
                    rollout={"verifier": {"name": "lossless", "params": {}}})

    def trainer(name, steps):
        path = write_config(tmp_path / f"{name}.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / name,
                            run={"steps": steps}, **settings)
        return GRPOTrainer(load_train_config(path))

    full = trainer("full", 2)
    full.start()
    initial = {k: v.clone() for k, v in full.drafter.head.state_dict().items()}
    held = full.pool._ray.get(full.pool.actors[0].head_weights.remote())
    for name, v in held.items():  # the actor starts with the configured head
        assert torch.equal(v, initial[name]), name
    m = full.step(0)
    assert {"drafter_est_tau", "drafter_loss", "drafter_s"} <= set(m) and m["drafter_est_tau"] >= 1.0
    held = full.pool._ray.get(full.pool.actors[0].head_weights.remote())
    shipped = load_eagle3(full.drafter.export_path, full.policy_target).state_dict()
    assert any(not torch.equal(v, initial[k]) for k, v in shipped.items())
    for name, v in held.items():  # the actor drafts with the head the trainer just trained
        assert torch.equal(v, shipped[name]), name
    full.pool.shutdown()
    full.logger.close()
    rows_full = trainer("full2", 2).run()
    part = trainer("part", 1)
    part.run()
    ckpt = tmp_path / "part" / "checkpoints" / "step_000001"
    assert (ckpt / "drafter_training.pt").is_file() and (ckpt / "drafter" / "model.safetensors").is_file()
    resumed = trainer("part", 2)
    rows_resumed = resumed.run()
    for key in ("drafter_loss", "drafter_est_tau", "reward_mean", "loss"):
        assert rows_resumed[1][key] == pytest.approx(rows_full[1][key], rel=1e-6, abs=1e-9), key
    final_full = torch.load(tmp_path / "full2" / "checkpoints" / "step_000002" / "drafter_training.pt")["head"]
    final_resumed = torch.load(tmp_path / "part" / "checkpoints" / "step_000002" / "drafter_training.pt")["head"]
    for name, v in final_full.items():
        assert torch.equal(v, final_resumed[name]), name
    # resumed with the head's training off: the actors draft with model.drafter, and the run says so
    path = write_config(tmp_path / "off.yaml", tiny_policy_dir, tiny_head_dir, tmp_path / "part", run={"steps": 3},
                        rollout=settings["rollout"])
    off = GRPOTrainer(load_train_config(path))
    capsys.readouterr()
    off.start()
    try:
        out = capsys.readouterr().out
        assert "step_000002 holds the head trained so far" in out and "drafter_training.every 0" in out, out
        held = off.pool._ray.get(off.pool.actors[0].head_weights.remote())
        for name, v in held.items():
            assert torch.equal(v, initial[name]), name
    finally:
        off.pool.shutdown()
        off.logger.close()


def test_the_pool_ships_the_head_files_so_actors_need_no_shared_folder(target, tiny_policy_dir, tiny_head_dir,
                                                                      tmp_path, local_ray):
    """``RolloutPool.load_drafter`` reads the folder on the driver's machine and ships its files
    through the object store: an actor (on another node, in a cluster) never opens the driver's
    path. Here the folder is deleted once the pool has read it, and a replacement actor started
    after that still drafts with the shipped head, not the spec's."""
    import shutil

    from rollout.ray.actor import read_head_files
    from rollout.ray.actor_pool import RolloutPool
    from rollout.backend import WorkerSpec
    from rollout.eagle3 import save_eagle3
    from rollout.params import SamplingParams, SpecConfig, VerifierConfig

    head = load_eagle3(tiny_head_dir, target)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(0.5)
    folder = tmp_path / "trained"
    save_eagle3(head, folder)
    want = load_eagle3(folder, target).state_dict()
    spec = WorkerSpec(target=TargetConfig(path=str(tiny_policy_dir)), drafter_path=str(tiny_head_dir),
                      sampling=SamplingParams(temperature=1.0, max_new_tokens=4),
                      spec=SpecConfig(mode="chain", num_draft_tokens=2), verifier=VerifierConfig("lossless"), threads=1)
    pool = RolloutPool(spec, 1, num_cpus_per_actor=1)
    try:
        before = local_ray.get(pool.actors[0].head_weights.remote())
        assert any(not torch.equal(before[k], v) for k, v in want.items())  # the spec's head, another one
        pool.load_drafter(str(folder))
        shutil.rmtree(folder)  # gone, as the trainer's folder is for an actor on another node
        pool._restart(0)  # a replacement starts after that
        held = local_ray.get(pool.actors[0].head_weights.remote())
        for name, v in want.items():
            assert torch.equal(held[name], v), name
        batch, _ = pool.generate(["0/0/0"], [[5, 6, 7]], seed=1)
        assert len(batch) == 1 and batch.completion_lengths[0] > 0
    finally:
        pool.shutdown()
    with pytest.raises(FileNotFoundError, match="no EAGLE-3 head folder"):
        read_head_files(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        read_head_files(tmp_path / "empty")
