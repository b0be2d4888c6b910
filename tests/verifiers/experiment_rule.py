"""An experiment rule, to show what adding a rule takes: this one class. In the project it would
sit in verifiers/rules.py under ``@register``; here tests/verifiers/test_new_rule.py registers it
for the length of a test. It declares no kernel id, so it runs on the PyTorch path, with no
edit to verifiers/native.py, the C++ or any table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from verifiers.rule_base import RuleBase, check_range, expand, lossless_accept, lossless_residual


@dataclass(frozen=True)
class TemperedLossless(RuleBase):
    """Chain mode: lossless speculative sampling towards m = softmax(z / scale), the target at
    temperature scale * T: a = min(1, m(x) / q(x)), residual (m - q)+, P = m. Since
    m = p^(1/scale) / sum p^(1/scale), m(y) needs only p(y) and that row sum (the context).
    Candidate mode is the lossless walk on p (the inherited steps), so there P = p."""

    scale: float = 1.5
    name: ClassVar[str] = "tempered_lossless"

    def __post_init__(self):
        check_range(self.name, "scale", self.scale, 0, 10, True, "(0, 10]")

    def context(self, z, p):
        return {"norm": p.pow(1 / self.scale).sum(-1)}

    def _m(self, p, ctx):
        return p.pow(1 / self.scale) / expand(ctx["norm"], p)

    def accept_prob(self, p_x, q_x, x, ctx):
        return lossless_accept(self._m(p_x, ctx), q_x)

    def residual(self, p, q, x, ctx):
        return lossless_residual(self._m(p, ctx), q)

    def induced(self, p, q, ctx):
        return self._m(p, ctx)

    def prob_at(self, p_y, q_y, y, ctx, stats):
        return self._m(p_y, ctx)

    def induces_target(self, ctx):
        return self.scale == 1
