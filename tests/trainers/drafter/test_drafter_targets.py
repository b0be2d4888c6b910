"""The head trains against the target's own distribution for any accepted family: its lm_head
(tied or not) and its logit rule (soft-capped, scaled), not the shared input embedding."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rollout.models import TargetModel
from scripts.check_model import copy_head, tiny_model
from trainers.drafter.ttt import _targets


@pytest.mark.parametrize("model_type,overrides", [
    ("llama", dict(tie_word_embeddings=False)),
    ("gemma2", dict(final_logit_softcapping=2.0)),
    ("cohere", dict(logit_scale=0.25)),
])
def test_the_heads_targets_are_the_targets_logits(model_type, overrides):
    target = TargetModel(tiny_model(model_type, overrides))
    head = copy_head(target)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad(), target.capture(final=True) as cap:
        logits = target.model(ids, use_cache=False).logits.float()  # [1, 6, V]
    final = cap.final()
    assert torch.allclose(target.logits(final), logits, atol=1e-5)
    target.attach_to(head)
    batch = SimpleNamespace(final=final, argmax=logits.argmax(-1), lossable=torch.ones(1, 6, dtype=torch.bool))
    tl, _ = _targets(head, batch)
    assert torch.allclose(tl, logits[:, 1:, head.target_ids], atol=1e-5)
    assert any(p.requires_grad for p in target.model.parameters())
    assert not head.target_logits(final.requires_grad_(True)).requires_grad  # constants: no gradient into the target
