"""GradingPool: parallel grading with a per-call deadline that survives hangs, crashes and errors.

The helper reward functions below live at module level so the worker processes can unpickle them.
"""

import os
import subprocess
import sys
import time

import pytest

from jaxrlvr import rewards
from jaxrlvr.rewards import grading

ZERO = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}


def sometimes_hang(response, truth):
    if response == "hang":
        time.sleep(3600)
    return rewards.synthetic_reward_fn(response, truth)


def sometimes_raise(response, truth):
    if response == "raise":
        raise RuntimeError("grader bug")
    if response == "not-a-dict":
        return 1.0
    return rewards.synthetic_reward_fn(response, truth)


def sometimes_die(response, truth):
    if response == "die":
        os._exit(3)  # the worker vanishes as if killed by the OS
    return rewards.synthetic_reward_fn(response, truth)


@pytest.fixture(scope="module")
def pool():
    # 2 s deadline: long enough for any honest grading call here (milliseconds), short enough
    # to keep the hang tests quick.
    with grading.GradingPool(num_workers=2, timeout_s=2.0) as p:
        yield p


def test_results_keep_input_order(pool):
    truths = list(range(40))
    responses = [f"<answer>{t if t % 3 else t + 1}</answer>" for t in truths]
    scores, stats = pool.grade(rewards.synthetic_reward_fn, responses, truths)
    assert [s["answer_reward"] for s in scores] == [0.0 if t % 3 == 0 else 1.0 for t in truths]
    assert (stats.n, stats.timeouts, stats.errors) == (40, 0, 0)
    assert stats.seconds > 0


def test_matches_in_process_grading(pool):
    responses = [
        "x </think> <answer>\\frac12</answer>",
        "x </think> <answer>0.5</answer>",
        "x </think> <answer>2</answer>",
        "x </think><answer>0.5</answer>",
    ]
    truths = ["1/2"] * 4
    expected, _ = grading.grade_in_process(rewards.r1_zero_reward_fn, responses, truths)
    scores, _ = pool.grade(rewards.r1_zero_reward_fn, responses, truths)
    assert scores == expected
    assert [s["reward"] for s in scores] == [1.0, 1.0, 0.0, 0.0]


def test_hung_grader_is_cut_off_and_pool_recovers(pool):
    started = pool.workers_started
    responses = ["7", "hang", "8", "hang", "9"]
    scores, stats = pool.grade(sometimes_hang, responses, [7, 7, 8, 8, 0])
    assert stats.timeouts == 2 and stats.errors == 0
    assert scores[1] == ZERO and scores[3] == ZERO
    assert [scores[i]["answer_reward"] for i in (0, 2, 4)] == [1.0, 1.0, 0.0]
    assert pool.workers_started == started + 2  # each hung worker was replaced
    # The next call works normally.
    scores, stats = pool.grade(rewards.synthetic_reward_fn, ["5"], [5])
    assert scores[0]["reward"] == 1.0 and stats.timeouts == 0


def test_grader_exceptions_score_zero_and_are_counted(pool):
    scores, stats = pool.grade(sometimes_raise, ["raise", "3", "not-a-dict"], [3, 3, 3])
    assert stats.errors == 2 and stats.timeouts == 0
    assert scores[0] == ZERO and scores[2] == ZERO
    assert scores[1]["reward"] == 1.0


def test_dead_worker_is_replaced(pool):
    started = pool.workers_started
    scores, stats = pool.grade(sometimes_die, ["die", "4"], [4, 4])
    assert stats.errors == 1
    assert scores == [ZERO, {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}]
    assert pool.workers_started == started + 1
    scores, _ = pool.grade(rewards.synthetic_reward_fn, ["4"] * 4, [4] * 4)
    assert all(s["reward"] == 1.0 for s in scores)


ADVERSARIAL = {
    "100k-chars": ("x" * 100_000 + " </think> <answer>5</answer>", 1.0),
    "unclosed-boxed": (" </think> <answer>\\boxed{5</answer>", 0.0),
    "frac200": (" </think> <answer>" + "\\frac{1}{" * 200 + "2" + "}" * 200 + "</answer>", 0.0),
    "tower": (" </think> <answer>10^{10^{10^{10}}}</answer>", 0.0),
    "factorial": (" </think> <answer>1000000!</answer>", 0.0),
    "5000-digits": (" </think> <answer>" + "5" * 5000 + "</answer>", 0.0),
    "surrogates": ("\ud800\udc00\udfff </think> <answer>\ud8006\udfff</answer>", 0.0),
    "repeated-tags": ("</think> <answer>" * 5000 + "5</answer>", 1.0),
}


def test_adversarial_batch_through_pool(pool):
    names = list(ADVERSARIAL)
    responses = [ADVERSARIAL[n][0] for n in names]
    scores, stats = pool.grade(rewards.r1_zero_reward_fn, responses, ["5"] * len(names))
    # The guards make each of these a millisecond-scale call, so none should need the deadline;
    # a timeout here means a guard regressed (the pool would still have returned zeros).
    assert stats.timeouts == 0 and stats.errors == 0
    assert {n: s["reward"] for n, s in zip(names, scores)} == {n: ADVERSARIAL[n][1] for n in names}


def test_argument_errors(pool):
    with pytest.raises(ValueError, match="2 responses but 1 truths"):
        pool.grade(rewards.r1_zero_reward_fn, ["a", "b"], ["1"])
    with pytest.raises(TypeError, match="picklable"):
        pool.grade(lambda r, t: {}, ["a"], ["1"])
    assert pool.grade(rewards.r1_zero_reward_fn, [], [])[1].n == 0


def test_config_validation():
    with pytest.raises(ValueError, match="num_workers"):
        grading.GradingPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        grading.GradingPool(timeout_s=0)
    with pytest.raises(ValueError, match="start_method.*forkserver"):
        grading.GradingPool(start_method="fork")


def test_spawn_pool_and_close():
    pool = grading.GradingPool(num_workers=1, timeout_s=30.0, start_method="spawn")
    scores, stats = pool.grade(rewards.gsm8k_reward_fn, ["so 12", "so 13"], ["#### 12"] * 2)
    assert [s["reward"] for s in scores] == [1.0, 0.0]
    pool.close()
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pool.grade(rewards.gsm8k_reward_fn, ["1"], ["1"])


def test_stats_metrics():
    stats = grading.GradingStats(n=4, timeouts=1, errors=2, seconds=0.5)
    assert stats.as_metrics() == {
        "grading/n": 4.0,
        "grading/timeouts": 1.0,
        "grading/errors": 2.0,
        "grading/seconds": 0.5,
    }


def test_pool_starts_from_a_parent_running_jax():
    # The trainer's process holds JAX's threads; the workers must not be forked from it.
    import jax.numpy as jnp

    assert float(jnp.arange(4.0).sum()) == 6.0
    with grading.GradingPool(num_workers=1, timeout_s=30.0) as pool:
        scores, stats = pool.grade(rewards.r1_zero_reward_fn, [" </think> <answer>6</answer>"], [6])
    assert scores[0]["reward"] == 1.0 and stats.errors == 0


def test_rewards_and_data_do_not_import_jax():
    code = (
        "import sys\n"
        "import jaxrlvr.rewards, jaxrlvr.data, jaxrlvr.data.tokenizer\n"
        "assert 'jax' not in sys.modules, 'jax was imported'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)
