"""The TRL plug-in with a real TRL GRPOTrainer on the tiny random policy (CPU): it trains
through our rollout_func, TRL's importance ratios are 1 for lossless rollouts and differ
from 1 (and change the loss) for lossy ones, the backend holds the trainer's weights
after an optimizer step (in-process and through the Ray pool), and settings TRL cannot
honour are refused before training starts."""

from __future__ import annotations

import math
import os

import pytest
import torch

from rollout.config import ConfigError
from rollout.models import TargetConfig
from rollout.outputs import RolloutBatch
from rollout.params import SpecConfig, VerifierConfig
from trainers.grpo.correction import CorrectionConfig
from trainers.grpo.online_drafter import OnlineDrafterConfig

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")

PROMPTS = [[{"role": "user", "content": f"What is {i} plus {2 * i}?"}] for i in range(8)]


def _reward(completions, **kwargs):
    """Varies within a group (so advantages, and the gradient, are non-zero)."""
    return [float(len(c[0]["content"]) % 3) for c in completions]


class Recording:
    """Mixed into the trainer: keeps every generation's output and TRL's ratios."""

    def _generate_and_score_completions(self, inputs):
        out = super()._generate_and_score_completions(inputs)
        self.outputs = getattr(self, "outputs", []) + [out]
        return out


def _trainer(tmp_path, policy_dir, head_dir, verifier="lossless", params=None, correction=None, steps=2,
             placement="local", reload_every=0, spec=None, drafter_training=None, eval_prompts=None, **args):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from trainers.trl import RolloutSettings, SpeculativeGRPOTrainer

    class Trainer(Recording, SpeculativeGRPOTrainer):
        pass

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir))
    tok = AutoTokenizer.from_pretrained(str(policy_dir))
    kw = dict(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, per_device_train_batch_size=4,
              num_generations=4, max_completion_length=8, max_steps=steps, learning_rate=1e-3, report_to=[],
              logging_steps=1, save_strategy="no", temperature=1.0, seed=0)
    kw.update(args)
    settings = RolloutSettings(spec=spec or SpecConfig(mode="chain", num_draft_tokens=3),
                               verifier=VerifierConfig(verifier, params or {}), drafter=str(head_dir),
                               placement=placement, target=TargetConfig(path=str(policy_dir)),
                               drafter_reload_every=reload_every,
                               drafter_training=OnlineDrafterConfig(**(drafter_training or {})),
                               threads_per_actor=1, threads=2)
    return Trainer(model=model, reward_funcs=_reward, args=GRPOConfig(**kw),
                   train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]), processing_class=tok,
                   eval_dataset=Dataset.from_list([{"prompt": p} for p in eval_prompts]) if eval_prompts else None,
                   rollouts=settings, correction=correction or CorrectionConfig(mode="token_tis", cap=2.0))


def _valid_ratios(trainer) -> torch.Tensor:
    return torch.cat([trainer.importance_ratios(o)[o["completion_mask"].bool()] for o in trainer.outputs])


# ---------------------------------------------------------------------------- training
def test_trains_two_steps_lossless_on_policy(tmp_path, tiny_policy_dir, tiny_head_dir):
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "lossless")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    assert all(h["grad_norm"] > 0 for h in logs)
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters())), "weights did not change"
    ratios = _valid_ratios(trainer)  # step 2 ran on the weights step 1 changed: still on-policy
    assert ratios.numel() > 0 and (ratios - 1).abs().max() < 1e-3
    for h in logs:  # our metrics go through TRL's own logging
        assert abs(h["sampling/importance_sampling_ratio/max"] - 1) < 1e-3
        assert h["speculative/tau"] > 1.0  # the drafts were used
        assert h["speculative/relaxed_fraction"] == 0.0
        assert h["speculative/kl_k3"] < 1e-6 and h["speculative/is_ess"] > 0.999
    assert isinstance(trainer.rollouts.last_batch, RolloutBatch)


