"""A grading worker killed with SIGKILL mid-pair: the pool notices, regrades the pair once on a
fresh worker, and keeps going; a pair whose worker dies every time scores zero."""

import os
import signal
import threading
import time

from jaxrlvr import rewards
from jaxrlvr.rewards import grading

ONE = {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
ZERO = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}


def slow_grade(response, truth):
    if response == "suicide":
        os.kill(os.getpid(), signal.SIGKILL)  # dies by a signal every time it is graded
    time.sleep(0.5)
    return rewards.synthetic_reward_fn(response, truth)


def _kill_a_busy_worker(pool, killed):
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        # Private on purpose: the pool exposes no worker processes, and killing the one that is
        # grading (not any child of ours) is the fault under test.
        for w in pool._workers:
            if w.state == "busy":
                # Mid-pair, not a synchronisation: slow_grade takes 0.5 s, and a kill 0.1 s
                # into it lands inside the grading rather than at the hand-over.
                time.sleep(0.1)
                os.kill(w.process.pid, signal.SIGKILL)
                killed.append(w.task)
                return
        time.sleep(0.01)


def test_sigkilled_worker_mid_grade_is_replaced_and_its_pair_regraded():
    with grading.GradingPool(num_workers=2, timeout_s=10.0) as pool:
        # Warm: both workers ready, so the kill lands on a pair, not a start-up.
        pool.grade(rewards.synthetic_reward_fn, ["4"] * 2, [4] * 2)
        started = pool.workers_started
        killed = []
        killer = threading.Thread(target=_kill_a_busy_worker, args=(pool, killed))
        killer.start()
        scores, stats = pool.grade(slow_grade, ["4", "5", "6", "7"], [4, 5, 6, 7])
        killer.join()
        assert len(killed) == 1
        assert scores == [ONE] * 4  # the killed pair was graded again, not zeroed
        assert (stats.crashes, stats.errors, stats.timeouts) == (1, 0, 0)
        assert pool.workers_started == started + 1
        # The pool keeps working afterwards.
        scores, stats = pool.grade(rewards.synthetic_reward_fn, ["4"] * 3, [4] * 3)
        assert scores == [ONE] * 3 and stats.crashes == 0


def test_pair_that_kills_its_worker_twice_scores_zero_and_the_rest_complete():
    with grading.GradingPool(num_workers=2, timeout_s=10.0) as pool:
        scores, stats = pool.grade(slow_grade, ["4", "suicide", "5"], [4, 1, 5])
        assert scores == [ONE, ZERO, ONE]
        assert (stats.crashes, stats.errors) == (2, 1)
