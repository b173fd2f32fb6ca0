"""Graceful stop: SIGTERM (and optionally SIGINT) stop the training loop at a step boundary.

Schedulers preempt with SIGTERM and follow with SIGKILL after a grace period. Inside
``GracefulStop`` the signal only records that a stop was asked for; the loop asks
``stop.should_stop(step)`` at every step boundary, saves a checkpoint and exits 0, so no finished
step is lost.

One process: the signal sets the flag and the next ``should_stop`` returns True. A second signal
of the same kind means "now": the previous handler is put back and the signal is re-delivered
(SIGINT raises KeyboardInterrupt, SIGTERM ends the process as it would have).

Several processes (``jax.process_count() > 1``): every process must stop at the same step, or one
would wait in the checkpoint's collectives while another runs the next step. JAX's preemption
service does the agreement: its notifier, installed by ``jax.distributed.initialize``, catches
SIGTERM in C++ and tells every process through the coordination service, which sets the sync
step to one past the furthest step any process has reported; ``should_stop(step)`` calls
``multihost_utils.reached_preemption_sync_point(step)``, which is True in every process at that
same step. So ``GracefulStop`` leaves SIGTERM to JAX here (a Python handler installed later would
replace JAX's, and the other processes would never hear of the signal); other signals it catches
(SIGINT) are passed on as SIGTERM to this process, joining the same agreement. JAX's handler
keeps swallowing SIGTERM afterwards: the scheduler's SIGKILL ends a process that does not stop.

Handlers can only be installed from the main thread; elsewhere ``GracefulStop`` installs nothing
(the caller still runs, it just cannot be stopped gracefully by its own handlers).

    with interrupt.GracefulStop() as stop:
        for step in ...:
            ...
            if stop.should_stop(step):
                save(); break
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence


class GracefulStop:
    """Context manager turning ``signals`` into ``self.requested`` (the signal's name) and
    ``should_stop`` (module docstring).

    Args:
      signals: which signals to catch (default SIGTERM only; add ``signal.SIGINT`` to make Ctrl-C
        save too).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)):
        self.signals = tuple(signal.Signals(s) for s in signals)
        # One process: the first signal's name once caught. Several: set by should_stop, in
        # every process at the agreed step ("SIGTERM", or this process's own signal's name).
        self.requested: str | None = None
        self._previous: dict[int, object] = {}
        self._agree = False  # several processes: JAX's preemption service decides
        self._caught: str | None = None  # several processes: the signal this process caught
        self._last_step: int | None = None

    def __bool__(self) -> bool:
        return self.requested is not None

    def should_stop(self, step: int) -> bool:
        """Whether the loop stops after ``step``. Call it at every step boundary, in every
        process, with the same increasing ``step``: with several processes it is the same answer
        everywhere (JAX's preemption sync point)."""
        if not self._agree:
            return self.requested is not None
        from jax.experimental import multihost_utils

        # JAX's sync step is one past the furthest step reported; report every step, also those
        # a loop skipped (and, on the first call, those before a resumed start), so it is hit.
        first = 1 if self._last_step is None else self._last_step + 1
        for s in range(min(first, step), step + 1):
            if multihost_utils.reached_preemption_sync_point(s):
                self.requested = self._caught or "SIGTERM"
        self._last_step = step
        return self.requested is not None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        first = self._caught if self._agree else self.requested
        if first is not None and name == first:
            # Asked twice: stop now, as the signal would have without us.
            previous = self._previous.pop(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            if signum == signal.SIGINT and previous in (signal.SIG_DFL, signal.default_int_handler):
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        if first is not None:
            return
        if self._agree:
            self._caught = name
            signal.raise_signal(signal.SIGTERM)  # to JAX's preemption notifier
        else:
            self.requested = name

    def __enter__(self) -> GracefulStop:
        self._agree = _several_processes()
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            if self._agree and sig == signal.SIGTERM:
                continue  # JAX's preemption notifier owns it
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()


def _several_processes() -> bool:
    """A multi-process JAX job (whose runtime starts JAX's preemption service)."""
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1
