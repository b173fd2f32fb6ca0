"""Reward functions: R1-Zero format + answer, question-only, GSM8K and the synthetic demo task.

Every reward function has the ``RewardFn`` signature ``fn(response, ground_truth) -> dict`` with
float entries ``format_reward``, ``answer_reward`` and ``reward``, where
``reward = answer_reward + format_weight * format_reward`` (``format_weight`` defaults to 0, so
``reward == answer_reward`` as in the R1-Zero protocol). A user's own verifier only has to follow
the same signature; to be graded in ``grading.GradingPool`` it must also be picklable (a
module-level function or a ``functools.partial`` of one).

These functions run sympy (through ``math_equiv``) with no timeout of their own: call them through
``grading.GradingPool`` in training. What they leave out: length shaping and any learned reward.
"""

from __future__ import annotations

import dataclasses
import decimal
import functools
import re
from typing import Literal, Protocol, get_args

from jaxrlvr.rewards import code, math_equiv

THINK_ANSWER = "</think> <answer>"
ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"


class RewardFn(Protocol):
    """``fn(response, ground_truth) -> {"format_reward", "answer_reward", "reward"}`` (floats)."""

    def __call__(self, response: str, ground_truth: str | int | float) -> dict[str, float]: ...


def zero_reward() -> dict[str, float]:
    """The all-zero score given to ill-formed responses, timeouts and grader errors."""
    return {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}


def _score(formatted: bool, correct: bool, format_weight: float) -> dict[str, float]:
    fmt, ans = float(formatted), float(correct)
    return {"format_reward": fmt, "answer_reward": ans, "reward": ans + format_weight * fmt}


def _last_answer_block(response: str) -> tuple[int, str] | None:
    """(start, content) of the last ``<answer>`` block, or None when it is never closed."""
    start = response.rfind(ANSWER_OPEN)
    if start < 0:
        return None
    end = response.find(ANSWER_CLOSE, start)
    if end < 0:
        return None
    return start, response[start + len(ANSWER_OPEN) : end]


def _unbox(answer: str) -> str | None:
    """The last ``\\boxed{}`` content when the answer has one; None when that box is unclosed."""
    if "\\boxed" in answer or "\\fbox" in answer:
        return math_equiv.last_boxed_content(answer)
    return answer


def extract_r1_zero_answer(response: str) -> tuple[bool, str | None]:
    """(well_formed, answer) under the R1-Zero format rules.

    Well-formed: the response contains ``</think> <answer>`` (exactly one space) and a later
    ``</answer>`` closing the last ``<answer>``. The answer is the text of the last answer block,
    or the content of the last ``\\boxed{}`` inside it (None when that box is unclosed).
    """
    if not isinstance(response, str):
        return False, None
    think = response.find(THINK_ANSWER)
    if think < 0:
        return False, None
    block = _last_answer_block(response)
    if block is None:
        return False, None
    return True, _unbox(block[1])


def r1_zero_reward_fn(
    response: str, ground_truth: str | int | float, *, format_weight: float = 0.0
) -> dict[str, float]:
    """R1-Zero reward: ill-formed responses score 0 on all three entries.

    Args:
      response: the generated text after the prompt's ``Assistant: <think>``.
      ground_truth: str (may contain ``\\boxed{}``), int or float.
      format_weight: reward = answer_reward + format_weight * format_reward.
    """
    well_formed, answer = extract_r1_zero_answer(response)
    if not well_formed:
        return zero_reward()
    correct = answer is not None and math_equiv.is_equivalent(answer, ground_truth)
    return _score(True, correct, format_weight)


def extract_question_only_answer(response: str) -> str | None:
    """The answer of a free-form response: whichever comes last of the last closed
    ``<answer>...</answer>`` block (its last ``\\boxed{}`` if it has one) and the last
    ``\\boxed{}`` outside it. None when there is neither."""
    if not isinstance(response, str):
        return None
    block = _last_answer_block(response)
    boxed_at = max(response.rfind("\\boxed"), response.rfind("\\fbox"))
    if block is not None:
        block_end = block[0] + len(ANSWER_OPEN) + len(block[1])
        if boxed_at < block_end:
            return _unbox(block[1])
    if boxed_at >= 0:
        return math_equiv.last_boxed_content(response)
    return None


def question_only_reward_fn(
    response: str, ground_truth: str | int | float, *, format_weight: float = 0.0
) -> dict[str, float]:
    """Question-only prompt reward: no ``<think>`` requirement; format_reward is 1 when an answer
    (boxed or in an answer block) was found."""
    answer = extract_question_only_answer(response)
    if answer is None:
        return zero_reward()
    return _score(True, math_equiv.is_equivalent(answer, ground_truth), format_weight)


_GSM8K_NUMBER = re.compile(r"(?:(?<![\w.])-)?\d[\d,]*(?:\.\d+)?|(?:(?<![\w.])-)?\.\d+")


def _decimal(text: str) -> decimal.Decimal | None:
    text = text.replace(",", "").replace("$", "").strip().rstrip(".")
    if not re.fullmatch(r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)", text):
        return None
    # Decimal compares exactly, whatever the context precision, and has no digit limit.
    return decimal.Decimal(text)


