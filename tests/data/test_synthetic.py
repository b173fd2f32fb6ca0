"""Synthetic arithmetic task: exact answers, determinism, disjoint splits, difficulty."""

import re

import pytest

from jaxrlvr.data import synthetic


def _eval_equation(question: str) -> int:
    # Independent check: Python's own arithmetic on the printed expression ("x" is times).
    assert question.endswith(" =")
    expr = question[:-2].replace("x", "*")
    assert re.fullmatch(r"[\d\s+\-*()]+", expr)
    return eval(expr)  # noqa: S307 - the regex above admits only digits and operators


def _eval_word_problem(question: str) -> int:
    value = int(re.match(r"\w+ has (\d+)", question).group(1))
    for sentence in question.split(". ")[1:]:
        if m := re.search(r"gets (\d+) more", sentence):
            value += int(m.group(1))
        elif m := re.search(r"gives away (\d+)", sentence):
            value -= int(m.group(1))
        elif m := re.search(r"multiplied by (\d+)", sentence):
            value *= int(m.group(1))
    return value


@pytest.mark.parametrize("level", [1, 2, 3, 4, 5])
def test_answers_are_exact_and_in_range(level):
    cfg = synthetic.SyntheticConfig.from_level(level)
    train, held_out = synthetic.make_splits(0, 100, 30, level)
    for p in train + held_out:
        answer = int(p.answer)
        check = _eval_word_problem if cfg.style == "word" else _eval_equation
        assert check(p.question) == answer, p
        assert 0 <= answer <= cfg.max_value


def test_splits_disjoint_deterministic_and_seeded():
    train, held_out = synthetic.make_splits(1, 120, 35, 1)
    assert (len(train), len(held_out)) == (120, 35)
    assert not {p.question for p in train} & {p.question for p in held_out}
    assert len({p.id for p in train + held_out}) == 155
    assert synthetic.make_splits(1, 120, 35, 1) == (train, held_out)
    assert synthetic.make_splits(2, 120, 35, 1)[0] != train


def test_easiest_level_is_short():
    train, _ = synthetic.make_splits(0, 150, 0, 1)
    # "a op b =" with one-digit operands, answers 0..18: a few characters each.
    assert max(len(p.question) for p in train) <= 7
    assert max(int(p.answer) for p in train) <= 18


def test_level_two_matches_example_shape():
    train, _ = synthetic.make_splits(0, 50, 0, 2)
    assert all(re.fullmatch(r"\d [+-] \d [+-] \d =", p.question) for p in train)


def test_exhausted_difficulty_raises():
    # Level 1 has exactly 100 sums and 55 non-negative differences of one-digit numbers.
    with pytest.raises(ValueError, match="too few distinct questions.*found 155"):
        synthetic.make_splits(0, 150, 10, 1)


def test_config_validation():
    with pytest.raises(ValueError, match="SyntheticConfig.operations must be one of"):
        synthetic.SyntheticConfig(operations="div")
    with pytest.raises(ValueError, match="SyntheticConfig.style must be one of"):
        synthetic.SyntheticConfig(style="poem")
    with pytest.raises(ValueError, match="num_steps"):
        synthetic.SyntheticConfig(num_steps=0)
    with pytest.raises(ValueError, match="difficulty level"):
        synthetic.SyntheticConfig.from_level(9)
    custom = synthetic.SyntheticConfig(num_steps=4, max_operand=3, max_value=20)
    train, _ = synthetic.make_splits(0, 20, 0, custom)
    assert all(len(re.findall(r"[+-]", p.question)) == 4 for p in train)
