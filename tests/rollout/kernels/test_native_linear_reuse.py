"""rollout.kernels.native_linear keeps a weight's packed panels across ``routed`` blocks while the weight
is unchanged, and packs again after any change: through the autograd-visible tensor (version
counter), through ``.data`` (no version change: the digest), by new storage under the same
parameter, or by a new parameter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from rollout.engine.engine import Engine
from rollout.kernels import native_linear, weight_check
from rollout.params import SamplingParams, SpecConfig, VerifierConfig
from tests.models import copy_head, tiny_target

pytestmark = pytest.mark.skipif(not native_linear.available(),
                                reason="the native linear kernel needs an AVX-512 CPU and a C++ compiler")


@pytest.mark.parametrize("numel", [1, 2, 3, 63, 64, 65, 1000, (1 << 18) + 5, 3 * (1 << 18) + 1])
def test_the_digest_follows_every_value(numel):
    """Equal bytes, equal digests; one bit flipped in any value (first, a lane's last, the tail,
    the last), two values swapped, a sign flipped or every value nudged: another digest. The
    sizes cover the vector body, the byte tail and chunks of 1 MiB (several threads)."""
    g = torch.Generator().manual_seed(numel)
    t = torch.randn(numel, generator=g)
    base = weight_check.digest(t)
    assert weight_check.digest(t.clone()) == base
    bits = t.view(torch.int32)
    for i in sorted({0, min(31, numel - 1), numel // 2, numel - 1}):
        for bit in (0, 17, 31):
            u = bits.clone()
            u[i] ^= 1 << bit if bit < 31 else -(1 << 31)
            assert weight_check.digest(u.view(torch.float32)) != base, (i, bit)
    if numel > 1:
        s = t.clone()
        s[0], s[-1] = t[-1].item(), t[0].item()
        assert t[0] == t[-1] or weight_check.digest(s) != base
        assert weight_check.digest(-t) != base
        assert weight_check.digest(t[:-1].contiguous()) != base  # one value shorter
    assert weight_check.digest(t + 1e-3) != base


def test_the_digest_does_not_depend_on_the_thread_count():
    t = torch.randn(5 * (1 << 18) + 3)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = weight_check.digest(t)
        torch.set_num_threads(2)
        assert weight_check.digest(t) == one
    finally:
        torch.set_num_threads(before)


def test_the_digests_of_many_tensors_in_one_call_are_each_ones_own():
    """``digests`` (one C++ call, the chunks of every tensor shared among the threads) gives each
    tensor's ``digest``, in order, for tensors of 1 value to several chunks, and an empty list."""
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(n, generator=g) for n in (1, 65, (1 << 18) + 5, 7, 3 * (1 << 18) + 1, 1000)]
    ts.append(torch.randint(-127, 128, (4099,), dtype=torch.int8, generator=g))
    assert weight_check.digests(ts) == [weight_check.digest(t) for t in ts]
    assert weight_check.digests(ts[::-1]) == [weight_check.digest(t) for t in ts[::-1]]
    assert weight_check.digests([]) == []
    changed = [t.clone() for t in ts]
    changed[2][-1] += 1
    assert [a != b for a, b in zip(weight_check.digests(changed), weight_check.digests(ts))] == [
        i == 2 for i in range(len(ts))]


def routed_out(net: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad(), native_linear.routed(net):  # (no autograd: the kernel runs)
        return net(x)


def test_panels_are_kept_while_the_weight_is_unchanged_and_packed_after_any_change():
    net = nn.Linear(96, 80, bias=False)
    x = torch.randn(3, 96)

    def check(packed: bool) -> None:
        before = weight_check.repacks
        got = routed_out(net, x)
        assert weight_check.repacks - before == int(packed)
        torch.testing.assert_close(got, F.linear(x, net.weight.detach()), rtol=1e-5, atol=1e-4)

    check(True)  # first block
    check(True)  # the versions did not move: packed again, now with the digest
    check(False)
    check(False)
    with torch.no_grad():
        net.weight.mul_(0.5)  # moves the version counter
    check(True)
    check(True)
    check(False)
    net.weight.data[7, 3] += 1.0  # through .data: the version counter does not move
    check(True)
    check(False)
    net.weight.data.copy_(torch.randn(80, 96))
    check(True)
    net.weight.data = torch.randn(80, 96)  # new storage under the same parameter
    check(True)
    check(True)
    check(False)
    net.weight = nn.Parameter(torch.randn(80, 96))  # a new parameter: a new entry
    check(True)
    check(True)
    check(False)


def test_an_optimizer_step_is_seen():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 64, bias=False), nn.Tanh(), nn.Linear(64, 32, bias=False))
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    x = torch.randn(4, 64)
    for _ in range(3):
        got = routed_out(net, x)
        with torch.no_grad():
            torch.testing.assert_close(got, net(x), rtol=1e-5, atol=1e-5)
        loss = net(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_the_engine_sees_a_weight_changed_through_data_between_calls():
    """Two calls, the target's weights unchanged (the second keeps the panels); then a change
    through ``.data`` (no version change): the next call emits what an engine that packs from
    scratch emits, not what the stale panels would give."""
    target = tiny_target()
    head = copy_head(target, noise=0.3)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
    kw = dict(sampling=SamplingParams(temperature=1.0, max_new_tokens=24),
              spec=SpecConfig(mode="chain", num_draft_tokens=3), verifier=VerifierConfig(), seed=5)
    engine = Engine(target, head, num_threads=2, linear="native")
    first = engine.generate(prompts, **kw)
    engine.generate(prompts, **kw)
    before = weight_check.repacks
    again = engine.generate(prompts, **kw)
    assert weight_check.repacks == before  # nothing packed: every panel kept
    assert [c.completion_ids for c in again.completions] == [c.completion_ids for c in first.completions]
    for p in target.model.parameters():
        if p.dim() == 2:
            p.data.mul_(-1.0)  # every matrix, in place, through .data
    changed = engine.generate(prompts, **kw)
    assert weight_check.repacks > before
    weight_check.stamps.clear()  # a fresh start: no stamps, no panels
    native_linear._buffers.clear()
    native_linear._merged_buffers.clear()
    scratch = engine.generate(prompts, **kw)
    for a, b in zip(changed.completions, scratch.completions):
        assert a.completion_ids == b.completion_ids and a.behaviour_logprobs == b.behaviour_logprobs
    assert [c.completion_ids for c in changed.completions] != [c.completion_ids for c in first.completions]


def test_a_merged_buffer_is_packed_again_when_only_a_later_part_changes_through_data():
    """A fused module's merged buffer (q/k/v, gate/up) is checked against the digests of every
    weight it was packed from: a write through ``.data`` (no version change) to its last part
    alone packs it again, as the parts are then."""
    g = torch.Generator().manual_seed(7)
    owner = nn.Module()
    parts = [torch.randn(32, 48, generator=g), torch.randn(16, 48, generator=g), torch.randn(24, 48, generator=g)]
    job = (owner, native_linear._merged_buffers, parts)
    native_linear._refill_all([job])
    native_linear._refill_all([job])  # versions unchanged: now stamped with the digests
    before = weight_check.repacks
    native_linear._refill_all([job])
    assert weight_check.repacks == before  # kept
    parts[2].data[23, 47] += 1.0
    (panels,) = native_linear._refill_all([job])
    assert weight_check.repacks == before + 1
    assert torch.equal(panels, native_linear.pack_merged(parts))
