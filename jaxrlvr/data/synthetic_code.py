"""A procedural, seeded code task: write a one-line Python function from input/output examples.

A problem shows ``num_examples`` examples of a hidden function of one integer and asks for its
body; the prompt ends with the code the answer continues::

    f(3)=6 f(0)=3 f(5)=8 f(1)=4
    def f(x): return

and the reference answer is ``x+3``. The function comes from a few families with small seeded
constants (``x+b``, ``x-b``, ``a*x``, ``x%m``, ``max(x,c)``, ``min(x,c)``, ``x*x+b``, ``x//k``,
``a*x+b``); the grader's tests (``rewards.code.CodeTask``) are the shown examples plus
``num_hidden`` hidden inputs drawn by the same seeded generator, some outside the shown range,
so that an answer that only fits the examples (a lookup table, a wrong family that happens to
agree) fails the rest. Graded by ``rewards.code.code_reward_fn`` (its sandbox runs the program).

``make_splits`` draws distinct prompts and splits them into train and held-out sets that share no
prompt text. Left out: functions of several arguments, strings and lists.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Literal, get_args

from jaxrlvr.data import loading, synthetic
from jaxrlvr.rewards import code

Family = Literal["add", "sub", "mul", "mod", "max", "min", "square", "div", "affine"]
PREFIX = "def f(x): return "


@dataclasses.dataclass(frozen=True, kw_only=True)
class SyntheticCodeConfig:
    """``data.synthetic_code``: the families and sizes of the synthetic code task.

    Attributes:
      families: function families to draw from (``add sub mul mod max min square div affine``).
      max_constant: constants are drawn from ``[1, max_constant]`` (``[2, ...]`` for ``*``,
        ``%``, ``//``).
      max_input: shown inputs are drawn from ``[0, max_input]``.
      num_examples: examples shown in the prompt (distinct inputs).
      num_hidden: further tests, inputs drawn from ``[0, 2 * max_input]``.
    """

    families: tuple[Family, ...] = ("add", "sub", "mul", "max", "min", "mod")
    max_constant: int = 9
    max_input: int = 9
    num_examples: int = 4
    num_hidden: int = 6

    def __post_init__(self):
        object.__setattr__(self, "families", tuple(self.families))
        bad = [f for f in self.families if f not in get_args(Family)]
        if not self.families or bad:
            raise ValueError(
                f"data.synthetic_code.families must be a non-empty list of {get_args(Family)}, "
                f"got {list(self.families)!r}"
            )
        if self.max_constant < 2:
            raise ValueError(
                f"data.synthetic_code.max_constant must be >= 2, got {self.max_constant}"
            )
        if self.num_examples < 1 or self.num_hidden < 0:
            raise ValueError(
                "data.synthetic_code.num_examples must be >= 1 and num_hidden >= 0, got "
                f"{self.num_examples} and {self.num_hidden}"
            )
        if self.max_input + 1 < self.num_examples:
            raise ValueError(
                f"data.synthetic_code.max_input={self.max_input} leaves fewer than "
                f"num_examples={self.num_examples} distinct inputs"
            )


def draw_function(rng: random.Random, cfg: SyntheticCodeConfig) -> str:
    """One function body (a Python expression in ``x``) drawn from ``rng``."""
    family = rng.choice(cfg.families)
    c = rng.randint(1, cfg.max_constant)
    k = rng.randint(2, cfg.max_constant)
    return {
        "add": f"x+{c}",
        "sub": f"x-{c}",
        "mul": f"{k}*x",
        "mod": f"x%{k}",
        "max": f"max(x,{c})",
        "min": f"min(x,{c})",
        "square": f"x*x+{c - 1}" if c > 1 else "x*x",
        "div": f"x//{k}",
        "affine": f"{k}*x+{c}",
    }[family]


def evaluate(body: str, x: int) -> int:
    """The value of a drawn body at ``x`` (trusted: bodies come from ``draw_function``)."""
    return eval(body, {"__builtins__": {"max": max, "min": min}}, {"x": x})  # noqa: S307


def generate_problem(
    rng: random.Random, cfg: SyntheticCodeConfig
) -> tuple[str, str, code.CodeTask]:
    """(prompt, reference body, task) drawn from ``rng``."""
    body = draw_function(rng, cfg)
    shown = rng.sample(range(cfg.max_input + 1), cfg.num_examples)
    hidden = [rng.randint(0, 2 * cfg.max_input) for _ in range(cfg.num_hidden)]
    examples = " ".join(f"f({x})={evaluate(body, x)}" for x in shown)
    prompt = f"{examples}\n{PREFIX.rstrip()}"
    tests = tuple(f"assert f({x}) == {evaluate(body, x)}" for x in shown + hidden)
    return prompt, body, code.CodeTask(tests=tests, prefix=PREFIX, entry_point="f")


def make_splits(
    seed: int, n_train: int, n_eval: int, cfg: SyntheticCodeConfig = SyntheticCodeConfig()
) -> tuple[list[loading.Problem], list[loading.Problem]]:
    """Disjoint train and held-out problems (no prompt in both), deterministic in ``seed``.

    ``Problem.answer`` is the ``CodeTask`` JSON, ``Problem.solution`` the reference body (what
    ``data.gold_format``'s ``{solution}`` inserts for an SFT warm start).
    """
    if n_train < 0 or n_eval < 0:
        raise ValueError("make_splits needs n_train >= 0 and n_eval >= 0")
    rng = random.Random(seed)

    def draw():
        prompt, body, task = generate_problem(rng, cfg)
        return prompt, (body, task)

    seen = synthetic.distinct_problems(draw, n_train + n_eval, f"synthetic code task {cfg}")
    problems = [
        loading.Problem(
            question=q, answer=task.to_json(), id=synthetic.problem_id(q, "code"), solution=body
        )
        for q, (body, task) in seen.items()
    ]
    return problems[:n_train], problems[n_train:]
