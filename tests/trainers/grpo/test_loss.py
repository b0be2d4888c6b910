"""GRPO: advantages, aggregation, clipping, the KL term and config validation, on
hand-built inputs whose values are worked out in the tests."""

import pytest
import torch

from rollout.config import ConfigError, from_dict
from trainers.grpo.loss import GRPOConfig, group_advantages, policy_loss


def test_advantages_with_and_without_std_scaling():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 3.0]])
    centred = group_advantages(rewards, scale_std=False)
    assert torch.allclose(centred, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0.0] * 4,
                                                 [-0.75, -0.75, -0.75, 2.25]]))
    scaled = group_advantages(rewards, scale_std=True, eps=0.0 + 1e-12)
    std0 = torch.tensor([1.0, 0.0, 0.0, 1.0]).std()  # unbiased: sqrt(1/3)
    assert torch.allclose(scaled[0], centred[0] / std0)
    assert torch.equal(scaled[1], torch.zeros(4))  # identical rewards: 0, not NaN
    assert torch.allclose(scaled[2].std(), torch.tensor(1.0))
    assert torch.isfinite(scaled).all()


def test_advantages_flat_input_groups_and_edge_cases():
    flat = torch.tensor([1.0, 0.0, 3.0, 3.0, 0.0, 2.0])
    a = group_advantages(flat, 2, scale_std=False)
    assert a.shape == (3, 2)
    assert torch.equal(a, torch.tensor([[0.5, -0.5], [0.0, 0.0], [-1.0, 1.0]]))
    assert torch.equal(group_advantages(torch.tensor([[5.0], [1.0]])), torch.zeros(2, 1))
    assert group_advantages(torch.tensor([[1, 0]]), scale_std=False).dtype == torch.float32
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(flat, 4)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(flat)
    with pytest.raises(ValueError, match="NaN"):
        group_advantages(torch.tensor([[1.0, float("nan")]]))


def _inputs():
    logp_old = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, -9.0]])
    logp_new = (logp_old + torch.tensor([[0.0, 0.5, -0.5], [0.1, -0.1, 50.0]])).requires_grad_()
    mask = torch.tensor([[True, True, True], [True, True, False]])
    adv = torch.tensor([1.0, -2.0])
    return logp_new, logp_old, adv, mask


def _manual_per_token(logp_new, logp_old, adv, lo, hi):
    r = torch.exp(logp_new - logp_old)
    a = adv[:, None]
    return torch.maximum(-a * r, -a * r.clamp(1 - lo, 1 + hi))


def test_token_and_sequence_aggregation():
    logp_new, logp_old, adv, mask = _inputs()
    per = _manual_per_token(logp_new, logp_old, adv, 0.2, 0.2).detach()
    tok, stats = policy_loss(logp_new, logp_old, adv, mask, aggregation="token")
    assert tok.item() == pytest.approx((per[0].sum() + per[1, :2].sum()).item() / 5, rel=1e-5)
    seq, _ = policy_loss(logp_new, logp_old, adv, mask, aggregation="sequence")
    assert seq.item() == pytest.approx((per[0].mean() + per[1, :2].mean()).item() / 2)
    assert tok.item() != pytest.approx(seq.item())
    # the huge log ratio outside the mask neither leaks in nor overflows
    assert torch.isfinite(tok) and stats["ratio_max"] < 2.0


def test_sequence_aggregation_skips_empty_sequences():
    logp_new, logp_old, adv, mask = _inputs()
    mask3 = torch.cat([mask, torch.zeros(1, 3, dtype=torch.bool)])
    args3 = (torch.cat([logp_new, logp_new[:1]]), torch.cat([logp_old, logp_old[:1]]),
             torch.cat([adv, torch.tensor([7.0])]), mask3)
    with_empty, _ = policy_loss(*args3, aggregation="sequence")
    without, _ = policy_loss(logp_new, logp_old, adv, mask, aggregation="sequence")
    assert with_empty.item() == pytest.approx(without.item())
    empty, _ = policy_loss(logp_new, logp_old, adv, torch.zeros_like(mask))
    assert empty.item() == 0.0


