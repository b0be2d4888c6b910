"""Shared inputs for the verifier tests: the rule cases (every registered rule, from RULES),
seeded random logits and the devices a test runs on (``on_devices``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import pytest
import torch

from verifiers import RULES, VerificationRule, get_rule, native

# Per-rule parameter cases: the one place a rule's test parameters are declared. Every rule in
# RULES gets cases (those listed here, else one with its default parameters), so every test
# parametrised over RULE_CASES runs on a newly registered rule without an edit here.
PARAMS: dict[str, list[dict]] = {
    "mars": [{"theta": 0.8}],  # a theta that relaxes on shifted logits
    "overshoot": [{"lenience": 0.5}, {"lenience": 0.7, "min_p": 0.3}],  # without and with the gate
    "typical": [{"epsilon": 0.2, "delta": 0.5}],
    "min_p": [{"p_base": 0.3}],
    "cos": [{"lam": 0.4}],
}
# Rules whose lossy branch fires only on positive logits (MARS's ratio test z2 / z1 > theta
# with z1 > 0): the tests shift their logits up.
POSITIVE_LOGITS = {"mars"}


@dataclass(frozen=True)
class RuleCase:
    """One rule with one set of parameters, as the tests build it."""

    name: str
    params: dict = field(default_factory=dict)
    positive: bool = False  # shift the test logits up (see POSITIVE_LOGITS)
    make: Callable[[], VerificationRule] | None = None  # a rule not built by get_rule (comparators)

    @property
    def id(self) -> str:
        return self.name + "".join(f"-{k}{v}" for k, v in self.params.items())

    def rule(self) -> VerificationRule:
        return self.make() if self.make is not None else get_rule(self.name, **self.params)

    def shift(self, amount: float) -> float:
        """The offset added to the test logits: ``amount`` for a POSITIVE_LOGITS rule, else 0."""
        return amount if self.positive else 0.0


def rule_cases() -> list[RuleCase]:
    """A case per declared parameter set of every registered rule, in registry order."""
    return [RuleCase(name, params, name in POSITIVE_LOGITS) for name in RULES for params in PARAMS.get(name, [{}])]


RULE_CASES = rule_cases()
RULE_IDS = [case.id for case in RULE_CASES]
KERNEL_CASES = [case for case in RULE_CASES if native.supports(case.rule())]  # rules the C++ kernel runs
KERNEL_IDS = [case.id for case in KERNEL_CASES]


def chain_inputs(seed: int, b: int, k: int, v: int, temperature: float, shift: float = 0.0):
    """target [B, K+1, V], draft [B, K, V] correlated with the target, x ~ q (argmax at T = 0)."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(b, k + 1, v, generator=g) * 2 + shift
    draft = target[:, :k] + torch.randn(b, k, v, generator=g)
    if temperature == 0:
        x = draft.argmax(-1)
    else:
        q = torch.softmax(draft / temperature, -1).reshape(-1, v)
        x = torch.multinomial(q, 1, generator=g).reshape(b, k) if b * k else torch.zeros(b, k).long()
    return target, draft, x


def candidate_inputs(seed: int, n: int, m: int, v: int, shift: float = 0.0):
    """target [N, V] and distinct candidates [N, m] (draft-score order), some rows -1 padded."""
    g = torch.Generator().manual_seed(seed)
    target = torch.randn(n, v, generator=g) * 2 + shift
    draft = target + torch.randn(n, v, generator=g)
    cands = draft.topk(m, -1).indices
    for r in range(n):
        pad = int(torch.randint(0, m + 1, (1,), generator=g))  # pad the last `pad` slots
        if pad and r % 3 == 0:
            cands[r, m - pad:] = -1
    return target, cands


def on_devices(cpu_backends: tuple[str, ...] = ("native", "torch")):
    """Parametrises a test over (``device``, ``chain_backend``), the fixtures of ``conftest.py``:
    the CPU on each of ``cpu_backends``, and CUDA (marker ``gpu``; skipped without a device) on
    the PyTorch code, the only code CUDA runs. The test takes ``device``, a torch.device."""
    cases = [("cpu", backend) for backend in cpu_backends] + [pytest.param("cuda", "torch", marks=pytest.mark.gpu)]
    return pytest.mark.parametrize("device, chain_backend", cases, indirect=True)
