"""The scratchpad task: exact answers, worked solutions that parse and add up, verbosity mixture,
disjoint and seeded splits, and grading of its gold completions by the question-only and R1-Zero
verifiers."""

import collections
import re

import pytest

from jaxrlvr.data import scratchpad, templates
from jaxrlvr.rewards import verifiers

QUESTION_ONLY_GOLD = " {solution}<answer>{answer}</answer>"
R1_ZERO_GOLD = " {solution}</think> <answer>{answer}</answer>"


@pytest.fixture(scope="module")
def splits():
    return scratchpad.make_splits(0, 600, 100)


def _chain(question: str) -> tuple[int, list[tuple[str, int]]]:
    # Independent parse of the printed equation ("7 + 5 - 3 =").
    assert re.fullmatch(r"\d+( [+-] \d+)+ =", question), question
    tokens = question[:-2].split(" ")
    return int(tokens[0]), [(op, int(x)) for op, x in zip(tokens[1::2], tokens[2::2])]


def test_answers_exact_and_in_range(splits):
    cfg = scratchpad.ScratchpadConfig()
    for p in splits[0] + splits[1]:
        start, steps = _chain(p.question)
        assert cfg.min_steps <= len(steps) <= cfg.max_steps
        value = start
        for op, x in steps:
            assert 0 <= x <= cfg.max_operand
            value = value + x if op == "+" else value - x
            assert 0 <= value <= cfg.max_value, p
        assert int(p.answer) == value


def test_worked_solutions_parse_and_add_up(splits):
    seen = collections.Counter()
    for p in splits[0]:
        start, steps = _chain(p.question)
        work = p.solution
        assert work == "" or (work.endswith(" ") and not work.endswith("  ")), repr(work)
        parsed = scratchpad.parse_work(work)
        if parsed:  # "steps" or "verbose": every step is right and they chain to the answer
            seen["verbose" if " = " in work else "steps"] += 1
            assert len(parsed) == len(steps)
            prev = start
            for (a, op, b, c), (want_op, want_b) in zip(parsed, steps):
                assert (a, op, b) == (prev, want_op, want_b)
                assert c == (a + b if op == "+" else a - b)
                prev = c
            assert prev == int(p.answer)
        elif work:  # "results": the intermediate values, the last one the answer
            seen["results"] += 1
            values = [int(v) for v in work.split()]
            assert len(values) == len(steps) and values[-1] == int(p.answer)
        else:
            seen["none"] += 1
    # Equal weights over 600 problems: each verbosity 150 +- 4.3 sigma (sigma ~ 10.6).
    assert set(seen) == set(scratchpad.VERBOSITIES)
    assert all(105 <= n <= 195 for n in seen.values()), seen


def test_gold_completions_graded_correct_and_wrong_answers_not(splits):
    for p in splits[0][:200]:
        gold = templates.render_gold(QUESTION_ONLY_GOLD, p.answer, p.solution)
        assert verifiers.question_only_reward_fn(gold, p.answer)["reward"] == 1.0
        r1 = templates.render_gold(R1_ZERO_GOLD, p.answer, p.solution)
        assert verifiers.r1_zero_reward_fn(r1, p.answer)["reward"] == 1.0
        wrong = str(int(p.answer) + 1)
        assert verifiers.question_only_reward_fn(gold, wrong)["reward"] == 0.0
        # Work without a closed answer block (a truncated response) earns nothing, even when
        # its last number is the answer.
        truncated = gold.split("<answer>")[0] + p.answer
        assert verifiers.question_only_reward_fn(truncated, p.answer)["reward"] == 0.0


def test_gold_lengths_vary_with_verbosity(splits):
    lengths = {
        v: len(scratchpad.write_work(3, [("+", 4), ("-", 2), ("+", 9)], v))
        for v in scratchpad.VERBOSITIES
    }
    assert lengths["none"] == 0 < lengths["results"] < lengths["steps"] < lengths["verbose"]
    assert scratchpad.write_work(3, [("+", 4), ("-", 2)], "steps") == "3+4=7 7-2=5 "
    assert scratchpad.write_work(3, [("+", 4), ("-", 2)], "verbose") == "3 + 4 = 7. 7 - 2 = 5. "


def test_splits_disjoint_deterministic_and_seeded(splits):
    train, held_out = splits
    assert (len(train), len(held_out)) == (600, 100)
    assert not {p.question for p in train} & {p.question for p in held_out}
    assert len({p.id for p in train + held_out}) == 700
    assert scratchpad.make_splits(0, 600, 100) == splits
    assert scratchpad.make_splits(1, 600, 100)[0] != train


def test_only_one_verbosity_when_asked():
    cfg = scratchpad.ScratchpadConfig(verbosity_weights=(0, 0, 1, 0), min_steps=3, max_steps=3)
    train, _ = scratchpad.make_splits(3, 50, 0, cfg)
    assert all(len(scratchpad.parse_work(p.solution)) == 3 for p in train)
    assert all(" = " not in p.solution for p in train)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(min_steps=3, max_steps=2), "min_steps <= max_steps"),
        (dict(min_steps=0), "min_steps <= max_steps"),
        (dict(verbosity_weights=(1, 1, 1)), "verbosity_weights"),
        (dict(verbosity_weights=(0, 0, 0, 0)), "verbosity_weights"),
        (dict(verbosity_weights=(1, -1, 1, 1)), "verbosity_weights"),
        (dict(max_operand=9, max_value=5), "max_value"),
    ],
)
def test_bad_config_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        scratchpad.ScratchpadConfig(**kwargs)


def test_too_few_distinct_questions_raises():
    cfg = scratchpad.ScratchpadConfig(min_steps=1, max_steps=1, max_operand=1, max_value=2)
    with pytest.raises(ValueError, match="too few distinct questions"):
        scratchpad.make_splits(0, 50, 10, cfg)


def test_solution_placeholder_needs_a_solution():
    assert templates.render_gold(" <answer>{answer}</answer>", "4") == " <answer>4</answer>"
    with pytest.raises(ValueError, match="no worked solution"):
        templates.render_gold(QUESTION_ONLY_GOLD, "4", None)
