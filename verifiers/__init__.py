"""Verification rules for speculative decoding, with exact behaviour log-probs.

Pure, batched tensor math (no models). Vocabulary, defined once here and used throughout:

- target distribution p: the policy's next-token distribution after sampling processing
  (temperature, then top-k / top-p), see :func:`process_logits`.
- draft distribution q: the drafter's distribution at the same temperature, never truncated.
- candidate: a drafted token the verifier examines; accepted / recovered / bonus: the three
  kinds of emitted token (:class:`TokenKind`).
- induced distribution P: what the verifier actually sampled the emitted token from at a
  position (P = p for the lossless rule); behaviour log-prob: log P(y).

Entry points: :func:`get_rule` (registry :data:`RULES`, a new rule added with :func:`register`),
:func:`verify_chain`, :func:`verify_candidates`, and the closed forms :func:`induced_chain`,
:func:`induced_candidates`; :class:`TruncationSampling` is the truncation rules' matched
baseline. The math contract is verifiers/README.md.
"""

from .name_clash import check_import_names as _check_import_names

_check_import_names()  # another distribution's 'verifiers' (or 'rollout', 'scripts') here: refused (name_clash.py)

from .candidates import verify_candidates
from .chain import verify_chain
from .induced import distribution_metrics, induced_candidates, induced_chain
from .processing import (draft_logits, draft_probs, process_logits, sample_inverse_cdf,
                         target_logprobs, target_probs)
from .results import DIAGNOSTIC_KEYS, CandidateResult, ChainResult, TokenKind
from .rules import RULES, TruncationSampling, VerificationRule, get_rule, register, rule_params

__all__ = [
    "RULES", "VerificationRule", "get_rule", "rule_params", "register", "TruncationSampling",
    "verify_chain", "verify_candidates", "induced_chain", "induced_candidates",
    "ChainResult", "CandidateResult", "TokenKind", "DIAGNOSTIC_KEYS", "distribution_metrics",
    "process_logits", "target_probs", "target_logprobs", "draft_logits", "draft_probs",
    "sample_inverse_cdf",
]