def test_trains_on_policy_with_sampled_trees(tmp_path, tiny_policy_dir, tiny_head_dir):
    """Trees of sampled candidates inside TRL: lossless, so the importance ratios stay 1."""
    spec = SpecConfig(mode="tree", depth=3, top_k=2, total_tokens=4, tree_candidates="sampled")
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "lossless", spec=spec)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == 2 and all(math.isfinite(h["loss"]) for h in logs)
    ratios = _valid_ratios(trainer)
    assert ratios.numel() > 0 and (ratios - 1).abs().max() < 1e-3
    assert all(h["speculative/tau"] > 1.0 for h in logs)


def test_lossy_ratios_differ_and_the_correction_changes_the_loss(tmp_path, tiny_policy_dir, tiny_head_dir):
    # on the random tiny model MARS almost never sees its runner-up drafted (q is spread over
    # 49k tokens), so its ratios stay ~1 here; the overshoot cap relaxes the p < q draws.
    # MARS at theta 0.9 on the real model: test_mars_on_the_embedded_model (slow).
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, "overshoot", {"lenience": 0.3}, steps=1)
    inputs = [{"prompt": PROMPTS[i // 4]} for i in range(8)]
    out = trainer._generate_and_score_completions(inputs)
    batch = trainer.rollouts.last_batch
    mask = out["completion_mask"].bool()
    # what TRL divides by is our behaviour log-prob, token for token
    assert torch.allclose(out["sampling_per_token_logps"][mask], batch.behaviour_logprobs[batch.completion_mask])
    ratios = trainer.importance_ratios(out)[mask]
    assert (ratios - 1).abs().max() > 1e-2 and batch.relaxed.any()
    assert ratios.max() <= 2.0 + 1e-6  # token_tis: truncated at cap
    with torch.no_grad():
        on = trainer.compute_loss(trainer.model, out).item()
        trainer.use_vllm = False  # TRL's gate: the same batch without the correction
        off = trainer.compute_loss(trainer.model, out).item()
    assert math.isfinite(on) and math.isfinite(off) and abs(on - off) > 1e-6


@pytest.mark.parametrize("mode, trl_mode, clip", [
    ("token_tis", "token_truncate", (None, 2.0)), ("token_mis", "token_mask", (0.5, 2.0)),
    ("seq_tis", "sequence_truncate", (None, 2.0)), ("seq_mis", "sequence_mask", (0.5, 2.0)),
])
def test_correction_modes_map_onto_trl(mode, trl_mode, clip):
    from trainers.trl import trl_correction

    got = trl_correction(CorrectionConfig(mode=mode, cap=2.0, low=0.5, high=2.0))
    assert got == {"mode": trl_mode, "clip_min": clip[0], "clip_max": clip[1]}
    assert trl_correction(CorrectionConfig(mode="none")) is None


# ---------------------------------------------------------------------------- weights
def _assert_same_logits(backend_logits: torch.Tensor, model, prompts) -> None:
    with torch.no_grad():
        ref = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts]).float()
    assert torch.allclose(backend_logits, ref, atol=1e-5), (backend_logits - ref).abs().max()


def test_in_process_backend_holds_the_trained_weights(tmp_path, tiny_policy_dir, tiny_head_dir):
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=1)
    prompts = [[1, 20, 300], [5, 6]]
    start = trainer.rollouts.backend.next_token_logits(prompts)
    trainer.train()
    after = trainer.rollouts.backend.next_token_logits(prompts)
    assert not torch.allclose(start, after, atol=1e-5)  # the step moved the logits ...
    _assert_same_logits(after, trainer.model, prompts)  # ... and the backend sees the new ones
    assert trainer.rollouts.backend.version == 0  # generated before the only optimizer step


