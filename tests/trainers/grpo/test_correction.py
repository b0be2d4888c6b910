"""Off-policy correction: each mode on hand-built inputs, the training metrics, the
on-policy check, and a statistical check against an exact policy gradient: a one-step
bandit whose samples come from the real verifiers (lossy rules, so P != pi).
"""

import math

import pytest
import torch

from rollout.config import ConfigError, from_dict
from trainers.grpo.correction import MODES, CorrectionConfig, importance_weights
from trainers.grpo.loss import policy_loss
from trainers.grpo.metrics import relaxed_fraction, reward_stats
from verifiers import get_rule, induced_chain, verify_chain

# Per-token ratios pi_old / P of four sequences; 0 marks padding. Products: 6, 0.75, 0.8,
# 0.02; geometric means: 1.82, 0.87, 0.93, 0.14.
RATIOS = [[1.0, 3.0, 2.0], [0.5, 1.5, 0.0], [4.0, 0.1, 2.0], [0.1, 0.2, 0.0]]
MASK = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)


def _hand_built():
    r = torch.tensor(RATIOS, dtype=torch.float64)
    behaviour = torch.where(MASK, torch.tensor(-0.0, dtype=torch.float64), -math.inf)
    logp_old = torch.where(MASK, torch.log(r.clamp(min=1e-30)), 0.0)  # log r exactly
    return logp_old, behaviour


def _expected(mode):
    """(weights, keep) worked out by hand for cap 2, bounds [0.5, 2] (inclusive)."""
    valid = MASK.double()

    def t(rows):
        return torch.tensor(rows, dtype=torch.float64)
    if mode == "none":
        return valid, MASK
    if mode == "token_tis":
        return t([[1, 2, 2], [0.5, 1.5, 0], [2, 0.1, 2], [0.1, 0.2, 0]]), MASK
    if mode == "token_mis":
        keep = torch.tensor([[1, 0, 1], [1, 1, 0], [0, 0, 1], [0, 0, 0]], dtype=torch.bool)
        return t([[1, 0, 2], [0.5, 1.5, 0], [0, 0, 2], [0, 0, 0]]), keep
    if mode == "seq_tis":
        return t([[2.0], [0.75], [0.8], [0.02]]) * valid, MASK
    if mode == "seq_mis":
        keep = MASK & torch.tensor([[False], [True], [True], [False]])
        return t([[0.0], [0.75], [0.8], [0.0]]) * valid, keep
    assert mode == "geo_mis"  # rows 0-2 pass the geometric-mean test, row 3 does not
    keep = MASK & torch.tensor([[True], [True], [True], [False]])
    return t([[1, 2, 2], [0.5, 1.5, 0], [2, 0.1, 2], [0, 0, 0]]), keep


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_on_hand_built_ratios(mode):
    logp_old, behaviour = _hand_built()
    cfg = CorrectionConfig(mode=mode, cap=2.0, low=0.5, high=2.0)
    w, keep, stats = importance_weights(logp_old, behaviour, MASK, cfg)
    want_w, want_keep = _expected(mode)
    assert torch.equal(keep, want_keep)
    assert torch.allclose(w, want_w, rtol=1e-12, atol=0)
    assert not w.requires_grad
    kept = want_w[want_keep].double()
    assert stats["is_masked_frac"] == pytest.approx(1 - want_keep.sum().item() / MASK.sum().item())
    assert stats["is_weight_max"] == pytest.approx(kept.max().item())
    assert stats["is_weight_min"] == pytest.approx(kept.min().item())
    valid_w = want_w[MASK].double()
    assert stats["is_ess"] == pytest.approx((valid_w.sum() ** 2 / (10 * (valid_w ** 2).sum())).item())
    log_r = torch.log(torch.tensor([r for row in RATIOS for r in row if r > 0], dtype=torch.float64))
    assert stats["log_ratio_mean"] == pytest.approx(log_r.mean().item())


