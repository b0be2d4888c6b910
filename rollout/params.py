"""The three knobs of one ``Engine.generate`` call, as frozen, validated dataclasses.

- :class:`SamplingParams`: how the target distribution p is formed (temperature, top-k,
  top-p) and when a completion ends (max new tokens, stop tokens).
- :class:`SpecConfig`: how candidates are drafted. ``off`` is plain autoregressive
  decoding through the same engine (one target forward per token); ``chain`` drafts
  ``num_draft_tokens`` (K) tokens in a line, either sampled from the draft distribution q
  or greedy (the draft's argmax, verified as deterministic candidates); ``tree`` is the
  EAGLE-2 dynamic tree: ``depth`` draft levels, ``top_k`` children per expanded node and
  a global top-``top_k`` frontier, the best ``total_tokens`` drafted nodes verified in one
  target forward.
- :class:`VerifierConfig`: the verification rule by registry name plus its parameters
  (see ``verifiers.get_rule``) and how sampled chains test drafts (``test``); lossless by default.

Each class validates in ``__post_init__`` and raises :class:`rollout.config.ConfigError`
naming the field and, where there is a fixed set, the allowed values. They load from YAML
mappings with ``rollout.config.from_dict``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from rollout.config import ConfigError, check_int, check_number, is_int
from verifiers.chain import TESTS  # VerifierConfig.test: verify_chain's acceptance tests

SPEC_MODES = ("off", "chain", "tree")
DRAFT_SAMPLING = ("sampled", "greedy")
TREE_CANDIDATES = ("top_k", "sampled")


@dataclass(frozen=True)
class SamplingParams:
    """How tokens are sampled from the target and when a completion stops.

    temperature: >= 0; 0 is greedy (deterministic, behaviour log-prob 0).
    top_k: keep the k most likely target tokens (None = all).
    top_p: keep the smallest set of target tokens with mass >= top_p (None = all).
    max_new_tokens: completion length cap (>= 1).
    stop_token_ids: a completion ends after the first of these (the stop token is kept).
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        t = self.temperature
        check_number("temperature", t, 0, finite=True)
        if self.top_k is not None:
            check_int("top_k", self.top_k)
        p = self.top_p
        if p is not None and (isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 < p <= 1):
            raise ConfigError("top_p", f"must be null or in (0, 1], got {p!r}")
        check_int("max_new_tokens", self.max_new_tokens)
        stops = self.stop_token_ids
        if isinstance(stops, int) or not isinstance(stops, (list, tuple)):
            raise ConfigError("stop_token_ids", f"must be a list of token ids, got {stops!r}")
        if not all(is_int(s) and s >= 0 for s in stops):
            raise ConfigError("stop_token_ids", f"must be non-negative integers, got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(stops))
        object.__setattr__(self, "temperature", float(t))


@dataclass(frozen=True)
class SpecConfig:
    """How candidates are drafted (fields of other modes are ignored).

    mode: ``off`` (plain autoregressive), ``chain`` or ``tree``.
    num_draft_tokens: chain length K (tokens drafted per round).
    draft_sampling: chain drafts ``sampled`` from q (lossless acceptance 1 - TV(p, q))
        or ``greedy`` (the draft's argmax, verified as deterministic candidates).
    depth: tree levels drafted per round.
    top_k: tree children per expanded node, and the width of the expanded frontier.
    total_tokens: drafted tree nodes verified per round (the root is extra).
    tree_candidates: a tree node's children are the head's ``top_k`` tokens (deterministic
        candidates, any verifier; the EAGLE-2 dynamic tree) or ``sampled`` from q without
        replacement (a shape of ``total_tokens`` nodes, at most ``depth`` deep and ``top_k`` wide,
        re-planned during a call from the acceptance it measured, ``rollout.engine.sampled_tree``; any
        verifier: a lossy one verifies towards its chain law, so each position's law is that of
        its sampled chain). At T = 0 a sampled tree drafts the top-k tree instead.
    max_batch: draft only in rounds with at most this many unfinished rows; rounds over
        larger batches decode one plain token per row (the draft catches up on those tokens
        when drafting resumes). On a CPU a forward's cost grows with its tokens once the
        batch has a few rows, so verifying K+1 tokens per row pays only in the small-batch
        tail of a call. None: draft in every round. ``auto``: decide every round from the
        step costs and acceptance measured in the call (``rollout.engine.planner``): draft only
        when it is expected to emit more tokens per second than a plain round.
    adaptive_k: with ``max_batch: auto`` and a chain, each round also picks its chain
        length in 1..num_draft_tokens (the most tokens per second under the measured
        per-depth acceptance and step costs).
    """

    mode: str = "chain"
    num_draft_tokens: int = 5
    draft_sampling: str = "sampled"
    depth: int = 5
    top_k: int = 4
    total_tokens: int = 16
    max_batch: int | str | None = None
    adaptive_k: bool = False
    tree_candidates: str = "top_k"

    def __post_init__(self) -> None:
        if self.mode not in SPEC_MODES:
            raise ConfigError("mode", f"unknown speculation mode {self.mode!r}", allowed=SPEC_MODES)
        if self.draft_sampling not in DRAFT_SAMPLING:
            raise ConfigError("draft_sampling", f"unknown draft sampling {self.draft_sampling!r}",
                              allowed=DRAFT_SAMPLING)
        if self.tree_candidates not in TREE_CANDIDATES:
            raise ConfigError("tree_candidates", f"unknown tree candidates {self.tree_candidates!r}",
                              allowed=TREE_CANDIDATES)
        for name in ("num_draft_tokens", "depth", "top_k", "total_tokens"):
            check_int(name, getattr(self, name))
        if self.max_batch is not None and self.max_batch != "auto":
            if isinstance(self.max_batch, str):
                raise ConfigError("max_batch", f"must be an integer >= 1, auto or null, got {self.max_batch!r}")
            check_int("max_batch", self.max_batch)
        if not isinstance(self.adaptive_k, bool):
            raise ConfigError("adaptive_k", f"must be true or false, got {self.adaptive_k!r}")
        if self.adaptive_k and not (self.mode == "chain" and self.auto):
            raise ConfigError("adaptive_k", "needs mode chain and max_batch auto (it uses the measured step costs)")
        most = self.top_k + (self.depth - 1) * self.top_k ** 2  # nodes the tree drafting generates
        if self.tree_candidates == "sampled":
            most = sum(self.top_k ** d for d in range(1, self.depth + 1))
        if self.mode == "tree" and self.total_tokens > most:
            raise ConfigError("total_tokens", f"{self.total_tokens} exceeds the {most} nodes a tree of depth "
                              f"{self.depth} and top_k {self.top_k} drafts")

    @property
    def speculative(self) -> bool:
        return self.mode != "off"

    @property
    def sampled_tree(self) -> bool:
        """Whether this drafts trees of sampled candidates (``tree_candidates: sampled``)."""
        return self.mode == "tree" and self.tree_candidates == "sampled"

    @property
    def auto(self) -> bool:
        """Whether each round's drafting is planned from measurements (``max_batch: auto``)."""
        return self.speculative and self.max_batch == "auto"

    def drafts_at(self, batch: int) -> bool:
        """Whether a round over ``batch`` unfinished rows drafts (see ``max_batch``; with
        ``auto`` the engine's planner decides, so this only says whether it may)."""
        return self.speculative and (self.max_batch in (None, "auto") or batch <= self.max_batch)

    @property
    def block_size(self) -> int:
        """Tokens per row in one verification forward (pending token + drafted tokens)."""
        if self.mode == "off":
            return 1
        if self.mode == "chain":
            return self.num_draft_tokens + 1
        return self.total_tokens + 1

    @property
    def max_emitted(self) -> int:
        """Most tokens one round can emit for a row."""
        if self.mode == "off":
            return 1
        return (self.num_draft_tokens if self.mode == "chain" else self.depth) + 1


@dataclass(frozen=True)
class VerifierConfig:
    """The verification rule: ``name`` from the ``verifiers`` registry and its ``params``
    (e.g. ``{"theta": 0.9}`` for mars, ``{"lenience": 0.5}`` for overshoot).

    ``test``: how sampled chains are verified. ``rule`` (default) runs the rule's own acceptance
    test; ``law`` runs rejection towards the law that test induces at each position (the same
    law, behaviour log-probs and drift, with the most acceptance that law allows: more than
    MARS's own test, the same for lossless and overshoot; ``verifiers.verify_chain``); ``block``
    (lossless rule only) accepts the chain's drafts jointly (``verifiers.block``): still P = p,
    5-8% more tokens per round on the shipped head; on a tree of sampled candidates it verifies
    the first-child spine as a block and tries the other children where the block stops
    (``verifiers.block_tree``). Trees of sampled candidates otherwise verify towards the law;
    drafts without q (greedy chains, top-k trees) have no such test, so ``law`` and ``block`` are
    refused there (:func:`check_test`)."""

    name: str = "lossless"
    params: dict[str, Any] = field(default_factory=dict)
    test: str = "rule"

    def __post_init__(self) -> None:
        if not isinstance(self.params, dict):
            raise ConfigError("params", f"must be a mapping of rule parameters, got {self.params!r}")
        if self.test not in TESTS:
            raise ConfigError("test", f"unknown acceptance test {self.test!r}", allowed=TESTS)
        if self.test == "block" and self.name != "lossless":
            raise ConfigError("test", f"'block' verifies towards p, so it is exact for the lossless rule only, not "
                              f"{self.name!r}", allowed=["rule", "law"])
        self.rule()  # unknown names / bad parameters raise here, naming what is allowed

    def rule(self):
        """The rule object from ``verifiers.get_rule`` (errors re-raised as ConfigError)."""
        from verifiers import get_rule

        if not isinstance(self.name, str):
            raise ConfigError("name", f"must be a rule name, got {self.name!r}")
        try:
            return get_rule(self.name, **self.params)
        except ConfigError:
            raise
        except (KeyError, ValueError, TypeError) as err:
            from verifiers import RULES

            if self.name not in RULES:
                raise ConfigError("name", f"unknown verification rule {self.name!r}", allowed=sorted(RULES)) from None
            named = re.search(r"parameter '(\w+)'", str(err))  # the parameter the rule's message names
            raise ConfigError(f"params.{named.group(1)}" if named else "params", str(err)) from None


TRUNCATION_RULES = ("min_p", "typical")  # the rules with a truncation set A = {p >= thr}


@dataclass(frozen=True)
class TruncationSamplingConfig(VerifierConfig):
    """A VerifierConfig whose rule is :class:`verifiers.TruncationSampling` over the named
    truncation rule: sampling from p restricted to the rule's set A, the rule's matched baseline.
    With ``spec.mode: off`` every token has P = p_A / p(A), recorded exactly as its behaviour
    log-prob (the drift study's baselines; the GRPO job's ``rollout.truncation_sampling``)."""

    def __post_init__(self) -> None:
        if self.name not in TRUNCATION_RULES:
            raise ConfigError("name", f"{self.name!r} has no truncation set", allowed=TRUNCATION_RULES)
        super().__post_init__()

    def rule(self):
        from verifiers import TruncationSampling

        return TruncationSampling(super().rule())


def check_test(spec: SpecConfig, verifier: VerifierConfig, temperature: float | None = None) -> None:
    """Refuse ``verifier.test: law`` and ``block`` where the drafts have no q to verify with:
    greedy chains and top-k trees (deterministic candidates); unless ``temperature`` is 0 (every
    test is then the rule's greedy test).
    Plain decoding verifies nothing, so it takes any test."""
    if verifier.test == "rule" or temperature == 0:
        return
    if verifier.test == "block" and (spec.mode == "tree" and not spec.sampled_tree
                                     or spec.mode == "chain" and spec.draft_sampling == "greedy"):
        drafts = "greedy chain drafts" if spec.mode == "chain" else "top-k tree candidates"
        raise ConfigError("verifier.test", f"'block' verifies drafts sampled from q; {drafts} (spec.mode="
                          f"{spec.mode!r}) are deterministic: use spec.draft_sampling 'sampled' (chains) or "
                          "tree_candidates 'sampled'", allowed=["rule"])
    if verifier.test != "law":
        return
    if spec.mode == "chain" and spec.draft_sampling == "greedy" or spec.mode == "tree" and not spec.sampled_tree:
        drafts = "greedy chain drafts" if spec.mode == "chain" else "top-k tree candidates"
        raise ConfigError("verifier.test", f"'law' needs drafts sampled from q; {drafts} (spec.mode={spec.mode!r}) are "
                          "deterministic: use spec.draft_sampling 'sampled' (chains) or tree_candidates 'sampled'",
                          allowed=["rule"])


def tree_spec(text: str, **fields) -> SpecConfig:
    """A tree SpecConfig from ``"depth,top_k,total_tokens"``; an ``s`` in front (``"s6,3,10"``)
    makes it a tree of sampled candidates (the scripts' ``--tree`` flags)."""
    body = text.strip()
    sampled = body.startswith("s")
    try:
        depth, top_k, total = (int(x) for x in body.lstrip("s").split(","))
    except ValueError:
        raise ValueError(f"tree {text!r}: expected depth,top_k,total_tokens (e.g. 4,3,8, or s4,2,5 for "
                         "sampled candidates)") from None
    return SpecConfig(mode="tree", depth=depth, top_k=top_k, total_tokens=total,
                      tree_candidates="sampled" if sampled else "top_k", **fields)


def drift_warning(spec: SpecConfig, verifier: VerifierConfig) -> str | None:
    """A warning for a speculation + verifier pair that samples far from the target, else None.

    MARS over deterministic candidates (tree nodes, greedy chain drafts) emits the target's top-1
    or top-2 outright wherever it relaxes (most positions of SmolLM2 at T = 1 with theta 0.9):
    near-greedy rollouts. Measured on held-out arithmetic (2026-12-03, commit 4de53bf; docs/measurements/): tree
    completions a third shorter than plain sampling's, 4.4x the per-token KL of MARS on sampled
    chains, a sequence importance-weight ESS of 0.05."""
    deterministic = (spec.mode == "tree" and not spec.sampled_tree
                     or spec.mode == "chain" and spec.draft_sampling == "greedy")
    if verifier.name != "mars" or not deterministic or verifier.rule().theta >= 1.0:
        return None
    drafts = "tree nodes" if spec.mode == "tree" else "greedy drafts"
    return (f"verifier mars with {drafts} (spec.mode={spec.mode!r}, draft_sampling={spec.draft_sampling!r}) "
            "accepts the target's top-2 tokens outright wherever it relaxes: the rollouts come out near greedy "
            "(on held-out arithmetic: completions a third shorter, sequence IS ESS about 0.05). For training, use "
            "mars with draft_sampling 'sampled' chains or tree_candidates 'sampled', or overshoot")
