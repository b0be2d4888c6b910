"""rollout.params.drift_warning: MARS over deterministic candidates (tree nodes, greedy chain
drafts) runs near greedy; the training config and the TRL settings warn about it, and about
nothing else (not about trees of sampled candidates, whose law is MARS's sampled chain's)."""

from __future__ import annotations

import warnings

import pytest

from rollout.params import SpecConfig, VerifierConfig, drift_warning
from trainers.grpo.config import RolloutConfig
from trainers.trl.rollouts import RolloutSettings

MARS = VerifierConfig("mars", {"theta": 0.9})
TREE = SpecConfig(mode="tree")
GREEDY = SpecConfig(mode="chain", num_draft_tokens=3, draft_sampling="greedy")
SAMPLED = SpecConfig(mode="chain", num_draft_tokens=3)


@pytest.mark.parametrize("spec, words", [(TREE, "tree nodes"), (GREEDY, "greedy drafts")])
def test_mars_over_deterministic_candidates_warns(spec, words):
    message = drift_warning(spec, MARS)
    assert message is not None and words in message and "near greedy" in message


@pytest.mark.parametrize("spec, verifier", [
    (SAMPLED, MARS),  # sampled chains: P mixes q on {v1, v2} with p
    (TREE, VerifierConfig("overshoot", {"lenience": 0.5})),
    (TREE, VerifierConfig()),
    (TREE, VerifierConfig("mars", {"theta": 1.0})),  # never relaxes: lossless
    (SpecConfig(mode="off"), MARS),
])
def test_other_pairs_do_not_warn(spec, verifier):
    assert drift_warning(spec, verifier) is None


def test_training_config_and_trl_settings_warn_once_built():
    with pytest.warns(UserWarning, match="rollout: verifier mars with tree nodes"):
        RolloutConfig(spec=TREE, verifier=MARS)
    with pytest.warns(UserWarning, match="rollouts: verifier mars with greedy drafts"):
        RolloutSettings(spec=GREEDY, verifier=MARS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        RolloutConfig(spec=SAMPLED, verifier=MARS)
        RolloutSettings(spec=SAMPLED, verifier=MARS)


def test_sampled_trees_take_every_verifier_without_a_warning():
    tree = SpecConfig(mode="tree", tree_candidates="sampled")
    for build in (RolloutConfig, RolloutSettings):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for verifier in (VerifierConfig(), VerifierConfig("overshoot", {"lenience": 0.5}), MARS):
                assert build(spec=tree, verifier=verifier).spec.sampled_tree
