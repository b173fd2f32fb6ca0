"""The program runner that lives inside the sandbox (standard library only; run as a script).

``host.Sandbox`` starts this file once per sandbox (``python -I -S harness.py``) and
keeps it warm: it reads one JSON request per line on stdin and answers one JSON line on stdout.
A request is ``{"program", "setup", "tests", "limits"}`` (and optionally ``"capture": N``); each
test is ``{"expr": src}`` (a value test: the program's process evaluates ``src`` and this harness
sends the value back, as the ``repr`` of exact built-in types, for ``Sandbox`` to compare on the
host side: no expected value ever enters the sandbox) or ``{"stmt": src}`` (a statement test: it
passes when it runs without raising; every callable the program defined reaches it through a
guard that fails the test unless what the call returns is built from exact built-in types).

Per program the harness forks a child that puts itself in a new session, sets its rlimits (CPU
time, address space, processes, open files, file size, POSIX message-queue bytes, no core files),
and, when the harness runs as root (inside bubblewrap, in its own pid, network, ipc and mount
namespaces), drops to a uid of its own that owns nothing but its private working directory. Its
stdin/stdout/stderr are /dev/null: printed text never reaches any grader, unless the request asks
for ``capture`` (the tool-use environments run code for its output): then stdout and stderr go to
a file in the program's working directory (bounded by the file-size limit), a program that raises
gets the exception's last line written there as Python would print it, and the reply carries the
first ``capture`` bytes as ``output``. It reports to the harness over a pipe, one line per event.

The harness (the trusted side) owns the clock: a test that runs past ``test_timeout_s`` or a
program past ``program_timeout_s`` is cut off. While the program runs, a watchdog polls what the
address-space limit does not see (System V shared memory and message queues, the files and inodes
of the writable tmpfs mounts) and kills the program past ``shared_mb`` / ``max_files``
(``limit_exceeded``: all its tests fail). Afterwards every process left in the namespace except
the harness and pid 1 is SIGKILLed, the working directory is removed by an iterative walk that
no depth, name or mode defeats (within a time budget), the program's IPC objects and
``/dev/shm`` / ``/dev/mqueue`` entries are removed, and the clean state is checked: no other
process, no IPC object, an empty work root, ``/dev/shm`` and ``/dev/mqueue``. The reply says
``"clean": false`` (and why) when any of it fails; ``Sandbox`` then replaces the whole sandbox
before the next program.

What it leaves out: everything the child reports comes from the program's own process, so a
program that deliberately tampers with this file's code in its memory (rebinding the guard's
closure cells, finding the report pipe) could forge a statement test; value tests cannot be forged
that way (their expected values are compared outside the sandbox). Statement tests and ``setup``
run in the program's process, so their own text (HumanEval's ``check`` with its literals) is
visible to it.
"""

from __future__ import annotations

import json
import os
import resource
import select
import signal
import stat
import sys
import time

WORK_ROOT = os.environ.get("JAXRLVR_SANDBOX_WORK", "/tmp")
UIDS_PER_HARNESS = 100
MAX_REPORT_BYTES = 1 << 20
OUTPUT_FILE = ".jaxrlvr_output"
WATCH_PERIOD_S = 0.01  # the watchdog's poll while a program runs
REMOVE_BUDGET_S = 5.0  # the clean-up's time budget; past it the sandbox is replaced
MSGQUEUE_BYTES = 1 << 16  # RLIMIT_MSGQUEUE of a program (POSIX message queues)
_PLAIN_SCALARS = (int, float, complex, str, bytes, bool, type(None))
_PLAIN_CONTAINERS = (list, tuple, dict, set, frozenset)
_SYSVIPC = ("shm", "sem", "msg")
# /proc/sysvipc columns: the object's id and its owner's uid.
_IPC_ID_UID = {"shm": (1, 7), "sem": (1, 4), "msg": (1, 7)}


def plain_repr(value, type_=type, repr_=repr):
    """``repr(value)`` when value is built only from exact built-in plain types (no subclasses,
    so no user-defined ``__eq__``/``__repr__``), else None."""
    return repr_(value) if is_plain(value, type_) else None


