"""Reward functions: R1-Zero format rules, question-only, GSM8K, synthetic, format weight."""

import functools
import pickle

import pytest

from jaxrlvr import rewards
from jaxrlvr.rewards import verifiers

ZERO = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}
RIGHT = {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
WRONG = {"format_reward": 1.0, "answer_reward": 0.0, "reward": 0.0}


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("2 plus 3 </think> <answer>5</answer>", RIGHT),
        ("2 plus 3 </think> <answer>6</answer>", WRONG),
        ("x </think> <answer>The sum is \\boxed{5}.</answer>", RIGHT),
        ("x </think> <answer>\\boxed{4} then \\boxed{5}</answer>", RIGHT),
        ("x </think> <answer>\\boxed{5</answer>", WRONG),  # unclosed box: formatted, wrong
        ("x </think> <answer>5</answer> trailing text", RIGHT),
        # Format failures: all zero even when the answer is right.
        ("2 plus 3 <answer>5</answer>", ZERO),  # missing </think>
        ("x </think><answer>5</answer>", ZERO),  # no space
        ("x </think>  <answer>5</answer>", ZERO),  # two spaces
        ("x </think> <answer>5", ZERO),  # unclosed answer
        ("x </think> <answer>5</answer> <answer>6", ZERO),  # last answer unclosed
        ("", ZERO),
        ("5", ZERO),
        (None, ZERO),
        # Several answer blocks: the last one counts.
        ("x </think> <answer>6</answer> <answer>5</answer>", RIGHT),
        ("x </think> <answer>5</answer> <answer>6</answer>", WRONG),
    ],
)
def test_r1_zero_format_rules(response, expected):
    assert rewards.r1_zero_reward_fn(response, "5") == expected


def test_r1_zero_ground_truth_types():
    resp = "x </think> <answer>\\frac{1}{2}</answer>"
    for gold in ("0.5", 0.5, "\\boxed{\\dfrac12}", "The answer is $\\boxed{1/2}$."):
        assert rewards.r1_zero_reward_fn(resp, gold)["reward"] == 1.0, gold
    assert rewards.r1_zero_reward_fn("x </think> <answer>7</answer>", 7)["reward"] == 1.0
    assert rewards.r1_zero_reward_fn("x </think> <answer>7</answer>", 8)["reward"] == 0.0


def test_format_weight():
    fn = rewards.make_r1_zero_reward_fn(format_weight=0.25)
    assert fn("x </think> <answer>6</answer>", "5") == {
        "format_reward": 1.0,
        "answer_reward": 0.0,
        "reward": 0.25,
    }
    assert fn("x </think> <answer>5</answer>", "5")["reward"] == 1.25
    assert fn("x </think><answer>5</answer>", "5") == ZERO
    # The factory's result must travel to grading workers.
    assert pickle.loads(pickle.dumps(fn))("x </think> <answer>5</answer>", "5")["reward"] == 1.25


def test_reward_config_validation_names_key_and_values():
    with pytest.raises(ValueError, match="RewardConfig.name.*r1_zero"):
        rewards.RewardConfig(name="nope")
    with pytest.raises(ValueError, match="format_weight"):
        rewards.RewardConfig(format_weight=-1.0)
    fn = rewards.make_reward_fn(rewards.RewardConfig(name="gsm8k", format_weight=0.5))
    assert isinstance(fn, functools.partial)
    assert fn("so 12", "#### 12")["reward"] == 1.5


@pytest.mark.parametrize(
    ("response", "expected_answer"),
    [
        ("The answer is \\boxed{5}.", 1.0),
        ("<answer>5</answer>", 1.0),
        ("<answer>\\boxed{5}</answer>", 1.0),
        ("<answer>4</answer> on reflection \\boxed{5}", 1.0),  # boxed comes last
        ("\\boxed{4} on reflection <answer>5</answer>", 1.0),  # answer block comes last
        ("\\boxed{5} on reflection <answer>4</answer>", 0.0),
        ("<think>no think close</think><answer>5</answer>", 1.0),  # no format requirement
    ],
)
def test_question_only(response, expected_answer):
    out = rewards.question_only_reward_fn(response, "5")
    assert out["answer_reward"] == expected_answer
    assert out["format_reward"] == 1.0