def test_ray_pool_gets_the_weights_pushed(tmp_path, tiny_policy_dir, tiny_head_dir):
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=2, placement="ray")
        trainer.train()
        pool = trainer.rollouts.pool
        assert pool.version == 1  # pushed before the second step's generation
        ratios = _valid_ratios(trainer)  # the actors' rollouts were on-policy at both steps
        assert (ratios - 1).abs().max() < 1e-3
        prompts = [[1, 20, 300], [5, 6]]
        trainer.rollouts.sync(trainer)  # push the weights of the last step too
        for logits in pool.next_token_logits(prompts):
            _assert_same_logits(logits, trainer.model, prompts)
        trainer.rollouts.close()
    finally:
        ray.shutdown()


def test_draft_head_is_reloaded_between_steps(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    from rollout.backend import HFBackend

    loads = []
    original = HFBackend.load_drafter
    monkeypatch.setattr(HFBackend, "load_drafter", lambda self, path: (loads.append(path), original(self, path)))
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=3, reload_every=1)
    assert len(loads) == 1  # built with the head
    first = trainer.rollouts.backend.head
    trainer.train()
    assert loads == [str(tiny_head_dir)] * 3  # re-read before the generations of steps 2 and 3
    assert trainer.rollouts.backend.head is not first


def test_draft_head_trains_with_the_policy_and_resumes(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    from rollout.backend import HFBackend
    from rollout.eagle3 import load_eagle3

    loads = []
    original = HFBackend.load_drafter
    monkeypatch.setattr(HFBackend, "load_drafter", lambda self, path: (loads.append(path), original(self, path)))
    online = {"every": 1, "lr": 3e-3, "updates": 2, "batch_size": 4}
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=3, drafter_training=online,
                       save_strategy="steps", save_steps=2)
    initial = {k: v.clone() for k, v in trainer.rollouts.backend.head.state_dict().items()}
    trainer.train()
    export = str(tmp_path / "out" / "drafter")
    # trained after steps 1 and 2 (the latter before checkpoint-2 is written) and after step 3, before
    # the final checkpoint: each checkpoint holds the head the next generation drafts with
    assert loads == [str(tiny_head_dir), export, export, export]
    assert sorted(p.name for p in (tmp_path / "out").glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    held = trainer.rollouts.backend.head.state_dict()
    shipped = load_eagle3(export, trainer.rollouts.drafter.target).state_dict()
    assert any(not torch.equal(v, initial[k]) for k, v in held.items())
    for name, v in held.items():  # the backend drafts with the head trained here
        assert torch.equal(v, shipped[name]), name
    logged = [h for h in trainer.state.log_history if "speculative/drafter_est_tau" in h]
    assert len(logged) == 3 and all(h["speculative/drafter_est_tau"] >= 1 for h in logged), trainer.state.log_history
    assert "train_runtime" in logged[-1]  # the last round (at the final checkpoint) in TRL's final log
    saved = torch.load(tmp_path / "out" / "checkpoint-2" / "drafter_training.pt", weights_only=False)
    assert saved["trained_step"] == 2 and saved["rounds"] == 2
    trainer.rollouts.close()
    resumed = _trainer(tmp_path / "r", tiny_policy_dir, tiny_head_dir, steps=2, drafter_training=online)
    resumed.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-2"))  # nothing left to train
    assert resumed.rollouts.trained_step == 2 and resumed.rollouts.drafter.rounds == 2
    for name, v in resumed.rollouts.drafter.head.state_dict().items():
        assert torch.equal(v, saved["head"][name]), name
    assert loads[-1] == str(tmp_path / "r" / "out" / "drafter")  # the restored head is the one drafting


def test_an_evaluation_is_not_the_heads_training_batch(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    """With num_iterations 2 one generation serves steps 1 and 2, and the evaluation after step 1
    generates in between: the round after step 2 still trains on the training generation."""
    from trainers.grpo.online_drafter import OnlineDrafter
    from trainers.trl.rollouts import SpeculativeRollouts

    generations, trained = [], []
    call, train_on_batch = SpeculativeRollouts.__call__, OnlineDrafter.train_on_batch

    def generating(self, prompts, trainer):
        out = call(self, prompts, trainer)
        generations.append((trainer.model.training, self.last_batch))
        return out

    monkeypatch.setattr(SpeculativeRollouts, "__call__", generating)
    monkeypatch.setattr(OnlineDrafter, "train_on_batch",
                        lambda self, step, batch: (trained.append(batch), train_on_batch(self, step, batch))[1])
    evals = [[{"role": "user", "content": f"Name {i + 2} colours."}] for i in range(2)]
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=2, eval_prompts=evals,
                       drafter_training={"every": 1, "updates": 1, "batch_size": 4}, num_iterations=2,
                       eval_strategy="steps", eval_steps=1, per_device_eval_batch_size=4)
    trainer.train()
    modes = [training for training, _ in generations]
    assert modes[:2] == [True, False] and True not in modes[1:], modes  # one training generation, then evaluations
    assert len(trained) == 2 and all(b is generations[0][1] for b in trained)
    assert trainer.rollouts.last_batch is generations[-1][1]  # the metrics still describe the evaluation's


def test_generation_seeds_continue_after_a_resume(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    """The rollouts' generation count is checkpointed (without a trained head too): a resumed run
    draws the seeds the uninterrupted one drew, not its first steps' again."""
    import json

    from rollout.backend import HFBackend

    seeds = []
    original = HFBackend.generate
    monkeypatch.setattr(HFBackend, "generate",
                        lambda self, *a, **kw: (seeds.append(kw["seed"]), original(self, *a, **kw))[1])
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=3, save_strategy="steps", save_steps=2)
    trainer.train()
    uninterrupted, seeds[:] = list(seeds), []
    assert len(set(uninterrupted)) == 3
    ckpt = tmp_path / "out" / "checkpoint-2"
    assert json.loads((ckpt / "speculative_rollouts.json").read_text()) == {"generations": 2}
    resumed = _trainer(tmp_path / "r", tiny_policy_dir, tiny_head_dir, steps=3)
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert seeds == uninterrupted[2:]


def test_a_resume_reports_a_trained_head_it_lacks_or_does_not_use(tmp_path, tiny_policy_dir, tiny_head_dir, capsys):
    online = {"every": 1, "updates": 1, "batch_size": 4}
    _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=1, drafter_training=online, save_strategy="steps",
             save_steps=1).train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    capsys.readouterr()
    _trainer(tmp_path / "a", tiny_policy_dir, tiny_head_dir, steps=1).train(resume_from_checkpoint=str(ckpt))
    out = capsys.readouterr().out
    assert ("note: checkpoint-1 holds the head trained so far (drafter_training.pt); with drafter_training.every 0 "
            f"the rollouts draft with the configured head ({tiny_head_dir}) instead") in out, out
    assert "warning" not in out
    (ckpt / "drafter_training.pt").unlink()
    (ckpt / "speculative_rollouts.json").unlink()
    resumed = _trainer(tmp_path / "b", tiny_policy_dir, tiny_head_dir, steps=1, drafter_training=online)
    resumed.train(resume_from_checkpoint=str(ckpt))
    out = capsys.readouterr().out
    assert ("warning: checkpoint-1 holds no trained head (drafter_training.pt): drafter_training starts again from "
            f"the configured head ({tiny_head_dir})") in out, out
    assert "warning: checkpoint-1 holds no speculative_rollouts.json: the generation seeds start again" in out
    assert resumed.rollouts.trained_step == 0 and "note" not in out