def is_plain(value, type_=type, depth=0) -> bool:
    """Whether ``value`` is built only from exact built-in plain types (at most 50 deep)."""
    t = type_(value)
    if depth > 50:
        return False
    if t in _PLAIN_SCALARS:
        return True
    if t not in _PLAIN_CONTAINERS:
        return False
    items = value.items() if t is dict else value
    for item in items:
        parts = item if t is dict else (item,)
        for part in parts:
            if not is_plain(part, type_, depth + 1):
                return False
    return True


class NotPlain(BaseException):
    """A program's callable returned an object that is not of exact built-in types; a
    ``BaseException`` so that a test's ``except Exception`` does not swallow it."""


def make_guard(type_=type, callable_=callable):
    """``guard(fn)``: ``fn`` wrapped so that every call's result must be ``is_plain``. Built
    before the program runs, from the builtins as they were then."""
    check, not_plain = is_plain, NotPlain

    def guard(fn):
        def guarded(*args, **kwargs):
            result = fn(*args, **kwargs)
            if not check(result, type_):
                raise not_plain(f"{type_(result).__name__} is not a plain built-in value")
            return result

        return guarded

    def wrap_namespace(namespace: dict) -> dict:
        """A copy of the program's namespace for the tests, its callables guarded (modules and
        the builtins are left as they are)."""
        out = {}
        for name, value in namespace.items():
            if name == "__builtins__" or type_(value) is type_(sys):
                out[name] = value
            elif callable_(value):
                out[name] = guard(value)
            else:
                out[name] = value
        return out

    return wrap_namespace


def _cpu_limit_s(lim: dict) -> int:
    """RLIMIT_CPU's whole seconds for the limits ``lim``."""
    return max(1, int(lim["cpu_s"] + 0.999))


def _set_limits(lim: dict) -> None:
    def cap(kind, value):
        value = int(value)
        resource.setrlimit(kind, (value, value))

    cap(resource.RLIMIT_CORE, 0)
    # SIGXCPU at the limit (unambiguous: a timeout); SIGKILL a second later for a program that
    # ignores it. (With soft = hard the kernel sends only SIGKILL, and the CPU time wait4
    # reports for it lags the kernel's own count by up to 0.1 s on a loaded machine: measured.)
    cpu = _cpu_limit_s(lim)
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    cap(resource.RLIMIT_AS, lim["memory_mb"] << 20)
    cap(resource.RLIMIT_NOFILE, lim["max_open_files"])
    cap(resource.RLIMIT_FSIZE, lim["max_file_mb"] << 20)
    cap(resource.RLIMIT_NPROC, lim["max_processes"])
    cap(resource.RLIMIT_MSGQUEUE, MSGQUEUE_BYTES)


def _reach_stdlib() -> None:
    """Put the import path behind directory descriptors opened now (as root), so that after
    the uid switch the standard library still imports when a parent directory is closed to the
    program's uid (an interpreter under a 0700 home, ``reward.sandbox: none``): a process may
    always follow its own ``/proc/self/fd`` links."""
    paths, moved = [], {}
    for path in sys.path:
        if os.path.isdir(path):
            moved[path] = f"/proc/self/fd/{os.open(path, os.O_RDONLY | os.O_DIRECTORY)}"
        paths.append(moved.get(path, path))
    sys.path[:] = paths

    def move(path):
        for old, new in moved.items():
            if path == old or path.startswith(old + os.sep):
                return new + path[len(old) :]
        return path

    for module in list(sys.modules.values()):  # imported packages find submodules on __path__
        search = getattr(module, "__path__", None)
        if isinstance(search, list):
            search[:] = [move(p) if isinstance(p, str) else p for p in search]
    sys.path_importer_cache.clear()