def test_clipping_zeroes_the_gradient_outside_the_trust_region():
    # token 0: A > 0 and r = e^0.5 > 1.28 -> clipped, no gradient; token 1: inside
    logp_old = torch.tensor([[-1.0, -1.0], [-1.0, -1.0]])
    logp_new = (logp_old + torch.tensor([[0.5, 0.1], [-0.5, -0.1]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    loss, stats = policy_loss(logp_new, logp_old, adv, mask, clip_low=0.2, clip_high=0.28)
    loss.backward()
    g = logp_new.grad
    # row 0 token 0: ratio above 1 + 0.28 with A > 0; row 1 token 0: below 1 - 0.2 with A < 0
    assert g[0, 0] == 0 and g[1, 0] == 0
    # inside the region d/dlogp of -A r / 4 is -A r / 4
    assert g[0, 1].item() == pytest.approx(-torch.exp(torch.tensor(0.1)).item() / 4)
    assert g[1, 1].item() == pytest.approx(torch.exp(torch.tensor(-0.1)).item() / 4)
    assert stats["clip_frac"] == 0.5
    # the pessimistic side is never clipped: A > 0 with a small ratio keeps its gradient
    low = (logp_old[:1] - 0.7).requires_grad_()
    loss, stats = policy_loss(low, logp_old[:1], adv[:1], mask[:1])
    loss.backward()
    assert (low.grad != 0).all() and stats["clip_frac"] == 0.0
    # a wider clip range unclips token 0
    wide = logp_new.detach().clone().requires_grad_()
    policy_loss(wide, logp_old, adv, mask, clip_low=0.5, clip_high=1.0)[0].backward()
    assert (wide.grad != 0).all()


def test_is_weights_scale_each_token_and_are_detached():
    logp_new, logp_old, adv, mask = _inputs()
    w = torch.tensor([[1.0, 0.5, 2.0], [0.0, 1.5, 1.0]], requires_grad=True)
    loss_w, _ = policy_loss(logp_new, logp_old, adv, mask, is_weights=w)
    per = _manual_per_token(logp_new, logp_old, adv, 0.2, 0.2).detach() * w.detach()
    assert loss_w.item() == pytest.approx((per[0].sum() + per[1, :2].sum()).item() / 5, rel=1e-5)
    loss_w.backward()
    assert w.grad is None or torch.all(w.grad == 0)
    assert logp_new.grad[1, 0] == 0  # weight 0 removes the token's gradient


def test_unit_weights_equal_no_weights_loss_and_gradient():
    logp_new, logp_old, adv, mask = _inputs()
    a = logp_new.detach().clone().requires_grad_()
    b = logp_new.detach().clone().requires_grad_()
    for agg in ("token", "sequence"):
        la, _ = policy_loss(a, logp_old, adv, mask, aggregation=agg)
        lb, _ = policy_loss(b, logp_old, adv, mask, aggregation=agg, is_weights=torch.ones(2, 3))
        assert la.item() == lb.item()
        la.backward(), lb.backward()
        assert torch.equal(a.grad, b.grad)


def test_k3_kl_to_reference():
    logp_new, logp_old, adv, mask = _inputs()
    ref = logp_old - 0.3
    base, _ = policy_loss(logp_new, logp_old, adv, mask)
    with_kl, stats = policy_loss(logp_new, logp_old, adv, mask, ref_logp=ref, kl_coef=0.1)
    d = (ref - logp_new.detach())
    k3 = torch.exp(d) - d - 1
    expected_kl = (k3[0].sum() + k3[1, :2].sum()).item() / 5
    assert stats["kl_ref"] == pytest.approx(expected_kl)
    assert with_kl.item() == pytest.approx(base.item() + 0.1 * expected_kl)
    same, stats = policy_loss(logp_new, logp_old, adv, mask, ref_logp=logp_new.detach(), kl_coef=1.0)
    assert stats["kl_ref"] == 0.0 and same.item() == pytest.approx(base.item())
    # the KL's gradient pulls logp_new towards ref: d k3 / d new = 1 - exp(ref - new)
    x = logp_new.detach().clone().requires_grad_()
    policy_loss(x, logp_old, torch.zeros(2), mask, ref_logp=ref, kl_coef=1.0)[0].backward()
    assert torch.allclose(x.grad[0], (1 - torch.exp(d[0])) / 5)


def test_policy_loss_rejects_bad_shapes_and_values():
    logp_new, logp_old, adv, mask = _inputs()
    with pytest.raises(ValueError, match="logp_old"):
        policy_loss(logp_new, logp_old[:, :2], adv, mask)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp_new, logp_old, adv[:1], mask)
    with pytest.raises(ValueError, match="aggregation"):
        policy_loss(logp_new, logp_old, adv, mask, aggregation="batch")
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(logp_new, logp_old, adv, mask, clip_low=1.0)


@pytest.mark.parametrize("field, value, words", [
    ("group_size", 0, "positive integer"),
    ("group_size", -4, "positive integer"),
    ("group_size", 2.5, "positive integer"),
    ("group_size", 1, ">= 2, got 1: a group of one sample has advantage 0"),
    ("clip_low", 1.0, "[0.0, 1.0)"),
    ("clip_high", -0.1, "[0.0, inf]"),
    ("aggregation", "batch", "allowed: token, sequence"),
    ("scale_std", "yes", "true or false"),
    ("std_eps", 0.0, "(0.0, inf]"),
    ("kl_coef", -1.0, "[0.0, inf]"),
])
def test_config_errors_name_the_field_and_allowed_values(field, value, words):
    with pytest.raises(ConfigError, match=f"'{field}'") as err:
        GRPOConfig(**{field: value})
    assert err.value.field == field and words in str(err.value)


def test_config_from_dict_and_loss_kwargs():
    cfg = from_dict(GRPOConfig, {"group_size": 8, "aggregation": "sequence", "clip_high": 0.28})
    assert cfg.group_size == 8 and cfg.loss_kwargs()["aggregation"] == "sequence"
    with pytest.raises(ConfigError, match="'grpo.group_size'"):
        from_dict(GRPOConfig, {"group_size": -1}, prefix="grpo")
    with pytest.raises(ConfigError, match="unknown field"):
        from_dict(GRPOConfig, {"groupsize": 4})
    logp_new, logp_old, adv, mask = _inputs()
    loss, _ = policy_loss(logp_new, logp_old, adv, mask, **cfg.loss_kwargs())
    assert torch.isfinite(loss)


def test_padding_values_never_leak_into_loss_or_gradient():
    logp_new, logp_old, adv, mask = _inputs()
    clean, _ = policy_loss(logp_new, logp_old, adv, mask, is_weights=torch.ones(2, 3))
    x = logp_new.detach().clone()
    x[1, 2] = -float("inf")
    x.requires_grad_()
    old = logp_old.clone()
    old[1, 2] = float("nan")
    w = torch.ones(2, 3)
    w[1, 2] = float("nan")
    for agg in ("token", "sequence"):
        loss, stats = policy_loss(x, old, adv, mask, is_weights=w, aggregation=agg,
                                  ref_logp=old, kl_coef=0.1)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and x.grad[1, 2] == 0
        assert all(v == v for v in stats.values())
    assert policy_loss(x, old, adv, mask, is_weights=w)[0].item() == pytest.approx(clean.item())


def test_loss_kwargs_carry_each_field_to_its_own_argument():
    """Every value distinct, so a field passed as another's shows."""
    cfg = GRPOConfig(clip_low=0.1, clip_high=0.28, aggregation="sequence", kl_coef=0.05)
    assert cfg.loss_kwargs() == {"clip_low": 0.1, "clip_high": 0.28, "aggregation": "sequence", "kl_coef": 0.05}
    logp_new, logp_old, adv, mask = _inputs()
    direct, _ = policy_loss(logp_new, logp_old, adv, mask, clip_low=0.1, clip_high=0.28, aggregation="sequence",
                            ref_logp=logp_old - 0.3, kl_coef=0.05)
    via_cfg, _ = policy_loss(logp_new, logp_old, adv, mask, ref_logp=logp_old - 0.3, **cfg.loss_kwargs())
    assert via_cfg.item() == direct.item()