def test_truncation_and_bounds_follow_the_config():
    logp_old, behaviour = _hand_built()
    w, keep, _ = importance_weights(logp_old, behaviour, MASK, CorrectionConfig("token_tis", cap=3.5))
    assert w[2, 0] == 3.5 and w[0, 1].item() == pytest.approx(3.0, rel=1e-12)
    w, keep, _ = importance_weights(logp_old, behaviour, MASK,
                                    CorrectionConfig("token_mis", low=0.0, high=1.0))
    assert torch.equal(keep, MASK & (torch.tensor(RATIOS) <= 1.0))
    w, keep, _ = importance_weights(logp_old, behaviour, MASK,
                                    CorrectionConfig("seq_mis", low=0.01, high=10.0))
    assert torch.equal(keep, MASK)
    assert w[0, 0] == pytest.approx(6.0) and w[3, 1] == pytest.approx(0.02)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_policy_weights_are_exactly_one_and_change_nothing(mode, dtype):
    gen = torch.Generator().manual_seed(0)
    logp_old = -torch.rand(5, 40, generator=gen).mul(6).to(dtype)  # [N, T]
    mask = torch.rand(5, 40, generator=gen) < 0.8
    mask[:, 0] = True
    w, keep, stats = importance_weights(logp_old, logp_old.clone(), mask, CorrectionConfig(mode))
    assert torch.equal(keep, mask)
    assert torch.equal(w[mask], torch.ones(int(mask.sum()), dtype=dtype))
    assert stats["is_ess"] == 1.0 and stats["is_masked_frac"] == 0.0
    assert stats["kl_k1"] == 0.0 and stats["kl_k3"] == 0.0
    # the corrected loss and gradient equal the uncorrected ones, bit for bit
    old = logp_old.float()
    adv = torch.randn(5, generator=gen)
    grads, losses = [], []
    for weights in (None, w.float()):
        new = (old + 0.05 * torch.randn(5, 40, generator=torch.Generator().manual_seed(1))).requires_grad_()
        loss, _ = policy_loss(new, old, adv, mask, is_weights=weights)
        loss.backward()
        losses.append(loss.item())
        grads.append(new.grad)
    assert losses[0] == losses[1] and torch.equal(grads[0], grads[1])


@pytest.mark.parametrize("mode", MODES)
def test_long_sequences_do_not_overflow(mode):
    T = 5_000
    logp_old = torch.full((3, T), -1.0)
    behaviour = logp_old - torch.tensor([[0.5], [-0.5], [0.0]])  # log r = +0.5, -0.5, 0 per token
    mask = torch.ones(3, T, dtype=torch.bool)
    cfg = CorrectionConfig(mode, cap=2.0, low=0.5, high=2.0)
    w, keep, stats = importance_weights(logp_old, behaviour, mask, cfg)
    assert torch.isfinite(w).all() and all(math.isfinite(v) for v in stats.values())
    if mode == "seq_tis":  # products e^2500 and e^-2500: capped at 2, and 0
        assert torch.all(w[0] == 2.0) and torch.all(w[1] == 0.0) and torch.all(w[2] == 1.0)
    if mode == "seq_mis":
        assert keep[2].all() and not keep[:2].any()
    if mode == "geo_mis":  # geometric means e^0.5 = 1.65 and e^-0.5 = 0.61 are inside [0.5, 2]
        assert keep.all() and torch.allclose(w[1], torch.tensor(math.exp(-0.5)))


def test_bad_inputs_name_the_problem():
    cfg = CorrectionConfig()
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="shape"):
        importance_weights(x, torch.zeros(2, 4), torch.ones(2, 3, dtype=torch.bool), cfg)
    bad = x.clone()
    bad[1, 2] = -math.inf
    with pytest.raises(ValueError, match=r"behaviour_logp .*row 1, position 2"):
        importance_weights(x, bad, torch.ones(2, 3, dtype=torch.bool), cfg)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mask[1, 2] = False  # -inf behind the mask (padding) is fine
    w, _, _ = importance_weights(x, bad, mask, cfg)
    assert w[1, 2] == 0 and w[0, 0] == 1


@pytest.mark.parametrize("kwargs, field, words", [
    ({"mode": "tis"}, "mode", "allowed: none, token_tis, token_mis, seq_tis, seq_mis, geo_mis"),
    ({"cap": 0.5}, "cap", ">= 1"),
    ({"cap": "2"}, "cap", ">= 1"),
    ({"low": -0.1}, "low", "[0, 1]"),
    ({"low": 1.5}, "low", "[0, 1]"),
    ({"high": 0.9}, "high", ">= 1"),
    ({"low": 1.0, "high": 1.0}, "low", "below high"),
])
def test_config_errors_name_the_field(kwargs, field, words):
    with pytest.raises(ConfigError, match=f"'{field}'") as err:
        CorrectionConfig(**kwargs)
    assert err.value.field == field and words in str(err.value)
    with pytest.raises(ConfigError, match=f"'correction.{field}'"):
        from_dict(CorrectionConfig, kwargs, prefix="correction")