def _child(
    request: dict, report_fd: int, uid: int | None, workdir: str, reach_stdlib: bool
) -> None:
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
            if reach_stdlib:
                _reach_stdlib()
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
    wrap_namespace = make_guard()
    plain = plain_repr

    def send(*event):
        write(report_fd, (dumps(event) + "\n").encode())

    import builtins

    pristine = dict(builtins.__dict__)
    namespace = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(compile(request["program"], "<program>", "exec"), namespace)
        # The tests (and the setup, HumanEval's ``check``) see the program's callables through
        # the guard; the program's own code keeps its namespace (its recursion is unguarded).
        tests_ns = wrap_namespace(namespace)
        tests_ns["__builtins__"] = dict(pristine)
        if request.get("setup"):
            before = set(tests_ns)
            exec(compile(request["setup"], "<setup>", "exec"), tests_ns)
            for name in set(tests_ns) - before:  # names the program's functions may look up
                namespace[name] = tests_ns[name]
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
        tests_ns["__builtins__"] = dict(pristine)
        send("start", i)
        try:
            if "expr" in test:  # evaluated in the program's namespace: its value is checked
                namespace["__builtins__"] = dict(pristine)
                value = eval(compile(test["expr"], "<test>", "eval"), namespace)
                send("value", i, plain(value, type_, repr_))
            else:
                exec(compile(test["stmt"], "<test>", "exec"), tests_ns)
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
    machine it can end a loop before the harness's wall-clock deadline does: SIGXCPU at the soft
    limit, or SIGKILL at the hard one, a second later, for a program that ignores SIGXCPU, which
    the child's CPU seconds tell), and ``"program_error"`` when another signal did (a crash). A
    child that closed the pipe but runs on is waited for until ``deadline``: then
    ``"timeout"``."""
    # The pipe closes while the child is still exiting: wait on a pidfd for the exit itself
    # (a fixed 2 ms sleep here cost about 2 ms a program); poll where there is none.
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    try:
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
                if signum == signal.SIGXCPU or (
                    signum == signal.SIGKILL and cpu >= cpu_limit_s - 0.05
                ):
                    return "timeout"
                return "program_error"
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            if pidfd is not None:
                select.select([pidfd], [], [], left)
            else:
                time.sleep(min(left, 0.0005))
    finally:
        if pidfd is not None:
            os.close(pidfd)


def _others(own_pid: int) -> list[int]:
    """Pids in /proc other than pid 1 and the harness."""
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, own_pid)]


def _uid_processes(uids: range) -> list[int]:
    """Pids (of this /proc) running as one of ``uids`` (zombies, already dead, left out)."""
    found = []
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            if os.stat(f"/proc/{p}").st_uid in uids:
                with open(f"/proc/{p}/stat", "rb") as f:
                    if f.read().rsplit(b")", 1)[1].split()[0] != b"Z":
                        found.append(int(p))
        except (OSError, IndexError):
            pass
    return found


def _sweep(own_pid: int) -> int:
    """SIGKILL every process in this pid namespace except pid 1 and the harness, until none is
    left; returns how many there were at first."""
    first = None
    for _ in range(200):
        others = _others(own_pid)
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


def _scan(fd: int, deadline: float) -> list[str]:
    """Unlink every non-directory in the directory ``fd``; returns its subdirectories."""
    subdirs = []
    with os.scandir(fd) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                subdirs.append(entry.name)
            else:
                os.unlink(entry.name, dir_fd=fd)
            if time.monotonic() > deadline:
                raise TimeoutError("clean-up past its time budget")
    return subdirs


def _open_dir(name: str, dir_fd: int | None) -> int:
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)


def remove_tree(path: str, *, keep_root: bool = False, budget_s: float = REMOVE_BUDGET_S) -> None:
    """Remove ``path`` (or, with ``keep_root``, only what is in it) without recursion: one open
    directory at a time (climbing back through ``..``), every directory made ``0700`` before it is
    entered, names handled as the kernel gives them, so depth, names and modes cannot stop it.
    Raises (``OSError``, ``TimeoutError`` past ``budget_s``) when something stays; the caller
    then replaces the sandbox. Only call it when no process can still change the tree."""
    deadline = time.monotonic() + budget_s
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return
    os.chmod(path, 0o700 if not keep_root else stat.S_IMODE(st.st_mode) | 0o700)
    fd = _open_dir(path, None)
    names: list[str] = []
    try:
        pending = [_scan(fd, deadline)]
        while True:
            if pending[-1]:
                name = pending[-1].pop()
                os.chmod(name, 0o700, dir_fd=fd)  # a directory (scandir said so, no link)
                child = _open_dir(name, fd)
                os.close(fd)
                fd = child
                names.append(name)
                pending.append(_scan(fd, deadline))
                continue
            pending.pop()
            if not names:
                break
            parent = os.open("..", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = parent
            os.rmdir(names.pop(), dir_fd=fd)
    finally:
        os.close(fd)
    if keep_root:
        os.chmod(path, stat.S_IMODE(st.st_mode))
    else:
        os.rmdir(path)


def ipc_objects() -> dict[str, list[tuple[int, int]]]:
    """The System V IPC objects this process's IPC namespace holds: ``{kind: [(id, uid)]}``."""
    found = {}
    for kind in _SYSVIPC:
        id_col, uid_col = _IPC_ID_UID[kind]
        rows = []
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > uid_col:
                        rows.append((int(cols[id_col]), int(cols[uid_col])))
        except OSError:
            pass
        found[kind] = rows
    return found


