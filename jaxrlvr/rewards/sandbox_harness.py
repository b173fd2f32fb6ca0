"""The program runner that lives inside the sandbox (standard library only; run as a script).

``sandbox.Sandbox`` starts this file once per sandbox (``python -I -S sandbox_harness.py``) and
keeps it warm: it reads one JSON request per line on stdin and answers one JSON line on stdout.
A request is ``{"program", "setup", "tests", "limits"}`` (and optionally ``"capture": N``); each
test is ``{"expr": src}`` (a value
test: the program's process evaluates ``src`` and sends back the value, which *this* process
compares with the expected value it kept to itself) or ``{"stmt": src}`` (a statement test: it
passes when it runs without raising).

Per program the harness forks a child that puts itself in a new session, sets its rlimits (CPU
time, address space, processes, open files, file size, no core files), and, when the harness runs
as root (inside bubblewrap, in its own pid, network, ipc and mount namespaces), drops to a uid of
its own that owns nothing but its private working directory. Its stdin/stdout/stderr are
/dev/null: printed text never reaches any grader, unless the request asks for ``capture`` (the
tool-use environments run code for its output): then stdout and stderr go to a file in the
program's working directory (bounded by the file-size limit), a program that raises gets the
exception's last line written there as Python would print it, and the reply carries the first
``capture`` bytes as ``output``. It reports to the harness over a pipe, one
line per event. The harness (the trusted side) owns the clock: a test that runs past
``test_timeout_s`` or a program past ``program_timeout_s`` is cut off; then every process left
in the namespace except the harness and pid 1 is SIGKILLed (daemons, fork-bomb children,
anything that left the process group), and the working directory is deleted.

What it leaves out: statement tests are reported by the program's own process, so a program that
deliberately searches its memory for the report pipe could forge them; value tests cannot be
forged that way (the program never sees the expected values).
"""

from __future__ import annotations

import ast
import json
import os
import resource
import select
import shutil
import signal
import sys
import time

WORK_ROOT = os.environ.get("JAXRLVR_SANDBOX_WORK", "/tmp")
UIDS_PER_HARNESS = 100
MAX_REPORT_BYTES = 1 << 20
OUTPUT_FILE = ".jaxrlvr_output"
_PLAIN_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_PLAIN_CONTAINERS = (list, tuple, dict, set, frozenset)


def plain_repr(value, type_=type, repr_=repr, depth=0):
    """``repr(value)`` when value is built only from exact built-in plain types (no subclasses,
    so no user-defined ``__eq__``/``__repr__``), else None."""
    t = type_(value)
    if depth > 50:
        return None
    if t in _PLAIN_SCALARS:
        return repr_(value)
    if t not in _PLAIN_CONTAINERS:
        return None
    items = value.items() if t is dict else value
    for item in items:
        parts = item if t is dict else (item,)
        for part in parts:
            if plain_repr(part, type_, repr_, depth + 1) is None:
                return None
    return repr_(value)


def _cpu_limit_s(lim: dict) -> int:
    """RLIMIT_CPU's whole seconds for the limits ``lim``."""
    return max(1, int(lim["cpu_s"] + 0.999))


def _set_limits(lim: dict) -> None:
    def cap(kind, value):
        value = int(value)
        resource.setrlimit(kind, (value, value))

    cap(resource.RLIMIT_CORE, 0)
    cap(resource.RLIMIT_CPU, _cpu_limit_s(lim))
    cap(resource.RLIMIT_AS, lim["memory_mb"] << 20)
    cap(resource.RLIMIT_NOFILE, lim["max_open_files"])
    cap(resource.RLIMIT_FSIZE, lim["max_file_mb"] << 20)
    cap(resource.RLIMIT_NPROC, lim["max_processes"])


