"""Tasks and rewards: generated answers are exact, splits are disjoint and fixed, the
parser reads the usual answer formats, and the JSONL loader names bad lines."""

import ast
import json
import operator
import re
from fractions import Fraction

import pytest

from rollout.config import ConfigError
from trainers.tasks.arithmetic import DIFFICULTIES, TEMPLATES, make_problems
from trainers.tasks.problems import ANSWER_INSTRUCTION, Problem, load_jsonl
from trainers.tasks.rewards import RewardConfig, answer_reward, exact_match_reward, parse_final_answer

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv}


def _recompute(expression: str) -> Fraction:
    """An independent evaluator of the filled-in expression (exact fractions)."""
    def ev(node):
        if isinstance(node, ast.BinOp):
            return _BINOPS[type(node.op)](ev(node.left), ev(node.right))
        assert isinstance(node, ast.Constant), ast.dump(node)
        return Fraction(str(node.value))
    return ev(ast.parse(expression, mode="eval").body)


def _key(p: Problem) -> tuple:
    """(template, numbers): the id encodes the template; the expression holds the numbers."""
    return (p.id.split("-")[1], p.expression)


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_answers_are_exact_and_numbers_appear_in_the_prompt(difficulty):
    problems = make_problems(200, difficulty, seed=3)
    assert len(problems) == 200
    for p in problems:
        assert p.difficulty == difficulty and p.split == "train"
        assert Fraction(p.answer) == _recompute(p.expression), p
        assert Fraction(p.answer) > 0
        assert p.prompt.endswith(ANSWER_INSTRUCTION)
        prompt_numbers = set(re.findall(r"\d+(?:\.\d+)?", p.prompt))
        # every operand of a template without derived slots is written in the story
        tpl = TEMPLATES[difficulty][int(p.id.split("-")[1][1:])]
        if not tpl.derived:
            for operand in re.findall(r"\d+(?:\.\d+)?", p.expression):
                assert operand in prompt_numbers, (operand, p.prompt)


def test_level_one_is_single_small_addition_or_subtraction():
    for p in make_problems(300, 1, seed=0):
        a, op, b = p.expression.split()
        assert op in "+-" and int(b) <= 9 and int(a) <= 19 and int(p.answer) <= 21


def test_levels_grow_in_steps_and_size():
    def steps(p):
        return len(re.findall(r"[-+*/]", p.expression))
    mean = {d: sum(map(steps, make_problems(200, d))) / 200 for d in DIFFICULTIES}
    assert mean[1] == 1 and mean[2] >= 2 and mean[3] >= 1.5
    assert any("*" in p.expression for p in make_problems(200, 3))
    big = [p for p in make_problems(200, 4) if Fraction(p.answer) >= 100]
    assert len(big) > 50
    assert any("." in p.answer for p in make_problems(300, 4)), "level 4 has decimal answers"


def test_at_least_thirty_templates_and_varied_text():
    assert sum(len(t) for t in TEMPLATES.values()) >= 30
    problems = make_problems(300, 2)
    assert len({p.id.split("-")[1] for p in problems}) == len(TEMPLATES[2])
    names = {p.prompt.split()[0] for p in problems}
    assert len(names) > 8


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_splits_are_disjoint_for_any_seeds(difficulty):
    heldout = make_problems(150, difficulty, split="heldout", seed=0)
    assert all(p.split == "heldout" for p in heldout)
    held_keys = {_key(p) for p in heldout}
    assert len(held_keys) == 150  # distinct within a list
    for seed in (0, 1, 2):
        train = make_problems(400, difficulty, split="train", seed=seed)
        train_keys = {_key(p) for p in train}
        assert len(train_keys) == 400
        assert not train_keys & held_keys
        assert not {p.prompt for p in train} & {p.prompt for p in heldout}


def test_deterministic_given_seed_and_seed_matters():
    assert make_problems(50, 3, seed=7) == make_problems(50, 3, seed=7)
    assert make_problems(50, 3, seed=7) != make_problems(50, 3, seed=8)
    # the held-out split is fixed: a prefix of a longer request is the same problems
    assert make_problems(20, 2, "heldout") == make_problems(40, 2, "heldout")[:20]


