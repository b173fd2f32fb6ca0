"""A seeded multiplication task that a tiny model can only solve with a tool.

A problem multiplies two integers of ``min_digits`` to ``max_digits`` digits (``"347*5821="`` ->
``2019887``): products of up to eight digits, which a ~1M-parameter model trained from scratch
cannot compute in its head, but can get exactly by copying the operands into a Python call and the
printed result into its answer. Each problem carries the tool call as its worked solution
(``Problem.solution`` = ``<python>print(347*5821)</python>``), so ``data.gold_format``
``"{solution}<output>{answer}</output> <answer>{answer}</answer>"`` gives the whole tool-use
trace an SFT warm start learns from (the ``<output>`` piece is the environment's and is masked
out of the SFT loss, ``envs.split_trace``). Grading is the question-only verifier (the last
closed ``<answer>`` block, exact integer), so a tool output alone earns nothing.

``make_splits`` gives disjoint train and eval problems, deterministic in the seed.
"""

from __future__ import annotations

import dataclasses
import random

from jaxrlvr.data import loading, synthetic


@dataclasses.dataclass(frozen=True, kw_only=True)
class MultiplicationConfig:
    """Operand sizes: each operand has ``min_digits`` to ``max_digits`` digits."""

    min_digits: int = 3
    max_digits: int = 4

    def __post_init__(self):
        if not (1 <= self.min_digits <= self.max_digits <= 12):
            raise ValueError(
                "data.multiplication needs 1 <= min_digits <= max_digits <= 12, got "
                f"{self.min_digits}, {self.max_digits}"
            )


def draw(rng: random.Random, cfg: MultiplicationConfig) -> tuple[int, int]:
    def operand() -> int:
        digits = rng.randint(cfg.min_digits, cfg.max_digits)
        return rng.randint(10 ** (digits - 1), 10**digits - 1)

    return operand(), operand()


def tool_call(a: int, b: int) -> str:
    """The Python call that solves ``a*b``."""
    return f"<python>print({a}*{b})</python>"


def make_splits(
    seed: int, n_train: int, n_eval: int, cfg: MultiplicationConfig = MultiplicationConfig()
) -> tuple[list[loading.Problem], list[loading.Problem]]:
    """Disjoint train and eval problems (no question in both), deterministic in ``seed``."""
    rng = random.Random(seed)

    def one() -> tuple[str, tuple[int, int]]:
        a, b = draw(rng, cfg)
        return f"{a}*{b}=", (a, b)

    seen = synthetic.distinct_problems(one, n_train + n_eval, f"multiplication {cfg}")
    problems = [
        loading.Problem(
            question=q,
            answer=str(a * b),
            id=synthetic.problem_id(q, prefix="mul"),
            solution=tool_call(a, b),
        )
        for q, (a, b) in seen.items()
    ]
    return problems[:n_train], problems[n_train:]