def _ipc_bytes() -> int:
    """Bytes held in System V shared memory (declared sizes) and message queues."""
    total = 0
    for kind, col in (("shm", 3), ("msg", 3)):
        try:
            with open(f"/proc/sysvipc/{kind}") as f:
                next(f, None)
                for line in f:
                    cols = line.split()
                    if len(cols) > col:
                        total += int(cols[col])
        except OSError:
            pass
    return total


def remove_ipc(objects: dict[str, list[tuple[int, int]]], uids: range | None) -> None:
    """``IPC_RMID`` each object (of ``uids`` only, when given), as its owner: a forked helper
    takes the owner's uid when this harness is root (removing needs the owner or CAP_SYS_ADMIN,
    which the harness does not keep)."""
    by_uid: dict[int, list[tuple[str, int]]] = {}
    for kind, rows in objects.items():
        for ipc_id, uid in rows:
            if uids is None or uid in uids:
                by_uid.setdefault(uid, []).append((kind, ipc_id))
    for uid, items in by_uid.items():
        if os.getuid() != 0 or uid == 0:
            _rmid(items)
            continue
        pid = os.fork()
        if pid == 0:
            try:
                os.setresgid(uid, uid, uid)
                os.setresuid(uid, uid, uid)
                _rmid(items)
            finally:
                os._exit(0)
        os.waitpid(pid, 0)


def _rmid(items: list[tuple[str, int]]) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    ipc_rmid = 0
    for kind, ipc_id in items:
        if kind == "shm":
            libc.shmctl(ipc_id, ipc_rmid, None)
        elif kind == "sem":
            libc.semctl(ipc_id, 0, ipc_rmid)
        else:
            libc.msgctl(ipc_id, ipc_rmid, None)


def _owned_entries(path: str, uids: range | None) -> list[str]:
    """Entries of ``path`` (of ``uids`` only, when given)."""
    try:
        names = os.listdir(path)
    except OSError:
        return []
    if uids is None:
        return names
    out = []
    for name in names:
        try:
            if os.lstat(os.path.join(path, name)).st_uid in uids:
                out.append(name)
        except OSError:
            pass
    return out