def _child(request: dict, report_fd: int, uid: int | None, workdir: str) -> None:
    """The program's process: never returns."""
    try:
        os.setsid()
        devnull = os.open(os.devnull, os.O_RDWR)
        capture = bool(request.get("capture"))
        out_fd = devnull
        if capture:
            out_fd = os.open(os.path.join(workdir, OUTPUT_FILE), os.O_WRONLY | os.O_CREAT, 0o600)
        os.dup2(devnull, 0)
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.closerange(3, report_fd)
        os.closerange(report_fd + 1, 1 << 16)
        os.chdir(workdir)
        _set_limits(request["limits"])
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        env = {"HOME": workdir, "TMPDIR": workdir, "PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        os.environ.clear()
        os.environ.update(env)
        if capture:  # line-buffered text on fd 1 (stderr shares it)
            sys.stdout = sys.stderr = os.fdopen(1, "w", buffering=1, closefd=False)
        else:
            sys.stdout = sys.stderr = open(os.devnull, "w")  # noqa: SIM115
    except BaseException:
        os._exit(3)
    write, dumps, type_, repr_ = os.write, json.dumps, type, repr

    def send(*event):
        write(report_fd, (dumps(event) + "\n").encode())

    import builtins

    pristine = dict(builtins.__dict__)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(request["program"], "<program>", "exec"), namespace)
        if request.get("setup"):
            namespace["__builtins__"] = dict(pristine)
            exec(compile(request["setup"], "<setup>", "exec"), namespace)
    except BaseException as exc:
        if capture:  # what the interpreter would print last, for the tool's observation
            try:
                sys.stdout.write(f"{type_(exc).__name__}: {exc}\n")
                sys.stdout.flush()
            except BaseException:
                pass
        send("program_error")
        os._exit(0)
    for i, test in enumerate(request["tests"]):
        # Tests see the builtins as they were before the program ran (a program that rebinds
        # AssertionError, print or isinstance changes only its own view).
        namespace["__builtins__"] = dict(pristine)
        send("start", i)
        try:
            if "expr" in test:
                value = eval(compile(test["expr"], "<test>", "eval"), namespace)
                send("value", i, plain_repr(value, type_, repr_))
            else:
                exec(compile(test["stmt"], "<test>", "exec"), namespace)
                send("ok", i)
        except BaseException:
            send("fail", i)
    try:
        sys.stdout.flush()
    except BaseException:
        pass
    os._exit(0)


def _how_it_ended(pid: int, deadline: float, cpu_limit_s: int, status: str) -> str:
    """The status of a child whose report pipe closed: ``status`` when it exited, ``"timeout"``
    when its CPU-time limit killed it (the limit equals the program's time limit, and on a busy
    machine it can end a loop before the harness's wall-clock deadline does; with soft = hard
    limits Linux sends SIGKILL, so the child's CPU seconds tell), and ``"program_error"`` when
    another signal did (a crash). A child that closed the pipe but runs on is waited for until
    ``deadline``: then ``"timeout"``."""
    while True:
        try:
            done, wait_status, usage = os.wait4(pid, os.WNOHANG)
        except ChildProcessError:
            return status
        if done:
            if not os.WIFSIGNALED(wait_status):
                return status
            cpu = usage.ru_utime + usage.ru_stime
            signum = os.WTERMSIG(wait_status)
            if signum == signal.SIGXCPU or (signum == signal.SIGKILL and cpu >= cpu_limit_s - 0.05):
                return "timeout"
            return "program_error"
        if time.monotonic() >= deadline:
            return "timeout"
        time.sleep(0.002)