def test_question_only_without_answer_scores_zero():
    assert rewards.question_only_reward_fn("It is 5.", "5") == ZERO
    assert rewards.question_only_reward_fn("<answer>5", "5") == ZERO


@pytest.mark.parametrize(
    ("response", "gold", "answer_reward"),
    [
        ("3 * 12 = 36, 36 - 7 = 29. #### 29", "...\n#### 29", 1.0),
        ("The answer is 14,400.", "#### 14,400", 1.0),
        ("The answer is 14400", "#### 14,400", 1.0),
        ("She gets $3.25 back.", "#### 3.25", 1.0),
        ("It is 3.250", 3.25, 1.0),
        ("The temperature is -7 degrees", "#### -7", 1.0),
        ("29 first, then 30", "#### 29", 0.0),  # last number counts
        ("The answer is 7", "#### -7", 0.0),
        ("from 5-7", "#### -7", 0.0),  # a hyphen after a digit is not a sign
        ("It is 29", "#### twenty-nine", 0.0),  # unparseable gold never scores
        ("It is 29", 29, 1.0),
    ],
)
def test_gsm8k(response, gold, answer_reward):
    assert rewards.gsm8k_reward_fn(response, gold)["answer_reward"] == answer_reward


def test_gsm8k_no_number_is_zero():
    assert rewards.gsm8k_reward_fn("I don't know", "#### 5") == ZERO


@pytest.mark.parametrize(
    ("response", "answer_reward", "format_reward"),
    [
        (" 9", 1.0, 1.0),
        ("7 + 5 - 3 = 9", 1.0, 1.0),
        ("<answer>9</answer>", 1.0, 1.0),
        ("<answer> 9 </answer> 8", 1.0, 1.0),  # the answer block beats the last integer
        ("<answer>nine</answer>", 0.0, 0.0),  # a block must hold a bare integer
        ("-9", 0.0, 1.0),
        ("10", 0.0, 1.0),
        ("no digits", 0.0, 0.0),
    ],
)
def test_synthetic(response, answer_reward, format_reward):
    out = rewards.synthetic_reward_fn(response, "9")
    assert out["answer_reward"] == answer_reward
    assert out["format_reward"] == format_reward
    assert rewards.synthetic_reward_fn("-3", -3)["answer_reward"] == 1.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("x" * 100_000 + " </think> <answer>5</answer>", RIGHT),
        (" </think> <answer>" + "9" * 100_000 + "</answer>", WRONG),
        (" </think> <answer>" + "x+" * 50_000 + "</answer>", WRONG),
        (" </think> <answer>\\boxed{" + "1" * 1000, ZERO),
        (" </think> <answer>\\boxed{5</answer>", WRONG),
        (" </think> <answer>" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "</answer>", WRONG),
        (" </think> <answer>10^{10^{10^{10}}}</answer>", WRONG),
        (" </think> <answer>" + "7" * 5000 + "</answer>", WRONG),
        # Lone surrogates become U+FFFD, which math-verify's extraction skips: "5" remains.
        ("\ud800 </think> <answer>5\udfff</answer>", RIGHT),
        ("\ud800 </think> <answer>6\udfff</answer>", WRONG),
        ("</think> <answer>" * 5000 + "5</answer>", RIGHT),
        (" </think> <answer>5" + "</answer>" * 5000, RIGHT),
        (" </think> " + "<answer>" * 10_000, ZERO),
    ],
    ids=["100k-prefix", "100k-digits", "100k-expr", "unclosed-boxed-long", "unclosed-boxed",
         "frac200", "tower", "5000-digits", "surrogates", "surrogates-wrong", "repeated-tags",
         "repeated-closes", "repeated-opens"],
)  # fmt: skip
def test_adversarial_responses_in_process(response, expected):
    assert rewards.r1_zero_reward_fn(response, "5") == expected


def test_reward_fn_protocol_accepts_user_verifier():
    def mine(response: str, ground_truth) -> dict[str, float]:
        return dict(ZERO)

    fn: rewards.RewardFn = mine  # a structural type: any callable with the signature
    assert fn("a", "b") == ZERO
    assert verifiers.zero_reward() == ZERO
