"""The language-consistency reward on mixed-language reasoning written for the test: the share of
the reasoning span's words in the target language, code excluded, added with its weight."""

import pickle

import pytest

from jaxrlvr import config as config_lib
from jaxrlvr.rewards import language, verifiers

# (response, target, share): shares counted by hand from the module's rule.
CASES = [
    # All English reasoning (the R1-Zero template: the response starts inside <think>).
    ("First add 3 and 4 to get 7.</think> <answer>7</answer>", "en", 1.0),
    # 5 Chinese characters (a word each) and 4 English words: 4 / 9 in English.
    ("我们先计算 3+4。 So the sum is 7.</think> <answer>7</answer>", "en", 4 / 9),
    # The same response with target zh: 5 / 9.
    ("我们先计算 3+4。 So the sum is 7.</think> <answer>7</answer>", "zh", 5 / 9),
    # Russian then English: 2 Cyrillic words, 3 Latin ones.
    ("<think>Сначала считаем. Then we add.</think> <answer>5</answer>", "en", 3 / 5),
    # Variables and Greek letters are not words; LaTeX commands neither: 4 English words.
    ("Let x = 2\\pi r so α is y.</think>", "en", 1.0),
    ("Let x = 2\\pi r, 所以 α 是 y.</think>", "en", 1 / 4),
    # The answer block is not reasoning: only "Think first" counts.
    ("<think>Think first</think> <answer>答案是七</answer>", "en", 1.0),
    # No </think>: the text before the last <answer> block.
    ("The total is 12, 对吧 <answer>12</answer>", "en", 3 / 5),
    # Nothing to count.
    ("</think> <answer>7</answer>", "en", 1.0),
    # Japanese: kanji and kana are a word a character (7), then 2 English words.
    ("まず計算します. Then done.</think>", "ja", 7 / 9),
]


@pytest.mark.parametrize("response, target, share", CASES)
def test_share_of_target_language_words(response, target, share):
    assert language.language_consistency(response, target) == pytest.approx(share, abs=1e-12)


def test_code_blocks_are_excluded():
    response = (
        "I will write the function, 然后测试。\n"
        "```python\ndef 计算(x):\n    return x  # 返回\n```\n"
        "Inline `变量` too. Done</think> <answer>```python\ndef f(): pass\n```</answer>"
    )
    # Counted: will write the function Inline too Done (7; "I" is one letter) + 然后测试 (4).
    assert language.language_consistency(response, "en") == pytest.approx(7 / 11)
    # With code kept, the block's words and comment count as well: + python def return (3)
    # and 计算 返回 变量 (6 characters).
    kept = language.language_consistency(response, "en", exclude_code=False)
    assert kept == pytest.approx(10 / 20)
    # A tool call is code too.
    assert language.language_consistency("<python>print('你好')</python> ok done</think>") == 1.0


def test_reasoning_span():
    assert language.reasoning_span("a</think> b") == "a"
    assert language.reasoning_span("x <think>a</think> b") == "a"
    assert language.reasoning_span("<think>a b") == "a b"
    assert language.reasoning_span("a <answer>1</answer> b <answer>2</answer>") == (
        "a <answer>1</answer> b "
    )


def test_reward_adds_weighted_share_and_pickles():
    cfg = language.LanguageRewardConfig(weight=0.5, target="en")
    fn = language.with_language_reward(verifiers.r1_zero_reward_fn, cfg)
    mixed = "我们先计算 3+4。 So the sum is 7.</think> <answer>7</answer>"
    score = fn(mixed, "7")
    assert score["answer_reward"] == 1.0 and score["format_reward"] == 1.0
    assert score["language_reward"] == pytest.approx(4 / 9)
    assert score["reward"] == pytest.approx(1.0 + 0.5 * 4 / 9)
    wrong = fn("All English here.</think> <answer>8</answer>", "7")
    assert (wrong["answer_reward"], wrong["reward"]) == (0.0, 0.5)
    # The grading pool's workers get it pickled.
    assert pickle.loads(pickle.dumps(fn))(mixed, "7") == score
    # Weight 0 is the verifier itself.
    off = language.LanguageRewardConfig()
    assert language.with_language_reward(verifiers.r1_zero_reward_fn, off) is (
        verifiers.r1_zero_reward_fn
    )


def test_reward_section_builds_it():
    from jaxrlvr import builders

    cfg = config_lib.load_config(
        None, ["reward.fn=r1_zero", "reward.language.weight=0.1", "reward.language.target=zh"]
    )
    fn = builders.build_reward_fn(cfg)
    score = fn("我们先计算 So the sum</think> <answer>7</answer>", "7")
    assert score["language_reward"] == pytest.approx(5 / 8)
    assert score["reward"] == pytest.approx(1.0 + 0.1 * 5 / 8)
    with pytest.raises(ValueError, match="language.target='xx'"):
        config_lib.load_config(None, ["reward.language.target=xx"])
    with pytest.raises(ValueError, match="language.weight=-1"):
        config_lib.load_config(None, ["reward.language.weight=-1"])
