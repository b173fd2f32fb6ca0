"""maj@k's vote keys (jaxrlvr.rewards.votes): the task's own equivalence decides the classes."""

import pytest

from jaxrlvr.rewards import votes

RIGHT = {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
WRONG = {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}


def test_correct_samples_share_the_gold_class_whatever_their_text():
    assert votes.vote_key("question_only", "\\boxed{0.5}", RIGHT) == votes.GOLD
    assert votes.vote_key("code", "anything", RIGHT) == votes.GOLD


def test_wrong_math_answers_group_by_normal_form():
    key = lambda name, text: votes.vote_key(name, text, WRONG)  # noqa: E731
    r1 = "</think> <answer>{}</answer>"
    assert key("r1_zero", r1.format("\\dfrac{1}{3}")) == key("r1_zero", r1.format("\\frac{1}{3}"))
    assert key("r1_zero", r1.format("\\boxed{12}")) == key("r1_zero", r1.format(" 12 ")) == "12"
    assert key("r1_zero", r1.format("12")) != key("r1_zero", r1.format("13"))
    assert key("r1_zero", "no think tag <answer>12</answer>") is None  # ill-formed: abstains
    assert key("question_only", "so \\boxed{x + 1}") == key("question_only", "\\boxed{x+1}")
    assert key("gsm8k", "it is 1,000") == key("gsm8k", "so 1000.0") == "1000"
    assert key("gsm8k", "no number") is None
    assert key("synthetic", " <answer>007</answer>") == "7"


def test_code_votes_by_test_outcome():
    half = {"format_reward": 1.0, "answer_reward": 0.5, "reward": 0.5}
    assert votes.vote_key("code", "a", half) == votes.vote_key("code", "b", half) == "tests=0.5"
    assert votes.vote_key("code", "a", WRONG) == "tests=0"
    assert votes.vote_key("code", "", {**WRONG, "format_reward": 0.0}) is None
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        votes.vote_key("nope", "", WRONG)
