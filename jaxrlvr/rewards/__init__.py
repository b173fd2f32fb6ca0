"""Verifiable rewards: R1-Zero format and answer equivalence, GSM8K, code run against tests in a
sandbox, and time-bounded grading.

Plain host-side Python (no JAX). The submodules:

- ``math_equiv``: ``is_equivalent(pred, gold)`` (math-verify plus normalisations).
- ``verifiers``: the reward functions and the ``RewardFn`` interface.
- ``language``: DeepSeek-R1's language-consistency reward (``reward.language``).
- ``grading``: ``GradingPool``, a process pool with a per-call deadline, and ``GradingStats``.
- ``code``: ``code_reward_fn`` (``reward.fn: code``), ``CodeTask`` (a code problem's tests),
  ``CodeRewardConfig``; the programs run in ``jaxrlvr.sandbox`` (docs/code.md).

The names below are re-exported for the training loop and users.
"""

from jaxrlvr.rewards import code, grading, math_equiv, verifiers
from jaxrlvr.rewards.code import CodeRewardConfig, CodeTask, code_reward_fn
from jaxrlvr.rewards.grading import GradingPool, GradingStats, grade_in_process
from jaxrlvr.rewards.math_equiv import is_equivalent
from jaxrlvr.rewards.verifiers import (
    RewardConfig,
    RewardFn,
    gsm8k_reward_fn,
    make_r1_zero_reward_fn,
    make_reward_fn,
    question_only_reward_fn,
    r1_zero_reward_fn,
    synthetic_reward_fn,
    zero_reward,
)

__all__ = [
    "CodeRewardConfig",
    "CodeTask",
    "GradingPool",
    "GradingStats",
    "RewardConfig",
    "RewardFn",
    "code",
    "code_reward_fn",
    "grade_in_process",
    "grading",
    "gsm8k_reward_fn",
    "is_equivalent",
    "make_r1_zero_reward_fn",
    "make_reward_fn",
    "math_equiv",
    "question_only_reward_fn",
    "r1_zero_reward_fn",
    "sandbox",
    "synthetic_reward_fn",
    "verifiers",
    "zero_reward",
]