class Harness:
    """The harness's state: how it was started and where programs may leave things.

    ``isolated``: inside bubblewrap's namespaces (pid, ipc, mount): everything in them is the
    programs' to clean. Otherwise (``reward.sandbox: none``) only what the program uids own is
    removed, and only when those uids are the programs' own (root).
    """

    def __init__(self, isolate: bool, uid_base: int):
        self.isolate = isolate
        self.uid_base = uid_base
        self.is_root = os.getuid() == 0
        self.own_uids = (
            range(uid_base, uid_base + UIDS_PER_HARNESS) if self.is_root and uid_base else None
        )
        # What may be cleaned: everything in the namespaces when isolated; else the programs'
        # uids (root), else nothing outside the work root (a normal user's unsandboxed run).
        self.scope = None if isolate else self.own_uids
        self.shared_dirs = [d for d in ("/dev/shm", "/dev/mqueue") if os.path.isdir(d)]

    def watch(self, lim: dict) -> str | None:
        """Why the program must be stopped now (memory outside its address space), or None."""
        if not self.isolate:
            return None
        if _ipc_bytes() > lim["shared_mb"] << 20:
            return "System V shared memory / message queues past shared_mb"
        used = 0
        for path in (WORK_ROOT, *self.shared_dirs):
            try:
                st = os.statvfs(path)
            except OSError:
                continue
            used += st.f_files - st.f_ffree
        if used > lim["max_files"]:
            return "files past max_files"
        return None

    def clean(self, workdir: str) -> tuple[list[str], int]:
        """Remove what the program left; returns (what stays dirty, processes found)."""
        dirty = []
        left = _sweep(os.getpid()) if self.isolate else 0
        if self.isolate and _others(os.getpid()):
            dirty.append("processes")
        if not self.isolate and self.own_uids is not None:
            # No pid namespace (kind "none"), but as root the programs' uids are this sandbox's
            # own: whatever runs as one of them is the program's (daemons that left its session).
            for _ in range(200):
                pids = _uid_processes(self.own_uids)
                if not pids:
                    break
                left += len(pids) if not left else 0
                for p in pids:
                    try:
                        os.kill(p, signal.SIGKILL)
                    except OSError:
                        pass
                time.sleep(0.002)
            if _uid_processes(self.own_uids):
                dirty.append("processes")
        try:
            remove_tree(workdir)
        except Exception as exc:  # RecursionError, OSError, TimeoutError: replace the sandbox
            dirty.append(f"work directory ({type(exc).__name__})")
        if self.isolate or self.own_uids is not None:
            objects = ipc_objects()
            if any(objects.values()):
                try:
                    remove_ipc(objects, self.scope)
                except Exception as exc:
                    dirty.append(f"ipc ({type(exc).__name__})")
                if any(
                    uid in (self.scope or range(0, 1 << 32))
                    for rows in ipc_objects().values()
                    for _, uid in rows
                ):
                    dirty.append("ipc objects")
            for path in self.shared_dirs:
                for name in _owned_entries(path, self.scope):
                    try:
                        remove_tree(os.path.join(path, name))
                    except Exception as exc:
                        dirty.append(f"{path} ({type(exc).__name__})")
                if _owned_entries(path, self.scope):
                    dirty.append(path)
        if os.listdir(WORK_ROOT):  # bwrap's tmpfs, or the private directory of kind "none"
            dirty.append("work root")
        return dirty, left

    def run_program(self, request: dict, serial: int) -> dict:
        """Run one program against its tests; returns the harness's verdict."""
        lim = request["limits"]
        uid = self.uid_base + serial % UIDS_PER_HARNESS if self.own_uids is not None else None
        workdir = os.path.join(WORK_ROOT, f"prog{serial}")
        os.mkdir(workdir, 0o700)
        if uid is not None:
            os.chown(workdir, uid, uid)
        is_value = ["expr" in t for t in request["tests"]]
        read_fd, write_fd = os.pipe()
        start = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(read_fd)
            _child(request, write_fd, uid, workdir, not self.isolate)
        os.close(write_fd)
        n = len(request["tests"])
        passed: list[bool] = [False] * n
        values: list[str | None] = [None] * n
        status = "done"
        reason = ""
        buf, total = b"", 0
        program_deadline = start + lim["program_timeout_s"]
        test_deadline = program_deadline
        next_watch = start + WATCH_PERIOD_S
        eof = False
        while not eof:
            now = time.monotonic()
            if now >= next_watch:
                next_watch = now + WATCH_PERIOD_S
                why = self.watch(lim)
                if why:
                    status, reason = "limit_exceeded", why
                    break
            deadline = min(program_deadline, test_deadline)
            if now >= deadline:
                status = "timeout"
                break
            ready, _, _ = select.select(
                [read_fd], [], [], max(0.0, min(deadline, next_watch) - now)
            )
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
                    kind in ("ok", "fail", "value")
                    and isinstance(event[1], int)
                    and 0 <= event[1] < n
                ):
                    i = event[1]
                    test_deadline = program_deadline
                    if kind == "ok":
                        passed[i] = not is_value[i]
                    elif kind == "value" and is_value[i] and isinstance(event[2], str):
                        values[i] = event[2]
        if status == "limit_exceeded":  # a program past the sandbox's bounds scores nothing
            passed, values = [False] * n, [None] * n
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
        output = None
        if request.get("capture"):
            output = _read_output(os.path.join(workdir, OUTPUT_FILE), int(request["capture"]))
        check_start = time.monotonic()
        dirty, left = self.clean(workdir)
        reply = {
            "passed": passed,
            "values": values,
            "status": status,
            "seconds": seconds,
            "left": left,
            "clean": not dirty,
            "check_s": time.monotonic() - check_start,
        }
        if reason:
            reply["reason"] = reason
        if dirty:
            reply["dirty"] = ", ".join(dirty)
        if output is not None:
            reply["output"] = output
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
    harness = Harness(isolate, uid_base)
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
            reply = harness.run_program(request, serial)
        except Exception as exc:  # a malformed request fails alone; a dirty sandbox is replaced
            reply = {
                "passed": [],
                "status": "harness_error",
                "error": repr(exc)[:300],
                "clean": False,
                "dirty": "harness error",
            }
        serial += 1
        out.write(json.dumps(reply) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
