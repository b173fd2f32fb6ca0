"""A seeded arithmetic task whose answers need a variable amount of written work.

A problem is an equation of ``min_steps`` to ``max_steps`` additions and subtractions (the
chains of ``jaxrlvr.data.synthetic``, every intermediate value in ``[0, max_value]``), for example
``"7 + 5 - 3 + 8 ="`` -> ``17``. Each problem carries a worked solution (``Problem.solution``) in
one of four verbosities, drawn per problem with ``verbosity_weights``, so that an SFT warm start on
them gives a policy whose response length can move under RL:

=========== ================================ ==========================================
verbosity   written work (``solution``)      tokens under the character tokenizer
=========== ================================ ==========================================
none        (nothing)                        0
results     ``12 9 17``                      ~3 per step
steps       ``7+5=12 12-3=9 9+8=17``         ~7 per step
verbose     ``7 + 5 = 12. 12 - 3 = 9. ...``  ~13 per step
=========== ================================ ==========================================

The work is followed by one space (and nothing when there is no work), so ``data.gold_format``
``" {solution}<answer>{answer}</answer>"`` gives ``" 7+5=12 12-3=9 9+8=17 <answer>17</answer>"``
and ``" <answer>17</answer>"``. Writing the intermediate results is what a ~1M-parameter model
needs to get multi-step chains right, so RL has a reason to change how much it writes.
Grading is the question-only verifier (``jaxrlvr.rewards.question_only_reward_fn``: the last
closed ``<answer>`` block, exact integer), or ``r1_zero_reward_fn`` with the R1-Zero template and
a ``"</think> <answer>"`` gold format.

``make_splits`` gives disjoint train and eval problems, deterministic in the seed;
``parse_work`` reads written work back into its steps (tests and analyses use it).
Left out: multiplication (its brackets would make the equation, not the work, the long part) and
any natural-language variety.
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import Literal, get_args

from jaxrlvr.data import loading, synthetic

Verbosity = Literal["none", "results", "steps", "verbose"]
VERBOSITIES: tuple[Verbosity, ...] = get_args(Verbosity)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScratchpadConfig:
    """The task's size and the mixture of worked-solution verbosities.

    Attributes:
      min_steps, max_steps: operations per problem, drawn uniformly from this range.
      max_operand: operands are drawn from ``[0, max_operand]``.
      max_value: every intermediate value and the answer stay in ``[0, max_value]``.
      verbosity_weights: relative weights of ``none``, ``results``, ``steps``, ``verbose``.
    """

    min_steps: int = 2
    max_steps: int = 4
    max_operand: int = 9
    max_value: int = 30
    verbosity_weights: tuple[float, float, float, float] = (1.0, 1.0, 1.0, 1.0)

    def __post_init__(self):
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(
                f"ScratchpadConfig needs 1 <= min_steps <= max_steps, got min_steps="
                f"{self.min_steps}, max_steps={self.max_steps}"
            )
        # Validates max_operand / max_value with synthetic's own checks.
        self.chain_config(self.min_steps)
        weights = tuple(self.verbosity_weights)
        if len(weights) != len(VERBOSITIES) or any(not w >= 0 for w in weights) or not any(weights):
            raise ValueError(
                f"ScratchpadConfig.verbosity_weights must be {len(VERBOSITIES)} weights >= 0 "
                f"(for {', '.join(VERBOSITIES)}), not all 0; got {self.verbosity_weights!r}"
            )
        object.__setattr__(self, "verbosity_weights", tuple(float(w) for w in weights))

    def chain_config(self, num_steps: int) -> synthetic.SyntheticConfig:
        """The synthetic chain of ``num_steps`` additions and subtractions this task draws."""
        return synthetic.SyntheticConfig(
            num_steps=num_steps,
            max_operand=self.max_operand,
            max_value=self.max_value,
            operations="add_sub",
        )


def write_work(start: int, steps: list[tuple[str, int]], verbosity: Verbosity) -> str:
    """The written work for a chain: ``""`` for ``none``, else the steps and one trailing space."""
    if verbosity not in VERBOSITIES:
        raise ValueError(f"verbosity must be one of {VERBOSITIES}, got {verbosity!r}")
    if verbosity == "none":
        return ""
    parts, value = [], start
    for op, operand in steps:
        new = synthetic.apply_op(value, op, operand)
        if verbosity == "results":
            parts.append(f"{new}")
        elif verbosity == "steps":
            parts.append(f"{value}{op}{operand}={new}")
        else:
            parts.append(f"{value} {op} {operand} = {new}.")
        value = new
    return " ".join(parts) + " "


_STEP = re.compile(r"(\d+) ?([+-]) ?(\d+) ?= ?(\d+)")


def parse_work(text: str) -> list[tuple[int, str, int, int]]:
    """The ``a op b = c`` steps written in ``text`` (either spelling), in order.

    Text other than steps (the ``results`` style's bare numbers, the answer block) is ignored.
    """
    return [(int(a), op, int(b), int(c)) for a, op, b, c in _STEP.findall(text)]


def generate_problem(rng: random.Random, cfg: ScratchpadConfig) -> tuple[str, int, str]:
    """One ``(question, answer, worked solution)`` drawn from ``rng``."""
    num_steps = rng.randint(cfg.min_steps, cfg.max_steps)
    start, steps, value = synthetic.draw_chain(rng, cfg.chain_config(num_steps))
    verbosity = rng.choices(VERBOSITIES, weights=cfg.verbosity_weights)[0]
    return synthetic.equation_text(start, steps), value, write_work(start, steps, verbosity)


def make_splits(
    seed: int, n_train: int, n_eval: int, cfg: ScratchpadConfig | None = None
) -> tuple[list[loading.Problem], list[loading.Problem]]:
    """Disjoint train and eval problems (no question text in both), deterministic in ``seed``.

    Every problem's ``solution`` holds its written work (see the module docstring).

    Raises:
      ValueError: when the config has too few distinct questions for ``n_train + n_eval``.
    """
    cfg = cfg or ScratchpadConfig()
    if n_train < 0 or n_eval < 0:
        raise ValueError("make_splits needs n_train >= 0 and n_eval >= 0")
    rng = random.Random(seed)

    def draw():
        question, answer, work = generate_problem(rng, cfg)
        return question, (answer, work)

    seen = synthetic.distinct_problems(draw, n_train + n_eval, f"scratchpad task {cfg}")
    problems = [
        loading.Problem(question=q, answer=str(a), id=synthetic.problem_id(q, "pad"), solution=work)
        for q, (a, work) in seen.items()
    ]
    return problems[:n_train], problems[n_train:]