def gsm8k_gold(ground_truth: str | int | float) -> decimal.Decimal | None:
    """The number of a GSM8K gold answer: the text after the last ``####``, or the value itself."""
    if isinstance(ground_truth, bool):
        return None
    if isinstance(ground_truth, float):
        return decimal.Decimal(repr(ground_truth))
    if isinstance(ground_truth, int):
        return decimal.Decimal(ground_truth)
    if not isinstance(ground_truth, str):
        return None
    text = ground_truth.rsplit("####", 1)[-1]
    return _decimal(math_equiv.sanitize(text))


def last_number(text: str) -> str | None:
    """The last number in ``text`` (``1,234.5``, ``-7``); a hyphen after a word is not a sign."""
    if not isinstance(text, str):
        return None
    last = None
    for last in _GSM8K_NUMBER.finditer(text):  # noqa: B007 - we want the final match
        pass
    return last.group(0) if last is not None else None


def gsm8k_reward_fn(
    response: str, ground_truth: str | int | float, *, format_weight: float = 0.0
) -> dict[str, float]:
    """GSM8K reward: the last number in the response equals the ``#### N`` gold exactly.

    format_reward is 1 when the response contains a number at all. An unparseable gold scores 0.
    """
    found = last_number(response)
    if found is None:
        return zero_reward()
    pred, gold = _decimal(found), gsm8k_gold(ground_truth)
    return _score(True, pred is not None and gold is not None and pred == gold, format_weight)


_INTEGER = re.compile(r"(?:(?<![\w])-)?\d+")


def extract_synthetic_answer(response: str) -> str | None:
    """The synthetic task's answer: the content of the last closed ``<answer>`` block when there
    is one (it must then be a bare integer), else the last integer anywhere in the response."""
    if not isinstance(response, str):
        return None
    block = _last_answer_block(response)
    if block is not None:
        text = block[1].strip()
        return text if re.fullmatch(r"-?\d+", text) else None
    matches = _INTEGER.findall(response)
    return matches[-1] if matches else None


def synthetic_reward_fn(
    response: str, ground_truth: str | int | float, *, format_weight: float = 0.0
) -> dict[str, float]:
    """Reward for ``jaxrlvr.data.synthetic``: exact integer match (``extract_synthetic_answer``).

    Lenient by design, so that a tiny model trained from scratch with the question-only template
    (``"7 + 5 - 3 ="`` -> ``" 9"``) gets signal; format_reward is 1 when an integer was found.
    """
    answer = extract_synthetic_answer(response)
    if answer is None:
        return zero_reward()
    gold = math_equiv.as_integer(math_equiv.gold_to_string(ground_truth).strip())
    return _score(True, gold is not None and math_equiv.as_integer(answer) == gold, format_weight)


RewardName = Literal["r1_zero", "question_only", "gsm8k", "synthetic", "code"]

# "code": ``code.code_reward_fn`` with its defaults (pass fraction, the bubblewrap sandbox, default
# limits); ``code.make_code_reward_fn`` takes a ``CodeRewardConfig`` (what the driver uses).
_REWARD_FNS = {
    "r1_zero": r1_zero_reward_fn,
    "question_only": question_only_reward_fn,
    "gsm8k": gsm8k_reward_fn,
    "synthetic": synthetic_reward_fn,
    "code": code.code_reward_fn,
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RewardConfig:
    """Which built-in verifier to use and how much the format reward counts.

    Attributes:
      name: one of ``r1_zero``, ``question_only``, ``gsm8k``, ``synthetic``, ``code``.
      format_weight: reward = answer_reward + format_weight * format_reward (>= 0).
    """

    name: RewardName = "r1_zero"
    format_weight: float = 0.0

    def __post_init__(self):
        if self.name not in get_args(RewardName):
            raise ValueError(
                f"RewardConfig.name must be one of {get_args(RewardName)}, got {self.name!r}"
            )
        if not self.format_weight >= 0.0:
            raise ValueError(f"RewardConfig.format_weight must be >= 0, got {self.format_weight}")


def make_reward_fn(cfg: RewardConfig) -> RewardFn:
    """A picklable reward function for ``cfg`` (a ``functools.partial`` of a module function)."""
    return functools.partial(_REWARD_FNS[cfg.name], format_weight=cfg.format_weight)


def domain_reward_fn(
    response: str, ground_truth: tuple, *, fns: dict[str, RewardFn]
) -> dict[str, float]:
    """A task mixture's reward (``data.mixture``): ``ground_truth`` is (the problem's domain, its
    truth) and the domain's own verifier in ``fns`` scores the response (picklable as a
    ``functools.partial`` when each of ``fns`` is)."""
    domain, truth = ground_truth
    return fns[domain](response, truth)


def make_r1_zero_reward_fn(format_weight: float = 0.0) -> RewardFn:
    """``r1_zero_reward_fn`` with reward = answer + format_weight * format (picklable)."""
    return make_reward_fn(RewardConfig(name="r1_zero", format_weight=format_weight))
