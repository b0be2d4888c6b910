"""``check_head_fits``: each field of an in-memory head's config against the target, one at a time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_engine_utils import tiny_target

from rollout.eagle3_io import HeadMismatchError, check_head_fits


def _head(target, **change):
    fields = dict(vocab_size=target.vocab_size, target_hidden_size=target.hidden_size,
                  hidden_size=target.hidden_size, aux_layer_ids=tuple(target.aux_layer_ids))
    return SimpleNamespace(cfg=SimpleNamespace(**{**fields, **change}))


def test_each_mismatched_field_is_named():
    target = tiny_target()
    check_head_fits(_head(target), target)
    h, n = target.hidden_size, target.num_layers
    with pytest.raises(HeadMismatchError, match="head's hidden_size"):
        check_head_fits(_head(target, hidden_size=h + 16), target)  # features fit, its own width does not
    with pytest.raises(HeadMismatchError, match="fc in = 3 x"):
        check_head_fits(_head(target, target_hidden_size=h + 16), target)
    with pytest.raises(HeadMismatchError, match="vocabulary mismatch"):
        check_head_fits(_head(target, vocab_size=target.vocab_size - 1), target)
    for ids in [(0, 1, n), (-1, 0, 1), (0, 1)]:
        with pytest.raises(HeadMismatchError, match="do not exist"):
            check_head_fits(_head(target, aux_layer_ids=ids), target)
