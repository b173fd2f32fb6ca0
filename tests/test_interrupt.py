"""jaxrlvr.interrupt: SIGTERM becomes a flag between steps; a second SIGTERM stops for real."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

from jaxrlvr import interrupt


def test_sigterm_sets_the_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with interrupt.GracefulStop() as stop:
        assert stop.requested is None and not stop
        os.kill(os.getpid(), signal.SIGTERM)
        # The handler runs in the main thread at the next bytecode boundary.
        _wait_for(lambda: bool(stop))
        assert stop.requested == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_sigint_when_asked_for():
    # The handler before: Python's default, or SIG_IGN when the test runner was started as a
    # background job of a non-interactive shell (which ignores SIGINT for it).
    before = signal.getsignal(signal.SIGINT)
    with interrupt.GracefulStop((signal.SIGTERM, signal.SIGINT)) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        _wait_for(lambda: stop.requested is not None)
        assert stop.requested == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before


def test_outside_the_main_thread_installs_nothing():
    before = signal.getsignal(signal.SIGTERM)
    seen = []

    def body():
        with interrupt.GracefulStop() as stop:
            seen.append((stop.requested, signal.getsignal(signal.SIGTERM) is before))

    t = threading.Thread(target=body)
    t.start()
    t.join()
    assert seen == [(None, True)]


_LOOP = textwrap.dedent(
    """
    import sys, time
    from jaxrlvr import interrupt
    with interrupt.GracefulStop() as stop:
        print("ready", flush=True)
        steps = 0
        while not stop:
            time.sleep(0.01)  # one "step"
            steps += 1
        print(f"saved after {stop.requested}", flush=True)
        if sys.argv[1] == "twice":
            time.sleep(30)  # a slow save; the second SIGTERM must end it
    sys.exit(0)
    """
)


def _run(mode, signals):
    """Sends ``signals`` SIGTERMs to the loop; a second one only once the loop has reported the
    first (its "saved after" line: an event, not a sleep)."""
    proc = subprocess.Popen([sys.executable, "-c", _LOOP, mode], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "ready\n"
    proc.send_signal(signal.SIGTERM)
    first = proc.stdout.readline() if signals > 1 else ""
    for _ in range(signals - 1):
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=20)
    return proc.returncode, first + out


def _wait_for(condition, timeout=5.0):
    """Polls ``condition`` until it holds or ``timeout`` seconds pass (a deadline, not a fixed
    sleep)."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_loop_exits_zero_after_sigterm_in_a_subprocess():
    code, out = _run("once", 1)
    assert (code, out) == (0, "saved after SIGTERM\n")


def test_second_sigterm_stops_now():
    code, out = _run("twice", 2)
    assert code == -signal.SIGTERM and out == "saved after SIGTERM\n"


def test_several_processes_stop_where_jax_preemption_sync_point_says(monkeypatch):
    """Multi-process: SIGTERM is left to JAX's notifier, and should_stop reports every step
    (also skipped ones, and those before a resumed start) to its sync point; a process that got
    no signal stops there too, with a reason. The real two-process run is in test_multihost."""
    from jax.experimental import multihost_utils

    calls = []
    monkeypatch.setattr(interrupt, "_several_processes", lambda: True)
    monkeypatch.setattr(
        multihost_utils, "reached_preemption_sync_point", lambda s: calls.append(s) or s == 7
    )
    before = signal.getsignal(signal.SIGTERM)
    with interrupt.GracefulStop() as stop:
        assert signal.getsignal(signal.SIGTERM) is before  # no Python handler over JAX's
        assert not stop.should_stop(5) and calls == [1, 2, 3, 4, 5]
        assert stop.should_stop(7) and calls[5:] == [6, 7]  # 6 was skipped by the loop
        assert stop.requested == "SIGTERM"
