"""The code reward: extraction, test splitting, scoring modes, config validation, and grading
through the GradingPool (warm sandboxes in its workers)."""

from __future__ import annotations

import functools
import os
import pickle
import shutil

import pytest

from jaxrlvr import config as config_lib
from jaxrlvr import configlib, sandbox
from jaxrlvr.rewards import code, grading

needs_bwrap = pytest.mark.skipif(
    shutil.which("bwrap") is None and os.environ.get("CI") != "1",
    reason="bubblewrap not installed (scripts/setup_env.sh installs it)",
)
TASK = code.CodeTask(
    tests=("assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4")
)
CORRECT = "```python\ndef add(a, b):\n    return a + b\n```"


def test_extract_code_blocks():
    assert code.extract_code("x <answer>y = 1</answer>") == "y = 1"
    assert code.extract_code("```python\na = 1\n```\ntext\n```\nb = 2\n```") == "b = 2\n"
    # whichever closes last wins; an answer block holding a fence gives the fence's content
    assert code.extract_code("```py\na = 1\n```<answer>c</answer>") == "c"
    assert code.extract_code("<answer>```python\nd = 4\n```</answer>") == "d = 4\n"
    assert code.extract_code("no code here") is None
    assert code.extract_code("<answer>unclosed") is None
    assert code.extract_code("    return 1\n", "raw") == "    return 1\n"


def test_split_test_value_and_statement_tests():
    assert code.split_test("assert f(1) == 2") == {"expr": "f(1)", "expected": "2"}
    assert code.split_test("assert [1, 2] == f(3)") == {"expr": "f(3)", "expected": "[1, 2]"}
    assert code.split_test("assert f('a') == ('a', None)") == {
        "expr": "f('a')",
        "expected": "('a', None)",
    }
    for stmt in ("assert f(1) == g(2)", "assert f(1)", "assert f(1) != 2", "check(f)", "a b c"):
        assert code.split_test(stmt) == {"stmt": stmt}


def test_code_task_json_round_trip_and_validation():
    task = code.CodeTask(tests=("assert f(1) == 1",), prefix="def f(x):\n", setup="import math")
    assert code.CodeTask.from_json(task.to_json()) == task
    with pytest.raises(ValueError, match="at least one test"):
        code.CodeTask(tests=())


def test_code_reward_config_validation_names_the_key():
    with pytest.raises(ValueError, match="reward.code.mode"):
        code.CodeRewardConfig(mode="most")
    with pytest.raises(ValueError, match="reward.code.extract"):
        code.CodeRewardConfig(extract="fenced")
    with pytest.raises(ValueError, match="reward.code.test_timeout_s"):
        code.CodeRewardConfig(test_timeout_s=0)
    with pytest.raises(ValueError, match="reward.sandbox"):
        sandbox.SandboxConfig(kind="docker")
    cfg = configlib.build(
        config_lib.TrainConfig,
        {"reward": {"fn": "code", "sandbox": "none", "code": {"mode": "all_pass"}}},
    )
    assert cfg.reward.code.mode == "all_pass" and cfg.reward.sandbox == "none"
    with pytest.raises(ValueError, match="reward.sandbox"):
        configlib.build(config_lib.TrainConfig, {"reward": {"sandbox": "docker"}})


@needs_bwrap
def test_modes_and_format():
    truth = TASK.to_json()
    half = "<answer>def add(a, b):\n    return 3</answer>"
    fraction = code.make_code_reward_fn(code.CodeRewardConfig(), format_weight=0.5)
    all_pass = code.make_code_reward_fn(code.CodeRewardConfig(mode="all_pass"))
    assert fraction(CORRECT, truth) == {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.5}
    assert fraction(half, truth)["answer_reward"] == pytest.approx(1 / 3)
    assert all_pass(half, truth)["answer_reward"] == 0.0
    assert all_pass(CORRECT, truth)["answer_reward"] == 1.0
    # no block, or a block that does not compile: all zero
    assert fraction("def add(a, b): return a + b", truth)["reward"] == 0.0
    assert fraction("<answer>def add(a, b) return</answer>", truth)["reward"] == 0.0


@needs_bwrap
def test_prefix_and_setup_humaneval_style():
    task = code.CodeTask(
        tests=("check(inc)",),
        prefix="def inc(x):\n",
        setup="def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(0) == 1\n",
        entry_point="inc",
    )
    raw = code.make_code_reward_fn(code.CodeRewardConfig(extract="raw"))
    assert raw("    return x + 1\n", task.to_json())["reward"] == 1.0
    assert raw("    return x\n", task.to_json())["reward"] == 0.0


@needs_bwrap
def test_per_test_time_limit_keeps_the_other_tests():
    task = code.CodeTask(tests=("assert f(0) == 0", "assert f(1) == 1", "assert f(2) == 2"))
    program = "<answer>def f(x):\n    while x == 1:\n        pass\n    return x</answer>"
    fn = code.make_code_reward_fn(code.CodeRewardConfig(test_timeout_s=0.5, program_timeout_s=3.0))
    # The harness stops at the first test over its limit: the earlier test counts.
    assert fn(program, task.to_json())["answer_reward"] == pytest.approx(1 / 3)


@needs_bwrap
def test_grading_pool_runs_code_rewards_in_its_workers():
    fn = code.make_code_reward_fn(
        code.CodeRewardConfig(mode="all_pass", test_timeout_s=1.0, program_timeout_s=1.0)
    )
    pickle.dumps(fn)
    assert isinstance(fn, functools.partial)
    wrong = "<answer>def add(a, b):\n    return a - b</answer>"
    hang = "<answer>import time\ntime.sleep(60)</answer>"
    responses = [CORRECT, wrong, hang, "no code"] * 3
    with grading.GradingPool(num_workers=2, timeout_s=20.0) as pool:
        scores, stats = pool.grade(fn, responses, [TASK.to_json()] * len(responses))
    assert [s["reward"] for s in scores] == [1.0, 0.0, 0.0, 0.0] * 3
    assert stats.errors == 0 and stats.timeouts == 0


@needs_bwrap
def test_verifiers_reward_config_names_code():
    from jaxrlvr.rewards import verifiers

    fn = verifiers.make_reward_fn(verifiers.RewardConfig(name="code", format_weight=0.25))
    assert fn(CORRECT, TASK.to_json()) == {
        "format_reward": 1.0,
        "answer_reward": 1.0,
        "reward": 1.25,
    }


def _code_cfg(**reward):
    return configlib.build(config_lib.TrainConfig, {"reward": {"fn": "code", **reward}})


def test_build_grader_without_bwrap_is_one_line_naming_it(monkeypatch, tmp_path):
    from jaxrlvr import builders

    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(configlib.ConfigKeyError) as err:
        builders.build_grader(_code_cfg())
    assert "\n" not in str(err.value) and "bubblewrap" in str(err.value)
    assert "reward.sandbox" in str(err.value)


def test_build_grader_sandbox_none_warns_and_grades(capfd):
    from jaxrlvr import builders

    grader = builders.build_grader(_code_cfg(sandbox="none", num_workers=1))
    with grader.pool:
        assert "WITHOUT a sandbox" in capfd.readouterr().err
        scores, _ = grader.pool.grade(grader.reward_fn, [CORRECT], [TASK.to_json()])
    assert scores[0]["reward"] == 1.0
    assert grader.pool.timeout_s >= code.CodeRewardConfig().program_timeout_s
