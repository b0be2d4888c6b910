"""The call's bookkeeping (``rollout.engine.sequences``): stop and length truncation of a round's tokens,
finish reasons and the step counts, on hand-made round outputs (no model)."""

from __future__ import annotations

import numpy as np

from rollout.engine.sequences import RoundOutput, SequenceTable, prompt_budgets


def _round(rows: list[list[int]], width: int = 4) -> RoundOutput:
    """A round in which row r emitted ``rows[r]``; log-probs encode (row, position) so that the
    kept ones can be checked to be the emitted tokens' own."""
    b = len(rows)
    tokens = np.full((b, width), -1, dtype=np.int64)
    blp = np.zeros((b, width))
    for r, toks in enumerate(rows):
        tokens[r, : len(toks)] = toks
        blp[r] = -(r * 10 + np.arange(width)) - 0.5
    return RoundOutput(tokens=tokens, counts=np.array([len(t) for t in rows]), behaviour_logprobs=blp,
                       target_logprobs=blp - 100.0, kinds=np.zeros((b, width), dtype=np.int64),
                       relaxed=np.zeros((b, width), dtype=bool))


def test_a_stop_token_beyond_the_budget_does_not_end_the_row_with_stop():
    # row 0: budget 2 and a round of [5, 6, STOP]: the stop token is cut by the budget (length);
    # row 1: the stop token within the budget ends it (stop), the tokens after it are dropped
    stop = 9
    table = SequenceTable([[1], [2]], max_new_tokens=[2, 3], stop_token_ids=(stop,))
    done = table.append(_round([[5, 6, stop], [7, stop, 8]]))
    assert done == [True, True]
    a, b = table.completions()
    assert a.completion_ids == [5, 6] and a.finish_reason == "length"
    assert b.completion_ids == [7, stop] and b.finish_reason == "stop"
    assert a.behaviour_logprobs == [-0.5, -1.5] and b.behaviour_logprobs == [-10.5, -11.5]
    assert a.target_logprobs == [-100.5, -101.5]
    assert all(c.num_tokens <= m for c, m in zip((a, b), (2, 3)))


def test_a_stop_token_that_fills_the_budget_is_a_stop():
    stop = 9
    table = SequenceTable([[1], [2]], max_new_tokens=[3, 3], stop_token_ids=(stop,))
    table.append(_round([[5, 6], [5, 6]]))
    assert table.append(_round([[stop, 4], [7, 8]])) == [True, True]
    a, b = table.completions()
    assert a.completion_ids == [5, 6, stop] and a.finish_reason == "stop"
    assert b.completion_ids == [5, 6, 7] and b.finish_reason == "length"


def test_rows_finish_over_rounds_and_the_prefill_token_is_not_a_step():
    stop = 9
    table = SequenceTable([[1], [2], [3]], max_new_tokens=[5, 5, 5], stop_token_ids=(stop,))
    assert table.append(_round([[4], [4], [4]]), first=True) == [False, False, False]
    assert table.append(_round([[5, 6], [stop], [5, 6, 7]])) == [False, True, False]
    table.keep([0, 2])
    assert table.completion_lengths() == [3, 4]
    assert table.append(_round([[7, 8, 1], [8, 1]])) == [True, True]  # budgets: 2 of 3 kept, 1 of 2
    a, b, c = table.completions()
    assert a.completion_ids == [4, 5, 6, 7, 8] and a.finish_reason == "length"
    assert b.completion_ids == [4, stop] and b.finish_reason == "stop"
    assert c.completion_ids == [4, 5, 6, 7, 8] and c.finish_reason == "length"
    assert a.step_emitted == [2, 3] and b.step_emitted == [1] and c.step_emitted == [3, 2]


def test_prompt_budgets_cap_max_new_by_the_context_left():
    assert prompt_budgets([[1, 2, 3], [1] * 9, [0]], max_new=8, context=10, vocab=4) == [7, 1, 8]
