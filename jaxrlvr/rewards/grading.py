"""Parallel, time-bounded grading: a reusable process pool with a per-call deadline.

Verifiers run sympy, which can take unbounded time or memory on adversarial answers
(``10^{10^{10^{10}}}``). ``GradingPool`` runs each (response, truth) pair in a worker process with
its own deadline; a worker that misses it is killed and replaced, and the pair scores zero. Grader
exceptions also score zero. A worker that dies mid-pair is noticed (its pipe closes) and replaced;
killed by a signal from outside, its pair is graded again once. All are counted in
``GradingStats`` and never end the run.

Why processes and not threads or SIGALRM: the trainer's process holds JAX threads, signals only
reach the main thread, and a thread stuck in sympy cannot be stopped. Workers are started with the
``forkserver`` (default) or ``spawn`` method, never ``fork``, so they inherit none of the parent's
JAX state. As with any spawn/forkserver pool, each worker re-imports the parent's main module:
a script that creates a pool needs an ``if __name__ == "__main__":`` guard, and whatever that
module imports at top level (JAX included) is imported by the workers too (it fits in the default
4 GiB worker memory limit, but costs start-up time).

The reward function is pickled to the workers with each call: it must be a module-level function
or a ``functools.partial`` of one. Left out: retries of timed-out pairs (they score zero).

Pairs travel in chunks (about a quarter of a call's pairs per worker message; one message per
pair made the demo's 256-pair step cost 12 ms of pipe round trips against 1 ms of grading): the
worker sends each pair's scores back as soon as it has them, so each pair still has its own
deadline (counted from the previous pair's reply), and the pair a killed worker was on is known
exactly; the chunk's pairs it had not reached are handed to the next idle worker.

``Grader`` is what a run grades with: its reward function, its pool, and the problems' truths
(by domain for a task mixture).
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import multiprocessing.connection
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Literal, get_args

StartMethod = Literal["forkserver", "spawn"]

_ZERO = {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}


@dataclasses.dataclass(frozen=True)
class GradingStats:
    """What happened in one ``grade`` call.

    Attributes:
      n: number of (response, truth) pairs graded.
      timeouts: pairs cut off at the deadline (scored zero).
      errors: pairs whose reward function raised, returned a non-dict, or whose worker died
        (scored zero).
      seconds: wall-clock time of the call.
      crashes: workers that died while grading (each replaced). A worker killed by a signal
        (SIGKILL from outside) has its pair graded again, once, on a fresh worker; a pair whose
        worker exits by itself, or dies on the retry, scores zero and counts in ``errors``.
    """

    n: int
    timeouts: int
    errors: int
    seconds: float
    crashes: int = 0

    def as_metrics(self, prefix: str = "grading/") -> dict[str, float]:
        """Flat float metrics, ready for a metrics writer."""
        return {
            f"{prefix}n": float(self.n),
            f"{prefix}timeouts": float(self.timeouts),
            f"{prefix}errors": float(self.errors),
            f"{prefix}seconds": self.seconds,
        }


def _as_scores(out: Any) -> dict[str, float]:
    if not isinstance(out, dict):
        raise TypeError(f"reward function must return a dict, got {type(out).__name__}")
    return {str(k): float(v) for k, v in out.items()}


def grade_in_process(
    reward_fn: Callable[[str, Any], dict], responses: Sequence[str], truths: Sequence[Any]
) -> tuple[list[dict[str, float]], GradingStats]:
    """Grade serially in this process, without any deadline (trusted inputs, benchmarks).

    Exceptions still score zero and are counted; a hang hangs the caller.
    """
    if len(responses) != len(truths):
        raise ValueError(f"{len(responses)} responses but {len(truths)} truths")
    start = time.perf_counter()
    results, errors = [], 0
    for response, truth in zip(responses, truths, strict=True):
        try:
            results.append(_as_scores(reward_fn(response, truth)))
        except Exception:
            errors += 1
            results.append(dict(_ZERO))
    return results, GradingStats(len(results), 0, errors, time.perf_counter() - start)


def _worker_main(conn: multiprocessing.connection.Connection, memory_limit_mb: int | None) -> None:
    """Worker loop: receive a pickled (fn, responses, truths) chunk, send ("ok", scores) or
    ("error", msg) for each pair in order as soon as it is graded (("fatal", msg) once when the
    chunk cannot be read)."""
    if memory_limit_mb is not None:
        import resource

        limit = memory_limit_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    # Import and warm math-verify before announcing readiness, so that first-call parser setup
    # does not count against a pair's deadline. Where it is not installed (the GPU check
    # machine) integer answers still grade; a LaTeX pair then fails alone, as an error.
    from jaxrlvr.rewards import math_equiv

    try:
        math_equiv.is_equivalent("\\frac{1}{2}", "0.5")
    except ModuleNotFoundError:
        pass
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv_bytes()
        except (EOFError, OSError):
            return
        if not message:
            return
        try:
            fn, responses, truths = pickle.loads(message)
        except BaseException as exc:  # noqa: BLE001 - an unreadable chunk must not kill it
            conn.send(("fatal", f"{type(exc).__name__}: {str(exc)[:200]}"))
            continue
        for response, truth in zip(responses, truths):
            try:
                reply = ("ok", _as_scores(fn(response, truth)))
            except BaseException as exc:  # noqa: BLE001 - a grader failure must not kill the worker
                reply = ("error", f"{type(exc).__name__}: {str(exc)[:200]}")
            conn.send(reply)


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: multiprocessing.connection.Connection
    state: Literal["starting", "idle", "busy"]
    deadline: float  # startup deadline while starting, the current pair's while busy
    # The chunk's pairs not yet answered, in the worker's order: the first is the one it is on.
    tasks: collections.deque = dataclasses.field(default_factory=collections.deque)

    @property
    def task(self) -> int:
        """The pair the worker is on (-1 when none)."""
        return self.tasks[0] if self.tasks else -1


class GradingPool:
    """A reusable pool of grading processes with a per-call deadline.

    Args:
      num_workers: worker processes (>= 1).
      timeout_s: deadline for one (response, truth) pair, counted from when a ready worker
        receives it.
      start_method: ``"forkserver"`` (default; replacements start fast) or ``"spawn"``.
      memory_limit_mb: address-space limit per worker (None for no limit); a grader that exceeds
        it raises MemoryError, which scores zero.
      startup_timeout_s: how long a new worker may take to import the verifiers.

    Use as a context manager, or call ``close()``.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        *,
        start_method: StartMethod = "forkserver",
        memory_limit_mb: int | None = 4096,
        startup_timeout_s: float = 120.0,
    ):
        if num_workers < 1:
            raise ValueError(f"GradingPool num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"GradingPool timeout_s must be > 0, got {timeout_s}")
        if start_method not in get_args(StartMethod):
            raise ValueError(
                f"GradingPool start_method must be one of {get_args(StartMethod)}, "
                f"got {start_method!r}"
            )
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.startup_timeout_s = float(startup_timeout_s)
        self._ctx = multiprocessing.get_context(start_method)
        if start_method == "forkserver":
            # Only takes effect if this process's fork server has not started yet.
            self._ctx.set_forkserver_preload(["jaxrlvr.rewards.verifiers"])
        self._closed = False
        self.workers_started = 0
        self._workers = [self._start_worker() for _ in range(num_workers)]

    # -- worker lifecycle ------------------------------------------------------------------------

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main,
            args=(child_conn, self.memory_limit_mb),
            daemon=True,
            name="jaxrlvr-grader",
        )
        process.start()
        child_conn.close()
        self.workers_started += 1
        return _Worker(process, parent_conn, "starting", time.monotonic() + self.startup_timeout_s)

    @staticmethod
    def _kill(worker: _Worker) -> None:
        if worker.process.is_alive():
            worker.process.kill()
        worker.process.join(timeout=10)
        worker.conn.close()

    def _replace(self, index: int) -> None:
        self._kill(self._workers[index])
        self._workers[index] = self._start_worker()

    # -- public API ------------------------------------------------------------------------------

    def grade(
        self,
        reward_fn: Callable[[str, Any], dict],
        responses: Sequence[str],
        truths: Sequence[Any],
    ) -> tuple[list[dict[str, float]], GradingStats]:
        """Grade ``reward_fn(responses[i], truths[i])`` for every i, in parallel.

        Returns:
          (scores, stats): ``scores[i]`` is the reward function's dict for pair i, or all zeros
          (``format_reward``, ``answer_reward``, ``reward``) when it timed out or failed.
        """
        if self._closed:
            raise RuntimeError("GradingPool is closed")
        if len(responses) != len(truths):
            raise ValueError(f"{len(responses)} responses but {len(truths)} truths")
        try:
            pickle.dumps(reward_fn)
        except Exception as exc:
            raise TypeError(
                "reward_fn must be picklable (a module-level function or functools.partial)"
            ) from exc
        start = time.perf_counter()
        pending = collections.deque(range(len(responses)))
        results: list[dict[str, float] | None] = [None] * len(responses)
        timeouts = errors = crashes = 0
        retried: set[int] = set()

        # About a quarter of the call's pairs per chunk and worker: few messages, and a slow
        # worker leaves the last chunks to the others.
        chunk = max(1, -(-len(responses) // (4 * self.num_workers)))

        def requeue(worker: _Worker) -> None:
            """The chunk's pairs the worker did not reach go back to the front of the queue."""
            while worker.tasks:
                pending.appendleft(worker.tasks.pop())

        while pending or any(w.state == "busy" for w in self._workers):
            now = time.monotonic()
            for index, worker in enumerate(self._workers):
                if worker.state == "idle" and pending:
                    ids = [pending.popleft() for _ in range(min(chunk, len(pending)))]
                    payload = (reward_fn, [responses[i] for i in ids], [truths[i] for i in ids])
                    try:
                        worker.conn.send_bytes(pickle.dumps(payload))
                    except OSError:
                        # The worker died while idle: replace it and retry the pairs later.
                        pending.extendleft(reversed(ids))
                        self._replace(index)
                        continue
                    worker.tasks = collections.deque(ids)
                    worker.state, worker.deadline = "busy", now + self.timeout_s
            waiting = [w for w in self._workers if w.state != "idle"]
            next_deadline = min(w.deadline for w in waiting)
            ready = multiprocessing.connection.wait(
                [w.conn for w in waiting], timeout=max(0.0, next_deadline - time.monotonic())
            )
            for index, worker in enumerate(self._workers):
                # Every reply already in the pipe, not one per wait: a worker streams a
                # chunk's replies.
                more = worker.conn in ready
                while more:
                    try:
                        kind, payload = worker.conn.recv()
                    except (EOFError, OSError):
                        # The worker died (e.g. killed by the OS): the pair it was on scores zero.
                        if worker.state == "starting":
                            code = worker.process.exitcode
                            self._kill(worker)
                            raise RuntimeError(
                                f"grading worker exited during startup ({code})"
                            ) from None
                        task = worker.tasks.popleft()
                        requeue(worker)
                        worker.process.join(timeout=5)
                        code = worker.process.exitcode
                        self._replace(index)
                        crashes += 1
                        if code is not None and code < 0 and task not in retried:
                            # Killed by a signal from outside (SIGKILL by an operator or a
                            # scheduler): not the pair's doing, so grade it again on a new worker.
                            retried.add(task)
                            pending.appendleft(task)
                        else:
                            errors += 1
                            results[task] = dict(_ZERO)
                        break
                    if kind == "ready":
                        worker.state = "idle"
                        break
                    if kind == "fatal":  # the chunk could not be read: none of its pairs graded
                        errors += len(worker.tasks)
                        for i in worker.tasks:
                            results[i] = dict(_ZERO)
                        worker.tasks.clear()
                    else:
                        task = worker.tasks.popleft()
                        if kind == "ok":
                            results[task] = payload
                        else:
                            errors += 1
                            results[task] = dict(_ZERO)
                    # The next pair of the chunk starts now, with its own deadline.
                    worker.deadline = time.monotonic() + self.timeout_s
                    if not worker.tasks:
                        worker.state = "idle"
                    more = worker.state == "busy" and worker.conn.poll()
            now = time.monotonic()
            for index, worker in enumerate(self._workers):
                if worker.state == "busy" and now >= worker.deadline:
                    timeouts += 1
                    results[worker.tasks.popleft()] = dict(_ZERO)
                    requeue(worker)
                    self._replace(index)
                elif worker.state == "starting" and now >= worker.deadline:
                    self._kill(worker)
                    raise RuntimeError(
                        f"grading worker did not start within {self.startup_timeout_s} s"
                    )

        scores = [r if r is not None else dict(_ZERO) for r in results]
        stats = GradingStats(
            len(scores), timeouts, errors, time.perf_counter() - start, crashes=crashes
        )
        return scores, stats

    def close(self) -> None:
        """Stop the workers (idempotent)."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers:
            try:
                if worker.state == "idle":
                    worker.conn.send_bytes(b"")
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        for worker in self._workers:
            worker.process.join(timeout=max(0.0, deadline - time.monotonic()))
            self._kill(worker)

    def __enter__(self) -> GradingPool:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


@dataclasses.dataclass(eq=False)
class Grader:
    """A run's reward function and the grading pool that runs it time-bounded: what a command
    grades completions of problems with (``builders.build_grader``).

    The pool serves one call at a time (the async producer grades the difficulty filter's
    candidates on its own thread), hence the lock.
    """

    reward_fn: Callable[[str, Any], dict[str, float]]
    pool: GradingPool
    # A task mixture's ``verifiers.domain_reward_fn``: each truth is (domain, answer).
    by_domain: bool = False
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def grade(self, problems: Sequence[Any], texts: list[str], n: int):
        """(scores, stats) of ``n`` completions per problem (problem-major); a problem is
        anything with ``answer`` (and ``domain`` for a mixture): ``data.loading.Problem``."""
        truths = [(p.domain, p.answer) if self.by_domain else p.answer for p in problems]
        truths = [t for t in truths for _ in range(n)]
        with self._lock:
            return self.pool.grade(self.reward_fn, texts, truths)

    def close(self) -> None:
        self.pool.close()