def test_bad_arguments_and_exhausted_key_space():
    with pytest.raises(ValueError, match="difficulty"):
        make_problems(1, 5)
    with pytest.raises(ValueError, match="split"):
        make_problems(1, 1, split="test")
    with pytest.raises(ValueError, match="distinct"):
        make_problems(5000, 1, split="heldout")
    assert make_problems(0, 1) == []


@pytest.mark.parametrize("text, expected", [
    ("So the total is 12. Answer: 15", "15"),
    ("Answer: 3\nwait, Answer: 4", "4"),
    ("the answer is -7.", "-7"),
    ("Answer: $1,234.50", "1234.5"),
    ("**Answer:** 42", "42"),
    ("She has 5 - 3 = 2 apples.\n#### 2", "2"),
    ("#### 1,000", "1000"),
    ("we get \\boxed{ 17 } in the end 3", "17"),
    ("Answer: 8 and #### 9", "8"),  # 'Answer:' is preferred over '####'
    ("5 + 3 = 8 apples", "8"),  # no marker: the last number
    ("5-3 is 2, then 10-2", "2"),  # a hyphen glued to a digit is not a sign
    ("It is 12.0 dollars", "12"),
    ("3, 4, 5", "5"),
    ("+6 points", "6"),
    ("no numbers here", None),
    ("Answer: <number>", None),
    ("", None),
])
def test_parse_final_answer(text, expected):
    assert parse_final_answer(text) == expected


def test_exact_match_reward_is_numeric():
    assert exact_match_reward("Answer: 12.50", "12.5") == 1.0
    assert exact_match_reward("Answer: 1,000", "1000") == 1.0
    assert exact_match_reward("Answer: 13", "12") == 0.0
    assert exact_match_reward("I don't know", "12") == 0.0
    with pytest.raises(ValueError, match="not a number"):
        exact_match_reward("Answer: 1", "twelve")


def test_format_bonus_option():
    cfg = RewardConfig(format_bonus=0.1)
    assert answer_reward("Answer: 5", "5", cfg) == pytest.approx(1.1)
    assert answer_reward("Answer: 4", "5", cfg) == pytest.approx(0.1)
    assert answer_reward("it is 5", "5", cfg) == 1.0
    assert answer_reward("Answer: 5", "5") == 1.0
    with pytest.raises(ConfigError, match="format_bonus"):
        RewardConfig(format_bonus=1.5)


def test_generated_problems_score_their_own_answer():
    for p in make_problems(50, 4, seed=1):
        assert exact_match_reward(f"Some work. Answer: {p.answer}", p.answer) == 1.0


def _write(tmp_path, lines):
    path = tmp_path / "set.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_load_jsonl_gsm8k_and_prompt_formats(tmp_path):
    path = _write(tmp_path, [
        json.dumps({"question": "Tom has 3 apples and buys 1,200 more. How many?",
                    "answer": "3 + 1200 = <<3+1200=1203>>1203\n#### 1,203"}),
        "",
        json.dumps({"prompt": "What is 2.5 + 2.5?", "answer": 5, "id": "q7"}),
        json.dumps({"prompt": "What is 1 - 4?", "answer": "-3", "difficulty": 2}),
    ])
    problems = load_jsonl(path)
    assert [p.answer for p in problems] == ["1203", "5", "-3"]
    assert problems[0].prompt.endswith(ANSWER_INSTRUCTION)
    assert problems[1].prompt == "What is 2.5 + 2.5?"
    assert [p.id for p in problems] == ["user-1", "q7", "user-4"]
    assert problems[2].difficulty == 2 and problems[0].split == "user"


@pytest.mark.parametrize("bad, message", [
    ("{not json", "invalid JSON"),
    ('["a list"]', "JSON object"),
    ('{"answer": "4"}', "'question' or 'prompt'"),
    ('{"question": "2+2?"}', "missing 'answer'"),
    ('{"question": "2+2?", "answer": "#### four"}', "not a number"),
    ('{"prompt": "", "answer": "4"}', "non-empty"),
    ('{"prompt": "x", "answer": null}', "string or a number"),
])
def test_load_jsonl_names_the_bad_line(tmp_path, bad, message):
    good = json.dumps({"question": "1+1?", "answer": "#### 2"})
    path = _write(tmp_path, [good, good, bad])
    with pytest.raises(ValueError, match=re.escape(f"{path}:3:") + ".*" + re.escape(message)):
        load_jsonl(path)


def test_load_jsonl_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_jsonl(tmp_path / "nope.jsonl")