def test_our_checkpoint_state_is_written_whole_and_before_trls(tmp_path, tiny_policy_dir, tiny_head_dir, monkeypatch):
    """A kill inside TRL's checkpoint leaves ours complete; a failed write keeps the previous file."""
    from trl import GRPOTrainer

    class Killed(Exception):
        pass

    def killed(self, model, trial):
        raise Killed

    monkeypatch.setattr(GRPOTrainer, "_save_checkpoint", killed)
    trainer = _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, steps=1, save_strategy="steps", save_steps=1,
                       drafter_training={"every": 1, "updates": 1, "batch_size": 4})
    with pytest.raises(Killed):
        trainer.train()
    ckpt = tmp_path / "out" / "checkpoint-1"
    assert sorted(p.name for p in ckpt.iterdir()) == ["drafter_training.pt", "speculative_rollouts.json"]
    saved = torch.load(ckpt / "drafter_training.pt", weights_only=False)
    assert saved["trained_step"] == 1

    def torn(obj, f, *args, **kwargs):
        with open(f, "wb") if isinstance(f, (str, os.PathLike)) else f as out:
            out.write(b"torn")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", torn)
    with pytest.raises(OSError, match="disk full"):
        trainer._save_checkpoint(trainer.model, None)
    monkeypatch.undo()
    again = torch.load(ckpt / "drafter_training.pt", weights_only=False)  # the previous file, whole
    assert again["trained_step"] == 1 and again["rounds"] == saved["rounds"]