def test_relaxed_fraction_and_reward_stats():
    relaxed = torch.tensor([[True, False, True], [False, False, True]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    assert relaxed_fraction(relaxed, mask) == 0.5
    assert relaxed_fraction(relaxed, torch.zeros_like(mask)) == 0.0
    rewards = torch.tensor([[1.0, 0.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0], [1.1, 0.1, 0.1, 0.1]])
    s = reward_stats(rewards)
    assert s["accuracy"] == pytest.approx(4 / 12)
    assert s["reward_mean"] == pytest.approx(rewards.mean().item())
    # the std of the step's rewards as a population (divisor B x G, not B x G - 1): a description of this batch,
    # not the group std of the advantages (unbiased, loss.py)
    mean = sum(rewards.flatten().tolist()) / 12
    assert s["reward_std"] == pytest.approx((sum((r - mean) ** 2 for r in rewards.flatten().tolist()) / 12) ** 0.5)
    assert (s["reward_min"], s["reward_max"]) == (0.0, pytest.approx(1.1))
    assert s["groups_zero_std_frac"] == pytest.approx(1 / 3)
    assert s["groups_any_correct_frac"] == pytest.approx(2 / 3)
    s = reward_stats(rewards.flatten(), correct=rewards.flatten() > 0.5)
    assert s["accuracy"] == pytest.approx(4 / 12) and "groups_zero_std_frac" not in s


# ---------------------------------------------------------------------------------------
# One-step bandit: vocabulary V = 6, policy pi = softmax(THETA), reward R(y). The exact
# on-policy gradient of E_{y~pi}[R(y)] w.r.t. the logits is pi * (R - <pi, R>). Samples
# come from verify_chain with K = 1: a draft token x ~ q, then position 0 is emitted from
# the rule's induced P with behaviour log-prob log P(y). An estimator that weights each
# sample's term R(y) grad log pi(y) by f(y) has mean sum_y P(y) f(y) R(y) (e_y - pi) and
# per-sample variance that the tests enumerate exactly, so every bound below is exact.
# THETA's top-2 logits are 2.0 and 1.6 (ratio 0.8 > theta = 0.5): MARS relaxes.
THETA = torch.tensor([2.0, 1.6, 0.5, 0.0, -0.5, 1.0])
DRAFT = torch.tensor([0.0, 2.5, 0.3, 1.0, -1.0, 0.2])  # q over-weights token 1
REWARD = torch.tensor([1.0, 0.0, 0.5, 2.0, -1.0, 0.3], dtype=torch.float64)
SIZES = (1_000, 10_000, 100_000)


def _pi() -> torch.Tensor:
    return torch.softmax(THETA.double(), 0)


def _exact_gradient() -> torch.Tensor:
    pi = _pi()
    return pi * (REWARD - pi @ REWARD)


def _sample(rule, draft, n, seed, top_k=None):
    """n emitted tokens at position 0 and their behaviour log-probs, from the real verifier."""
    gen = torch.Generator().manual_seed(seed)
    V = THETA.numel()
    q = torch.softmax(draft, 0)
    x = torch.multinomial(q.expand(n, V), 1, replacement=True, generator=gen)  # [n, 1]
    target = THETA.expand(n, 2, V).contiguous()  # [n, K+1, V]
    res = verify_chain(rule, target, draft.expand(n, 1, V).contiguous(), x,
                       temperature=1.0, top_k=top_k, generator=gen)
    return res.tokens[:, 0], res.behaviour_logprobs[:, 0].double()  # [n], [n]


def _estimate(y, behaviour, cfg) -> torch.Tensor:
    """minus the gradient of the corrected GRPO loss (ratio 1, advantage R(y)) w.r.t. THETA."""
    theta = THETA.double().clone().requires_grad_()
    logp = torch.log_softmax(theta, 0)[y].unsqueeze(1)  # [n, 1]
    mask = torch.ones_like(logp, dtype=torch.bool)
    w, _, _ = importance_weights(logp.detach(), behaviour.unsqueeze(1), mask, cfg)
    loss, _ = policy_loss(logp, logp.detach(), REWARD[y], mask, is_weights=w)
    loss.backward()
    return -theta.grad


def _moments(P, f):
    """Mean and per-sample std (trace of the covariance) of the estimator weighting by f(y)."""
    pi = _pi()
    X = (f * REWARD)[:, None] * (torch.eye(len(pi), dtype=torch.float64) - pi)  # [V, V], row y
    mean = P @ X
    sd = (P @ ((X - mean) ** 2).sum(1)).sqrt()
    return mean, sd


def _induced(rule, draft, top_k=None) -> torch.Tensor:
    return induced_chain(rule, THETA[None], draft[None], temperature=1.0, top_k=top_k)[0].double()


@pytest.mark.parametrize("rule", [get_rule("mars", theta=0.5), get_rule("overshoot", lenience=0.3)],
                         ids=["mars", "overshoot"])
def test_corrected_gradient_converges_to_the_on_policy_gradient(rule):
    P = _induced(rule, DRAFT)
    pi, g = _pi(), _exact_gradient()
    assert (P > 0).all()  # chain sampling with a full-support q: P covers pi's support
    ratio = pi / P
    y, behaviour = _sample(rule, DRAFT, SIZES[-1], seed=11)
    assert torch.allclose(behaviour.exp(), P[y], atol=1e-5)  # the recorded log-prob is log P(y)
    big_cap = float(ratio.max()) * 1.01  # large enough: never truncates
    small_cap = float(ratio.max()) * 0.6  # truncates the largest ratio: biased
    cases = {
        "uncapped": (CorrectionConfig("token_tis", cap=math.inf), ratio),
        "capped": (CorrectionConfig("token_tis", cap=big_cap), ratio),
        "small_cap": (CorrectionConfig("token_tis", cap=small_cap), ratio.clamp(max=small_cap)),
        "none": (CorrectionConfig("none"), torch.ones_like(ratio)),
    }
    errors = {}
    for name, (cfg, f) in cases.items():
        mean, sd = _moments(P, f)
        errors[name] = []
        for n in SIZES:
            estimate = _estimate(y[:n], behaviour[:n], cfg)
            err = float((estimate - mean).norm())
            assert err <= 4 * sd / math.sqrt(n), (name, n, err)  # error ~ 1/sqrt(n)
            errors[name].append(float((estimate - g).norm()))
        if name in ("uncapped", "capped"):
            assert torch.allclose(mean, g, atol=1e-12)  # unbiased: converges to g itself
            assert errors[name][-1] < errors[name][0]
        else:  # converges to something else: its bias is far above the sampling error
            bias = float((mean - g).norm())
            assert bias > 10 * sd / math.sqrt(SIZES[-1]), (name, bias)
            assert errors[name][-1] > 0.5 * bias
    assert errors["uncapped"][-1] < 0.2 * errors["none"][-1]


def test_uncovered_support_is_what_limits_the_correction():
    """Where P(y) = 0 but pi(y) > 0 no weight can help: the corrected estimate converges to
    the gradient restricted to supp(P), and what it misses is pi's uncovered mass times
    the rewards there. Two ways to lose support through the real verifier:
    - MARS point masses: the draft puts all its mass on the top-2 tokens {v1, v2} (q = 0
      elsewhere, as outside an EAGLE-3 draft vocabulary); MARS relaxes and accepts the
      draft outright, so P = q on {v1, v2} and 0 elsewhere;
    - truncation: top-k = 3 sampling on the target (lossless), P = p truncated to 3 tokens.
    """
    pi, g = _pi(), _exact_gradient()
    point_draft = torch.tensor([0.0, 0.3, -math.inf, -math.inf, -math.inf, -math.inf])
    cases = {"mars_point_masses": (get_rule("mars", theta=0.5), point_draft, None),
             "top_k": (get_rule("lossless"), DRAFT, 3)}
    cfg = CorrectionConfig("token_tis", cap=math.inf)
    for name, (rule, draft, top_k) in cases.items():
        P = _induced(rule, draft, top_k)
        covered = P > 0
        uncovered_mass = float(pi[~covered].sum())
        assert 0.1 < uncovered_mass < 0.6, (name, uncovered_mass)
        f = torch.where(covered, pi / P.clamp(min=1e-300), 0.0)
        mean, sd = _moments(P, f)
        # what the estimator converges to: the on-policy gradient restricted to supp(P)
        restricted = ((pi * REWARD)[:, None] * (torch.eye(6, dtype=torch.float64) - pi))[covered].sum(0)
        assert torch.allclose(mean, restricted, atol=1e-12)
        y, behaviour = _sample(rule, draft, SIZES[-1], seed=5, top_k=top_k)
        assert covered[y].all()
        estimate = _estimate(y, behaviour, cfg)
        assert float((estimate - mean).norm()) <= 4 * sd / math.sqrt(SIZES[-1])
        # the remaining error is the uncovered part, bounded by the uncovered mass
        missing = float((g - mean).norm())
        assert missing > 10 * sd / math.sqrt(SIZES[-1])
        assert missing <= math.sqrt(2) * float((pi * REWARD.abs())[~covered].sum()) + 1e-12
        assert missing <= math.sqrt(2) * uncovered_mass * float(REWARD.abs().max())
        assert float((estimate - g).norm()) > 0.5 * missing


def test_geo_mis_takes_the_geometric_mean_over_valid_tokens_only():
    """Padding is not part of a sequence: a one-token sequence with ratio 0.25 (or 3) has
    geometric mean 0.25 (or 3), outside [0.5, 2], whatever the padded width; averaging over the
    width (here 4) would give 0.71 (or 1.32) and keep it."""
    ratios = torch.tensor([[0.25, 1.0, 1.0, 1.0], [3.0, 1.0, 1.0, 1.0], [0.8, 1.5, 1.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    behaviour = torch.where(mask, torch.tensor(-1.0, dtype=torch.float64), 0.0)
    logp_old = behaviour + torch.log(ratios)
    for width in (1, 2, 4):  # the same sequences padded to different widths: the same result
        w, keep, stats = importance_weights(logp_old[:, :width], behaviour[:, :width], mask[:, :width],
                                            CorrectionConfig("geo_mis", cap=2.0, low=0.5, high=2.0))
        assert keep[:, 0].tolist() == [False, False, True], width
        assert w[2, 0].item() == pytest.approx(0.8, rel=1e-12)
        if width > 1:
            assert w[2, 1].item() == pytest.approx(1.5, rel=1e-12)  # sqrt(0.8 * 1.5) = 1.1 is inside
        assert stats["is_masked_frac"] == pytest.approx(2 / (2 + min(width, 2)))


def test_relaxed_flags_on_padding_do_not_count():
    relaxed = torch.tensor([[False, True, True], [True, True, True]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    assert relaxed_fraction(relaxed, mask) == pytest.approx(2 / 3)
    assert relaxed_fraction(~relaxed, mask) == pytest.approx(1 / 3)


@pytest.mark.parametrize("mode", MODES)
def test_a_token_outside_the_trainers_support_gets_weight_zero(mode):
    """logp_old = -inf (the trainer's top-p cut, from its own logits, left out a token the rollout
    kept): pi_old(y) / P(y) = 0, never a crash, and the loss and its gradient stay finite."""
    cfg = CorrectionConfig(mode=mode)
    behaviour = torch.full((2, 3), -1.0)
    old = torch.full((2, 3), -1.1)
    old[1, 1] = -math.inf
    mask = torch.ones(2, 3, dtype=torch.bool)
    w, keep, stats = importance_weights(old, behaviour, mask, cfg)
    assert w[1, 1] == 0 and not keep[1, 1]
    if mode in ("seq_tis", "seq_mis"):  # the sequence's product is 0
        assert not w[1].any()
    else:
        assert torch.equal(w[0], importance_weights(old[:1], behaviour[:1], mask[:1], cfg)[0][0])
    assert stats["is_outside_support_frac"] == pytest.approx(1 / 6)
    assert all(math.isfinite(v) for v in stats.values()), stats
    new = old.clone().requires_grad_(True)
    loss, pg = policy_loss(new, old, torch.tensor([1.0, -1.0]), mask, is_weights=w,
                           ref_logp=torch.full((2, 3), -1.0), kl_coef=0.1)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(new.grad).all() and new.grad[1, 1] == 0
    assert all(math.isfinite(v) for v in pg.values()), pg
    nan = old.clone()
    nan[0, 2] = math.nan
    with pytest.raises(ValueError, match=r"logp_old .*row 0, position 2"):
        importance_weights(nan, behaviour, mask, cfg)


def test_the_trainers_top_p_logprob_of_a_cut_token_is_corrected_not_fatal():
    """End to end on a real model: a token the trainer's top-p leaves out gets log pi = -inf from
    ``completion_logprobs``, weight 0 here, and a finite loss and gradient."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainers.grpo.policy import completion_logprobs

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    prompt = [[3, 4, 5]]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor(prompt)).logits[0, -1], -1)
    ranked = probs.argsort(descending=True)
    with torch.no_grad():
        after = int(model(torch.tensor([prompt[0] + [int(ranked[1])]])).logits[0, -1].argmax())
    outs = [[int(ranked[1]), after]]  # the runner-up (outside a top-p that keeps the top token alone), a top token
    logp, mask = completion_logprobs(model, prompt, outs, temperature=1.0, top_p=float(probs[ranked[0]]) * 0.999,
                                     share_prompts=False)
    assert logp[0, 0].item() == -math.inf and math.isfinite(logp[0, 1].item())
    w, keep, stats = importance_weights(logp.detach(), torch.full_like(logp, -4.0), mask, CorrectionConfig())
    loss, _ = policy_loss(logp, logp.detach(), torch.tensor([1.0]), mask, is_weights=w)
    loss.backward()
    assert math.isfinite(loss.item()) and w[0, 0] == 0 and stats["is_outside_support_frac"] == 0.5
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
