"""The helpers every component shares: chat templating and the numeric range checks."""

from __future__ import annotations

import math

import pytest

from rollout.chat import chat_ids
from rollout.config import ConfigError, check_int, check_number


class FakeTokenizer:
    """Renders messages as ``role:content|`` and tokenises characters as their code points."""

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        text = "".join(f"{m['role']}:{m['content']}|" for m in messages)
        return text + ("assistant:" if add_generation_prompt else "") + "".join(f"{k}={v}" for k, v in kwargs.items())

    def __call__(self, text, add_special_tokens=True):
        return {"input_ids": [ord(c) for c in text]}


def _text(ids):
    return "".join(map(chr, ids))


def test_chat_ids_renders_user_system_and_message_prompts():
    tok = FakeTokenizer()
    assert _text(chat_ids(tok, "hi")) == "user:hi|assistant:"
    assert _text(chat_ids(tok, "hi", system="be brief")) == "system:be brief|user:hi|assistant:"
    assert _text(chat_ids(tok, "hi", system="")) == "user:hi|assistant:"
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert _text(chat_ids(tok, messages, enable_thinking=False)) == "user:a|assistant:b|assistant:enable_thinking=False"
    assert isinstance(chat_ids(tok, "x"), list)


@pytest.mark.parametrize("value, low, ok, words", [
    (1, 1, True, None), (0, 1, False, "a positive integer, got 0"), (True, 1, False, "positive integer"),
    (2.0, 1, False, "positive integer"), (0, 0, True, None), (-1, 0, False, "a non-negative integer, got -1"),
    (1, 2, False, "an integer >= 2, got 1"),
])
def test_check_int(value, low, ok, words):
    if ok:
        check_int("n", value, low)
        return
    with pytest.raises(ConfigError, match="'n'") as err:
        check_int("n", value, low)
    assert words in str(err.value)


@pytest.mark.parametrize("value, kwargs, words", [
    (0.5, dict(low=1), ">= 1, got 0.5"),
    (0, dict(low=0, low_open=True, finite=True), "a finite number > 0, got 0"),
    (math.inf, dict(low=0, finite=True), "finite number >= 0"),
    (1.0, dict(low=0.0, high=1.0, high_open=True), "in [0.0, 1.0), got 1.0"),
    (math.nan, dict(low=0.0, high=math.inf), "in [0.0, inf], got nan"),
    ("2", dict(low=1), "got '2'"),
    (False, dict(low=0), "got False"),
])
def test_check_number_refuses(value, kwargs, words):
    with pytest.raises(ConfigError) as err:
        check_number("x", value, **kwargs)
    assert words in str(err.value)


def test_check_number_accepts():
    check_number("x", math.inf, 1)  # no upper bound and not asked to be finite: an uncapped setting
    check_number("x", 1, 0, 1)
    check_number("x", 0.5, 0, 1, low_open=True, high_open=True)