def test_head_training_and_reloading_are_exclusive():
    from trainers.trl import RolloutSettings

    with pytest.raises(ConfigError, match="drafter_reload_every") as err:
        RolloutSettings(drafter_reload_every=1, drafter_training=OnlineDrafterConfig(every=1))
    assert err.value.field == "drafter_reload_every"
    with pytest.raises(ConfigError) as err:
        RolloutSettings(spec=SpecConfig(mode="off"), drafter_training=OnlineDrafterConfig(every=1))
    assert err.value.field == "drafter_training.every"


# ---------------------------------------------------------------------------- refusals
def test_geo_mis_is_refused_naming_the_setting(tmp_path, tiny_policy_dir, tiny_head_dir):
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, correction=CorrectionConfig(mode="geo_mis"))
    assert err.value.field == "correction.mode" and "token_tis" in str(err.value)


def test_use_vllm_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir):
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, use_vllm=True)
    assert "use_vllm" in str(err.value)


def test_sampling_trl_does_not_apply_is_refused(tmp_path, tiny_policy_dir, tiny_head_dir):
    with pytest.raises(ConfigError) as err:
        _trainer(tmp_path, tiny_policy_dir, tiny_head_dir, top_p=0.9)
    assert err.value.field == "GRPOConfig.top_p"


def test_head_for_another_model_is_refused(tmp_path, tiny_policy_dir):
    from rollout.eagle3 import default_head_path

    with pytest.raises(Exception) as err:  # the SmolLM2 head: hidden size 576, the tiny policy's is 64
        _trainer(tmp_path, tiny_policy_dir, default_head_path())
    assert "hidden" in str(err.value).lower() or "mismatch" in str(err.value).lower(), str(err.value)


def test_unknown_verifier_is_refused():
    with pytest.raises(ConfigError) as err:
        VerifierConfig("mystery")
    assert "mars" in str(err.value)


