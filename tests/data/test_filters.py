"""The pre-RL filter rules: guessable formats (from the question and the gold answer), the no-CoT
threshold and the best-of-k difficulty band."""

import pytest

from jaxrlvr import data
from jaxrlvr.data import filters, loading

MC_QUESTION = "Which number is prime?\n(A) 4\n(B) 6\n(C) 7\n(D) 9"


@pytest.mark.parametrize(
    "question, answer, kind",
    [
        ("Is 91 a prime number? Answer true or false.", "False", "true_false"),
        ("True or false: 2 + 2 = 4.", "$\\text{True}$", "true_false"),
        ("Is 17 prime?", "yes", "yes_no"),
        ("Is 17 prime?", "\\boxed{No}.", "yes_no"),
        (MC_QUESTION, "C", "multiple_choice"),
        (MC_QUESTION, "(C)", "multiple_choice"),
        ("Pick one. A) 3 B) 5", "B", "multiple_choice"),
        ("Pick one. A) 3 B) 5", "D", None),  # not one of the options listed
        ("Pick one.\nA) 3\nB) 5", "B.", "multiple_choice"),
        ("Which is larger? Answer choices: A, B", "A", "multiple_choice"),
        # Not guessable: numbers, expressions, words, a variable named a, a letter without options.
        ("What is 7 times 8?", "56", None),
        ("Solve for $a$: $2a = 6$; what is the variable?", "a", None),
        ("Which vertex of triangle ABC is the right angle?", "C", None),
        ("Simplify $\\sqrt{50}$.", "5\\sqrt{2}", None),
        ("Is it true that the sum is 10? Give the sum.", "10", None),
        ("What day of the week is 10 days after a Monday?", "Thursday", None),
    ],
)
def test_guessable_rule(question, answer, kind):
    assert filters.guessable_reason(question, answer) == kind


def test_shipped_samples_have_no_guessable_problem():
    # Every MATH and GSM8K sample answer is a number or an expression.
    math, _ = loading.load_problems(data.DataConfig.math(data.sample_path("math_sample.jsonl")))
    gsm, _ = loading.load_problems(data.DataConfig.gsm8k(data.sample_path("gsm8k_sample.jsonl")))
    assert [filters.guessable_reason(p.question, p.answer) for p in math + gsm] == [None] * (
        len(math) + len(gsm)
    )


def test_pass_rate_rules():
    # no-CoT: dropped at or above the threshold.
    assert filters.solved_without_cot(0.5, 0.5) and not filters.solved_without_cot(0.25, 0.5)
    # difficulty: the RL phase's 0 < rate < 1 by default; a narrower band when asked.
    assert [filters.informative(r) for r in (0.0, 0.125, 0.875, 1.0)] == [False, True, True, False]
    assert not filters.informative(0.25, low=0.25, high=0.75)
    assert filters.informative(0.5, low=0.25, high=0.75)


def test_configs_refuse_bad_values():
    with pytest.raises(ValueError, match="no_cot.threshold=0"):
        filters.NoCoTConfig(threshold=0.0)
    with pytest.raises(ValueError, match="no_cot.k=0"):
        filters.NoCoTConfig(k=0)
    with pytest.raises(ValueError, match="difficulty.low=0.5, high=0.5"):
        filters.DifficultyConfig(low=0.5, high=0.5)
    assert set(filters.FORCED_TEXT) == {"r1_zero", "question_only", "chat"}
