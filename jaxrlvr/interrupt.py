"""Graceful stop: SIGTERM (and optionally SIGINT) become a flag the training loop checks.

Schedulers preempt with SIGTERM and follow with SIGKILL after a grace period. Inside
``GracefulStop`` the signal only records that a stop was asked for; the loop checks
``stop.requested`` between steps, saves a checkpoint and exits 0, so no finished step is lost.
A second signal of the same kind means "now": the previous handler is put back and the signal is
re-delivered (SIGINT raises KeyboardInterrupt, SIGTERM ends the process as it would have).

Handlers can only be installed from the main thread; elsewhere ``GracefulStop`` installs nothing
and ``requested`` stays None (the caller still runs, it just cannot be stopped gracefully).

    with interrupt.GracefulStop() as stop:
        for step in ...:
            ...
            if stop.requested:
                save(); break
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Sequence


class GracefulStop:
    """Context manager turning ``signals`` into ``self.requested`` (the first signal's name).

    Args:
      signals: which signals to catch (default SIGTERM only; add ``signal.SIGINT`` to make Ctrl-C
        save too).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGTERM,)):
        self.signals = tuple(signal.Signals(s) for s in signals)
        self.requested: str | None = None
        self._previous: dict[int, object] = {}

    def __bool__(self) -> bool:
        return self.requested is not None

    def should_stop(self, step: int) -> bool:
        """Whether the loop stops after ``step`` (called at every step boundary, by every process
        with the same ``step``): here, whether a signal arrived."""
        del step
        return self.requested is not None

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and name == self.requested:
            # Asked twice: stop now, as the signal would have without us.
            previous = self._previous.pop(signum, signal.SIG_DFL)
            signal.signal(signum, previous)
            if signum == signal.SIGINT and previous in (signal.SIG_DFL, signal.default_int_handler):
                raise KeyboardInterrupt
            os.kill(os.getpid(), signum)
            return
        if self.requested is None:
            self.requested = name

    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()