# ---------------------------------------------------------------------------- real model
@pytest.mark.slow
def test_mars_on_the_embedded_model(tmp_path):
    """MARS at theta 0.9 with the embedded SmolLM2 and the shipped head: ratios differ from 1."""
    from rollout.eagle3 import default_head_path
    from rollout.models import embedded_cache_dir, load_embedded_target

    load_embedded_target()  # builds the safetensors cache the trainer loads from
    trainer = _trainer(tmp_path, embedded_cache_dir(), default_head_path(), "mars", {"theta": 0.9}, steps=1,
                       max_completion_length=32)
    out = trainer._generate_and_score_completions([{"prompt": PROMPTS[i // 4]} for i in range(8)])
    ratios = trainer.importance_ratios(out)[out["completion_mask"].bool()]
    assert trainer.rollouts.last_batch.relaxed.any()
    assert (ratios - 1).abs().max() > 1e-2


def test_truncation_uses_the_cap_and_masking_the_bounds():
    """cap and high are different settings: a truncating mode clips at cap, a masking one keeps
    [low, high]."""
    from trainers.trl import trl_correction

    cfg = dict(cap=3.0, low=0.25, high=1.5)
    assert trl_correction(CorrectionConfig(mode="token_tis", **cfg)) == {
        "mode": "token_truncate", "clip_min": None, "clip_max": 3.0}
    assert trl_correction(CorrectionConfig(mode="seq_tis", **cfg))["clip_max"] == 3.0
    assert trl_correction(CorrectionConfig(mode="token_mis", **cfg)) == {
        "mode": "token_mask", "clip_min": 0.25, "clip_max": 1.5}
    assert trl_correction(CorrectionConfig(mode="seq_mis", **cfg))["clip_min"] == 0.25


def test_rollouts_sample_at_trls_temperature():
    """TRL recomputes log-probs at args.temperature; the rollouts must sample at the same one."""
    from types import SimpleNamespace

    from trainers.trl.rollouts import sampling_from_trl

    args = SimpleNamespace(top_p=1.0, top_k=None, min_p=None, repetition_penalty=1.0, temperature=0.7,
                           max_completion_length=16)
    s = sampling_from_trl(args, eos_token_id=2)
    assert (s.temperature, s.max_new_tokens, tuple(s.stop_token_ids)) == (0.7, 16, (2,))


def test_speculative_metrics_are_kl_of_behaviour_to_policy_and_ess_of_trls_ratios():
    """The logged drift on hand-built log-probs: k1 = mean(log P - log pi_old) and
    k3 = mean(r - 1 - log r) with r = pi_old / P over the valid tokens; ESS of TRL's ratios."""
    from collections import defaultdict
    from types import SimpleNamespace

    from trainers.trl.trainer import SpeculativeGRPOTrainer

    mask = torch.tensor([[1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    sampled = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
    log_r = torch.tensor([[0.5, -0.2, 0.0], [1.0, -0.4, 9.0]])  # the 9.0 is padding
    old = sampled + log_r
    ratio = torch.tensor([[1.5, 0.8, 1.0], [2.0, 0.7, 5.0]])
    relaxed = torch.tensor([[True, False, False], [True, True, True]])
    batch = RolloutBatch(prompt_ids=torch.ones(2, 2, dtype=torch.long), prompt_mask=torch.ones(2, 2, dtype=torch.bool),
                         completion_ids=torch.ones(2, 3, dtype=torch.long), completion_mask=mask,
                         behaviour_logprobs=sampled, target_logprobs=sampled, kinds=torch.zeros(2, 3, dtype=torch.int8),
                         relaxed=relaxed, finish_reasons=["length"] * 2, tau=2.5, timings={"tokens": 5.0})
    trainer = SpeculativeGRPOTrainer.__new__(SpeculativeGRPOTrainer)  # only what the metrics read
    trainer.rollouts = SimpleNamespace(last_batch=batch, last_seconds=0.5, drafter_metrics={"drafter_est_tau": 2.5})
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    trainer.model = SimpleNamespace(training=True)
    trainer._log_rollout_metrics({"old_per_token_logps": old, "sampling_per_token_logps": sampled,
                                  "completion_mask": mask.long(), "importance_sampling_ratio": ratio})
    m = trainer._metrics["train"]
    lr = log_r[mask].double()
    assert m["speculative/kl_k1"] == [pytest.approx(float(-lr.mean()), abs=1e-6)]
    assert m["speculative/kl_k3"] == [pytest.approx(float((lr.exp() - 1 - lr).mean()), abs=1e-6)]
    w = ratio[mask].double()
    assert m["speculative/is_ess"] == [pytest.approx(float(w.sum() ** 2 / (5 * (w ** 2).sum())), abs=1e-6)]
    assert m["speculative/relaxed_fraction"] == [pytest.approx(3 / 5)]  # not the padded flag: 4 / 6
    assert m["speculative/tau"] == [2.5] and m["speculative/rollout_tokens_per_s"] == [pytest.approx(10.0)]
    # the head's training round is logged once, with the batch after it
    assert m["speculative/drafter_est_tau"] == [2.5] and trainer.rollouts.drafter_metrics == {}
