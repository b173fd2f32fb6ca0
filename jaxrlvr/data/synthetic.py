"""A procedural, seeded arithmetic task with exact integer answers, for the demo and the tests.

A problem is a chain of ``num_steps`` operations on small non-negative integers, every
intermediate value kept in ``[0, max_value]``, written either as an equation (``"7 + 5 - 3 ="``,
a few tokens under the character tokenizer, learnable by a ~1M-parameter model) or as a short word
problem. Difficulty levels 1-5 are presets (``SyntheticConfig.from_level``); any config can be
passed instead. Answers are exact integers (the ``Problem.answer`` string of an int), graded by
``jaxrlvr.rewards.synthetic_reward_fn``.

``make_splits`` draws distinct questions and splits them into train and eval sets that share no
question text. Left out: any natural-language variety beyond a few fixed sentence templates.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections.abc import Callable
from typing import Literal, TypeVar, get_args

from jaxrlvr.data import loading

Operations = Literal["add_sub", "add_sub_mul"]
Style = Literal["equation", "word"]

T = TypeVar("T")

_NAMES = ("Ana", "Ben", "Cleo", "Dev", "Eli", "Fay", "Gus", "Hana")
_ITEMS = ("apples", "coins", "marbles", "stamps", "books", "shells")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticConfig:
    """Difficulty of the synthetic task.

    Attributes:
      num_steps: operations per problem (>= 1).
      max_operand: operands are drawn from ``[0, max_operand]`` (``[2, max_operand]`` for x).
      max_value: every intermediate value and the answer stay in ``[0, max_value]``.
      operations: ``add_sub`` or ``add_sub_mul``.
      style: ``equation`` (``"7 + 5 - 3 ="``) or ``word`` (a short story).
    """

    num_steps: int = 2
    max_operand: int = 9
    max_value: int = 99
    operations: Operations = "add_sub"
    style: Style = "equation"

    def __post_init__(self):
        if self.num_steps < 1:
            raise ValueError(f"SyntheticConfig.num_steps must be >= 1, got {self.num_steps}")
        if self.max_operand < 1:
            raise ValueError(f"SyntheticConfig.max_operand must be >= 1, got {self.max_operand}")
        if self.max_value < self.max_operand:
            raise ValueError("SyntheticConfig.max_value must be >= max_operand")
        if self.operations not in get_args(Operations):
            raise ValueError(
                f"SyntheticConfig.operations must be one of {get_args(Operations)}, "
                f"got {self.operations!r}"
            )
        if self.style not in get_args(Style):
            raise ValueError(
                f"SyntheticConfig.style must be one of {get_args(Style)}, got {self.style!r}"
            )

    @classmethod
    def from_level(cls, level: int) -> SyntheticConfig:
        """Presets: 1 ``"7 + 5 ="``; 2 ``"7 + 5 - 3 ="``; 3 three steps with x up to 20;
        4 word problems, three steps up to 50; 5 word problems, five steps up to 99."""
        presets = {
            1: cls(num_steps=1, max_operand=9, max_value=99),
            2: cls(num_steps=2, max_operand=9, max_value=99),
            3: cls(num_steps=3, max_operand=20, max_value=99, operations="add_sub_mul"),
            4: cls(num_steps=3, max_operand=50, max_value=999, style="word"),
            5: cls(
                num_steps=5,
                max_operand=99,
                max_value=9999,
                operations="add_sub_mul",
                style="word",
            ),
        }
        if level not in presets:
            raise ValueError(f"synthetic difficulty level must be one of {sorted(presets)}")
        return presets[level]


def _word_problem(start: int, steps: list[tuple[str, int]], rng: random.Random) -> str:
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    sentences = [f"{name} has {start} {item}."]
    for op, operand in steps:
        if op == "+":
            sentences.append(f"{name} gets {operand} more.")
        elif op == "-":
            sentences.append(f"{name} gives away {operand}.")
        else:
            sentences.append(f"Then the number of {item} is multiplied by {operand}.")
    sentences.append(f"How many {item} does {name} have now?")
    return " ".join(sentences)


def draw_chain(rng: random.Random, cfg: SyntheticConfig) -> tuple[int, list[tuple[str, int]], int]:
    """(start, [(op, operand), ...], value): ``cfg.num_steps`` operations drawn from ``rng``, every
    intermediate value in ``[0, cfg.max_value]``; ``op`` is ``+``, ``-`` or ``*``."""
    ops = ["+", "-"] + (["*"] if cfg.operations == "add_sub_mul" else [])
    value = rng.randint(0, cfg.max_operand)
    start, steps = value, []
    for _ in range(cfg.num_steps):
        choices = []
        for op in ops:
            if op == "+":
                choices.append((op, 0, min(cfg.max_operand, cfg.max_value - value)))
            elif op == "-":
                choices.append((op, 0, min(cfg.max_operand, value)))
            elif op == "*":
                hi = min(cfg.max_operand, cfg.max_value // max(value, 1))
                if hi >= 2:
                    choices.append((op, 2, hi))
        op, lo, hi = rng.choice(choices)
        operand = rng.randint(lo, hi)
        value = apply_op(value, op, operand)
        steps.append((op, operand))
    return start, steps, value


def apply_op(value: int, op: str, operand: int) -> int:
    """``value op operand`` for ``op`` in ``+ - *``."""
    return value + operand if op == "+" else value - operand if op == "-" else value * operand


def equation_text(start: int, steps: list[tuple[str, int]]) -> str:
    """The equation of a chain, read left to right (``"7 + 5 - 3 ="``); a multiplication of a
    compound expression gets brackets, and ``*`` is written ``x``."""
    text = str(start)
    for op, operand in steps:
        if op == "*":
            text = f"({text}) x {operand}" if " " in text else f"{text} x {operand}"
        else:
            text = f"{text} {op} {operand}"
    return text + " ="


def generate_problem(rng: random.Random, cfg: SyntheticConfig) -> tuple[str, int]:
    """One (question, answer) drawn from ``rng``."""
    start, steps, value = draw_chain(rng, cfg)
    if cfg.style == "word":
        return _word_problem(start, steps, rng), value
    return equation_text(start, steps), value


def problem_id(question: str, prefix: str = "syn") -> str:
    """A stable id from the question text: ``prefix-`` and 12 hex digits of its SHA-1."""
    return prefix + "-" + hashlib.sha1(question.encode("utf-8")).hexdigest()[:12]


def distinct_problems(draw: Callable[[], tuple[str, T]], wanted: int, what: str) -> dict[str, T]:
    """``wanted`` draws with distinct question texts, in draw order: ``{question: payload}``.

    ``draw()`` returns ``(question, payload)``; repeated questions are skipped. Raises
    ``ValueError`` naming ``what`` when the question space is (nearly) exhausted.
    """
    seen: dict[str, T] = {}
    misses = 0
    while len(seen) < wanted:
        question, payload = draw()
        if question in seen:
            # Consecutive repeats mean the question space is (nearly) exhausted.
            misses += 1
            if misses > max(10_000, 20 * len(seen)):
                raise ValueError(
                    f"{what} has too few distinct questions for {wanted} problems "
                    f"(found {len(seen)})"
                )
            continue
        seen[question] = payload
        misses = 0
    return seen


def make_splits(
    seed: int, n_train: int, n_eval: int, difficulty: int | SyntheticConfig = 1
) -> tuple[list[loading.Problem], list[loading.Problem]]:
    """Disjoint train and eval problems (no question text in both), deterministic in ``seed``.

    Raises:
      ValueError: when the difficulty has too few distinct questions for ``n_train + n_eval``.
    """
    cfg = (
        difficulty
        if isinstance(difficulty, SyntheticConfig)
        else SyntheticConfig.from_level(difficulty)
    )
    if n_train < 0 or n_eval < 0:
        raise ValueError("make_splits needs n_train >= 0 and n_eval >= 0")
    rng = random.Random(seed)
    seen = distinct_problems(
        lambda: generate_problem(rng, cfg), n_train + n_eval, f"synthetic difficulty {cfg}"
    )
    problems = [
        loading.Problem(question=q, answer=str(a), id=problem_id(q)) for q, a in seen.items()
    ]
    return problems[:n_train], problems[n_train:]