def _sweep(own_pid: int) -> int:
    """SIGKILL every process in this pid namespace except pid 1 and the harness, until none is
    left; returns how many there were at first."""
    first = None
    for _ in range(200):
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
        others = [p for p in pids if p not in (1, own_pid)]
        first = len(others) if first is None else first
        if not others:
            return first
        if own_pid != 1 and os.getuid() == 0:
            try:
                os.kill(-1, signal.SIGKILL)  # everything this (root) harness may signal, not itself
            except OSError:
                pass
        for p in others:
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass
        _reap()
        time.sleep(0.002)
    return first


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_program(request: dict, serial: int, isolate: bool, uid_base: int) -> dict:
    """Run one program against its tests; returns the harness's verdict."""
    lim = request["limits"]
    expected = {}
    for i, test in enumerate(request["tests"]):
        if "expr" in test:
            expected[i] = ast.literal_eval(test["expected"])
    is_root = os.getuid() == 0
    uid = uid_base + serial % UIDS_PER_HARNESS if is_root and uid_base else None
    workdir = os.path.join(WORK_ROOT, f"prog{serial}")
    os.mkdir(workdir, 0o700)
    if uid is not None:
        os.chown(workdir, uid, uid)
    read_fd, write_fd = os.pipe()
    child_request = dict(
        request, tests=[{k: v for k, v in t.items() if k != "expected"} for t in request["tests"]]
    )
    start = time.monotonic()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(child_request, write_fd, uid, workdir)
    os.close(write_fd)
    n = len(request["tests"])
    passed = [False] * n
    status = "done"
    buf, total = b"", 0
    program_deadline = start + lim["program_timeout_s"]
    test_deadline = program_deadline
    eof = False
    while not eof:
        now = time.monotonic()
        deadline = min(program_deadline, test_deadline)
        if now >= deadline:
            status = "timeout"
            break
        ready, _, _ = select.select([read_fd], [], [], deadline - now)
        if not ready:
            continue
        chunk = os.read(read_fd, 65536)
        if not chunk:
            eof = True
        total += len(chunk)
        if total > MAX_REPORT_BYTES:
            status = "report_too_large"
            break
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
                kind = event[0]
            except Exception:
                continue
            if kind == "program_error":
                status = "program_error"
            elif kind == "start" and isinstance(event[1], int):
                test_deadline = time.monotonic() + lim["test_timeout_s"]
            elif (
                kind in ("ok", "fail", "value") and isinstance(event[1], int) and 0 <= event[1] < n
            ):
                i = event[1]
                test_deadline = program_deadline
                if kind == "ok":
                    passed[i] = i not in expected
                elif kind == "value" and i in expected and isinstance(event[2], str):
                    try:
                        passed[i] = ast.literal_eval(event[2]) == expected[i]
                    except Exception:
                        passed[i] = False
    if eof and status in ("done", "program_error"):
        status = _how_it_ended(pid, program_deadline, _cpu_limit_s(lim), status)
    seconds = time.monotonic() - start
    os.close(read_fd)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    left = _sweep(os.getpid()) if isolate else 0
    reply = {"passed": passed, "status": status, "seconds": seconds, "left": left}
    if request.get("capture"):
        reply["output"] = _read_output(os.path.join(workdir, OUTPUT_FILE), int(request["capture"]))
    shutil.rmtree(workdir, ignore_errors=True)
    return reply


def _read_output(path: str, limit: int) -> str:
    """The first ``limit`` bytes a program printed (never following a link it planted)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        return os.read(fd, max(0, limit)).decode("utf-8", errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)


def main() -> None:
    # --sweep (kill everything else in the pid namespace after each program) is only ever passed
    # inside bubblewrap's private pid namespace; --uid-base N: programs run as uids N..N+99.
    # (a low pid is the sign of a fresh pid namespace: never sweep a host's processes).
    isolate = "--sweep" in sys.argv and 1 < os.getpid() < 10
    uid_base = int(sys.argv[sys.argv.index("--uid-base") + 1]) if "--uid-base" in sys.argv else 0
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    out = sys.stdout
    out.write(json.dumps({"ready": True, "pid": os.getpid(), "uid": os.getuid()}) + "\n")
    out.flush()
    serial = 0
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
            reply = run_program(request, serial, isolate, uid_base)
        except Exception as exc:  # a malformed request fails alone
            reply = {"passed": [], "status": "harness_error", "error": repr(exc)[:300]}
        serial += 1
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
