"""The filters that run on problems before RL, and their configs: guessable formats, problems
solved without chain of thought, and best-of-k difficulty.

- **guessable** (Kimi k1.5 drops multiple-choice and true/false problems "because they are
  guessable"): ``guessable_reason(question, answer)`` is the rule, read from the gold answer
  first (normalised: stripped, lower case, surrounding ``$``, ``\\text{}``, ``\\boxed{}``,
  parentheses and a final period removed):

  - ``true_false``: the gold answer is ``true``, ``false``, ``t`` or ``f``;
  - ``yes_no``: the gold answer is ``yes`` or ``no``;
  - ``multiple_choice``: the gold answer is one option letter ``A``-``E`` (as written:
    "C", "(C)", "C)", "C.") and the question lists at least two options, the answer's among
    them, each an option letter in parentheses ("(A)"), followed by ")" ("A) 3 B) 5"), or at
    the start of a line followed by "." ("B. 5"); or the question names "answer choices" /
    "options:".

  A problem whose answer is a number, expression or word is never guessable, whatever its
  question says; a lower-case ``a`` (a variable) is never an option letter.
- **no-CoT** (Qwen3 removes "problems solvable without CoT"): the policy answers with its
  thinking cut off, ``k`` samples; the problem is dropped when the share answered correctly is
  at least ``threshold`` (``solved_without_cot``). The sampling lives in ``jaxrlvr.curate``.
- **difficulty** (Qwen3's best-of-N difficulty filtering; the offline form of the RL phase's
  ``rl.difficulty_filter``): ``k`` samples with thinking; kept when ``low < pass rate < high``
  (``informative``; the default 0 < rate < 1 is the RL phase's rule: the policy solves it
  sometimes, so its group has a learning signal).

Their order in ``jaxrlvr curate`` is fixed: decontamination, guessable, no-CoT, difficulty:
the model-free rules first, then the short no-CoT samples, then the full samples on what is
left.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

GuessableKind = Literal["true_false", "yes_no", "multiple_choice"]

_ANSWER_WRAPPERS = re.compile(r"^\\(?:text|textbf|mathrm|boxed)\{(.*)\}$")
_LETTER = re.compile(r"^\(?([A-E])[).]?$")
_OPTION_PAREN = re.compile(r"\(([A-E])\)")
_OPTION_LINE = re.compile(r"(?m)^\s*([A-E])[).]\s")
_OPTION_INLINE = re.compile(r"(?:^|\s)([A-E])\)\s")
_CHOICES_WORDS = re.compile(r"answer choices|options?:", re.IGNORECASE)


def _gold_text(answer: str) -> str:
    text = answer.strip().rstrip(".").strip().strip("$").strip()
    while (m := _ANSWER_WRAPPERS.match(text)) is not None:
        text = m.group(1).strip()
    return text.rstrip(".").strip()


def guessable_reason(question: str, answer: str) -> GuessableKind | None:
    """Which guessable format the problem has (module docstring), or None."""
    gold = _gold_text(answer)
    low = gold.lower().strip("()")
    if low in ("true", "false", "t", "f"):
        return "true_false"
    if low in ("yes", "no"):
        return "yes_no"
    if (m := _LETTER.match(gold)) is not None:
        letters = {
            *_OPTION_PAREN.findall(question),
            *_OPTION_LINE.findall(question),
            *_OPTION_INLINE.findall(question),
        }
        if (len(letters) >= 2 and m.group(1) in letters) or _CHOICES_WORDS.search(question):
            return "multiple_choice"
    return None


def solved_without_cot(rate: float, threshold: float) -> bool:
    """Whether a problem answered correctly in ``rate`` of its no-thinking samples is dropped."""
    return rate >= threshold


def informative(rate: float, low: float = 0.0, high: float = 1.0) -> bool:
    """Whether a problem with pass rate ``rate`` over its ``k`` samples is kept by the
    difficulty filter: ``low < rate < high``."""
    return low < rate < high


@dataclasses.dataclass(frozen=True, kw_only=True)
class GuessableConfig:
    """``enabled``: drop problems ``guessable_reason`` flags."""

    enabled: bool = False


@dataclasses.dataclass(frozen=True, kw_only=True)
class NoCoTConfig:
    """The no-CoT filter (module docstring).

    Attributes:
      enabled: run it.
      k: samples per problem with the thinking cut off.
      threshold: drop when the share of correct samples is >= this.
      forced_text: appended to the prompt so that the completion starts after the thinking (and
        graded as the start of the response). None: ``FORCED_TEXT`` of ``data.template``.
      max_tokens: new tokens per sample (None: ``sampler.max_tokens``).
      seed: the sampler's seed.
    """

    enabled: bool = False
    k: int = 4
    threshold: float = 0.5
    forced_text: str | None = None
    max_tokens: int | None = None
    seed: int = 0

    def __post_init__(self):
        if not (isinstance(self.k, int) and self.k >= 1):
            raise ValueError(f"no_cot.k={self.k!r}: expected an int >= 1")
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"no_cot.threshold={self.threshold!r}: expected a share in (0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"no_cot.max_tokens={self.max_tokens!r}: expected >= 1 or null")


# The forced close-think text of each template (``NoCoTConfig.forced_text``); chat: Qwen3's empty
# thinking block.
FORCED_TEXT = {
    "r1_zero": "</think> <answer>",
    "question_only": " <answer>",
    "chat": "<think>\n\n</think>\n\n",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DifficultyConfig:
    """The best-of-k difficulty filter (module docstring): ``k`` samples per problem with the
    run's sampler settings; kept when ``low < pass rate < high``; ``seed``: the sampler's."""

    enabled: bool = False
    k: int = 8
    low: float = 0.0
    high: float = 1.0
    seed: int = 1

    def __post_init__(self):
        if not (isinstance(self.k, int) and self.k >= 1):
            raise ValueError(f"difficulty.k={self.k!r}: expected an int >= 1")
        if not 0.0 <= self.low < self.high <= 1.0:
            raise ValueError(
                f"difficulty.low={self.low!r}, high={self.high!r}: expected 0 <= low < high <= 1"
            )
