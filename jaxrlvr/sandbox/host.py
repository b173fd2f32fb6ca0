"""The sandbox's host side: run untrusted (model-written) Python programs against tests, inside
bubblewrap.

A ``Sandbox`` is one warm ``bwrap`` process running ``harness.py`` (see its docstring for
what happens per program). bubblewrap (Debian package ``bubblewrap``) gives the harness:

- its own pid, network, ipc and uts namespaces (``--unshare-*``): no network interface but a
  down loopback, no view of (or signal to) any host process, and everything in it dies with the
  grader (``--die-with-parent``, and the namespace's pid 1 takes the rest along);
- a read-only view of only what Python needs (``/usr``, ``/bin``, ``/lib*`` and the
  interpreter's own prefix, bound read-only) and nothing else of the host: no home, no project
  checkout, no ``/etc``, no secrets; ``/proc`` of its own pid namespace; private size-limited
  tmpfs mounts at ``/tmp`` (the only writable place for files) and ``/dev/shm``, its own
  ``/dev/mqueue``; an empty environment (``--clearenv``);
- as root: all capabilities dropped except the few the harness needs to switch each program to
  an unprivileged uid of its own (``--cap-drop ALL --cap-add CAP_SETUID ...``), so the kernel's
  per-user process limit (``RLIMIT_NPROC``, which root ignores) holds against fork bombs.
  As a normal user: an unprivileged user namespace (``--unshare-user``) instead; programs then
  share the harness's uid (weaker: a program can signal the harness, which only fails its own
  grade).

Each program gets rlimits (CPU time, address space, processes, open files, file size), a per-test
and a per-program wall-clock limit, /dev/null for stdio, a watchdog on the memory its address
space does not show (shared memory, tmpfs inodes), and a private working directory; afterwards
the harness removes everything it left (processes, files, IPC objects) and checks that the
sandbox is back to its starting state, and ``Sandbox`` replaces the sandbox when it is not.
Where a memory cgroup can be had (``MemoryCgroup``: root with cgroup v1, or a delegated cgroup v2
memory controller) the whole sandbox runs under ``total_memory_mb``. Every sandbox of a process
takes its own range of 100 uids (``uid_base``).

``kind="none"`` runs the same harness without bubblewrap (rlimits, the time limits and the uid
switch when root remain; no namespaces, no watchdog; as root the processes, IPC objects and
``/dev/shm`` files of the sandbox's uids are removed after each program, as a normal user daemons
that leave their session survive): for machines without user namespaces, with a warning every
time one starts. When ``bwrap`` is missing, ``SandboxUnavailable`` says so in one line; nothing
ever falls back silently.

Left out: seccomp syscall filtering; a memory bound for the whole sandbox where no memory cgroup
can be had (the address-space limit, the tmpfs sizes and the watchdog bound its parts instead).
"""

from __future__ import annotations

import ast
import atexit
import dataclasses
import json
import os
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from typing import Literal, get_args

from jaxrlvr.sandbox import harness

SandboxKind = Literal["bwrap", "none"]

HARNESS_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "harness.py")
_HARNESS_IN_SANDBOX = "/opt/jaxrlvr/sandbox/harness.py"
_BWRAP_HINT = (
    "reward.sandbox=bwrap needs bubblewrap, but 'bwrap' is not on PATH "
    "(Debian/Ubuntu: apt-get install bubblewrap; scripts/setup_env.sh installs it when run as "
    "root); reward.sandbox=none runs model-written code without a sandbox"
)
# Capabilities the root harness keeps: switch uids, own/clean the programs' directories, kill
# what they leave. Everything else (CAP_SYS_ADMIN: remounts, CAP_NET_*, ...) is dropped.
_ROOT_CAPS = ("CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_FOWNER")


class SandboxUnavailable(RuntimeError):
    """The sandbox cannot run here (bwrap missing or refused); the message is one line."""


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"reward.code.{name} must be > 0, got {value}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """The limits of one program (all tests of one response) and of the sandbox around it,
    written once: ``SandboxConfig`` and ``code.CodeRewardConfig`` (``reward.code.*``) both
    extend this record.

    Attributes:
      test_timeout_s: wall-clock limit for one test.
      program_timeout_s: wall-clock limit for the program and all its tests.
      cpu_s: CPU-time limit (``RLIMIT_CPU``; None: ``program_timeout_s``).
      memory_mb: address-space limit (``RLIMIT_AS``) of the program's processes.
      max_processes: process limit (``RLIMIT_NPROC``) of the program's uid.
      max_open_files: ``RLIMIT_NOFILE``.
      max_file_mb: largest file a program may write (``RLIMIT_FSIZE``).
      tmp_mb: size of the sandbox's private tmpfs at ``/tmp`` (bwrap only).
      shared_mb: memory outside the address space a program may hold: the size of the
        sandbox's ``/dev/shm`` tmpfs, and the System V shared memory and message queues the
        harness's watchdog allows (bwrap only).
      max_files: files and directories (inodes) a program may hold in the sandbox's tmpfs
        mounts, enforced by the watchdog (bwrap only).
      total_memory_mb: the memory cgroup's limit for the whole sandbox, where a memory cgroup
        can be had (None: ``memory_mb + tmp_mb + 2 * shared_mb + 128``).
    """

    test_timeout_s: float = 1.0
    program_timeout_s: float = 5.0
    cpu_s: float | None = None
    memory_mb: int = 512
    max_processes: int = 16
    max_open_files: int = 64
    max_file_mb: int = 8
    tmp_mb: int = 32
    shared_mb: int = 32
    max_files: int = 10_000
    total_memory_mb: int | None = None

    def __post_init__(self):
        for name in ("test_timeout_s", "program_timeout_s", "memory_mb", "max_processes"):
            _positive(name, getattr(self, name))
        for name in ("max_open_files", "max_file_mb", "tmp_mb", "shared_mb", "max_files"):
            _positive(name, getattr(self, name))
        for name in ("cpu_s", "total_memory_mb"):
            if getattr(self, name) is not None:
                _positive(name, getattr(self, name))
        if self.max_open_files < 8:
            raise ValueError("reward.code.max_open_files must be >= 8 (Python needs a few)")

    @property
    def sandbox_memory_mb(self) -> int:
        """The memory cgroup's limit (``total_memory_mb`` or its default)."""
        if self.total_memory_mb is not None:
            return self.total_memory_mb
        return self.memory_mb + self.tmp_mb + 2 * self.shared_mb + 128

    def limits(self) -> dict:
        """What the harness enforces per program."""
        return {
            "test_timeout_s": self.test_timeout_s,
            "program_timeout_s": self.program_timeout_s,
            "cpu_s": self.cpu_s or self.program_timeout_s,
            "memory_mb": self.memory_mb,
            "max_processes": self.max_processes,
            "max_open_files": self.max_open_files,
            "max_file_mb": self.max_file_mb,
            "shared_mb": self.shared_mb,
            "max_files": self.max_files,
        }

    def limit_values(self) -> dict:
        """This record's own fields (to build the other record that extends it)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(SandboxLimits)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class SandboxConfig(SandboxLimits):
    """Isolation mechanism and limits (``SandboxLimits``) for one program.

    Attributes:
      kind: ``bwrap`` (bubblewrap; the default) or ``none`` (no namespaces; warns).
      python: interpreter to run programs with (None: this interpreter's base installation,
        run with ``-I -S``: standard library only).
    """

    kind: SandboxKind = "bwrap"
    python: str | None = None

    def __post_init__(self):
        if self.kind not in get_args(SandboxKind):
            raise ValueError(
                f"reward.sandbox must be one of {get_args(SandboxKind)}, got {self.kind!r}"
            )
        super().__post_init__()


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One program's verdict.

    Attributes:
      passed: one bool per test, in order.
      status: ``done`` (ran to the end), ``timeout``, ``program_error`` (the program itself
        raised or did not compile), ``limit_exceeded`` (shared memory or files past
        ``shared_mb`` / ``max_files``), ``report_too_large``, ``sandbox_error`` (the sandbox died or
        answered nothing; it is restarted on the next call) or ``harness_error``.
      seconds: wall-clock time of the program inside the harness.
      leftover_processes: processes the program left behind before the sweep killed them.
      output: what the program printed (stdout and stderr, at most ``capture`` bytes) when ``run``
        was asked to capture it; "" otherwise.
      clean: whether the sandbox was back to its starting state after the program (when not,
        it is replaced before the next one: ``Sandbox.restarts``).
      check_seconds: the harness's clean-up and clean-state checks after the program.
    """

    passed: tuple[bool, ...]
    status: str
    seconds: float
    leftover_processes: int = 0
    output: str = ""
    clean: bool = True
    check_seconds: float = 0.0

    @property
    def fraction(self) -> float:
        return sum(self.passed) / len(self.passed) if self.passed else 0.0

    @property
    def all_passed(self) -> bool:
        return bool(self.passed) and all(self.passed)


def base_python() -> str:
    """The interpreter programs run with by default: the real file behind ``sys.executable``
    (a virtual environment's python resolves to its base installation)."""
    return os.path.realpath(sys.executable)


def find_bwrap() -> str:
    """Path of ``bwrap``; raises ``SandboxUnavailable`` (one line, naming it) when missing."""
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(_BWRAP_HINT)
    return path


def bwrap_command(
    cfg: SandboxConfig, python: str, uid_base: int, mounts: str | None = None
) -> list[str]:
    """The bubblewrap command line that starts the harness. ``mounts``: a directory holding
    ``tmp`` and ``shm`` tmpfs mounts made by ``private_tmpfs_command`` (bound at ``/tmp`` and
    ``/dev/shm``); None: bubblewrap's own size-limited tmpfs mounts (no inode limit)."""
    root = os.geteuid() == 0
    cmd = [find_bwrap(), "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    cmd += ["--unshare-cgroup-try", "--die-with-parent", "--new-session", "--hostname", "sandbox"]
    if root:
        cmd += ["--cap-drop", "ALL"]
        for cap in _ROOT_CAPS:
            cmd += ["--cap-add", cap]
    else:
        cmd += ["--unshare-user"]
    for path in ("/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin"):
        cmd += ["--ro-bind-try", path, path]
    prefix = os.path.dirname(os.path.dirname(python))  # .../bin/python3.x -> install prefix
    if prefix not in ("/", "/usr") and not prefix.startswith("/usr/"):
        # Traversable parents (an interpreter under /root would otherwise sit behind a 0700
        # directory that the programs' uid cannot enter); nothing of them is bound.
        parents, parent = [], os.path.dirname(prefix)
        while parent not in ("/", ""):
            parents.append(parent)
            parent = os.path.dirname(parent)
        for parent in reversed(parents):
            cmd += ["--perms", "0755", "--dir", parent]
        cmd += ["--ro-bind", prefix, prefix]
    cmd += ["--ro-bind", HARNESS_PATH, _HARNESS_IN_SANDBOX]
    cmd += ["--dev", "/dev", "--proc", "/proc", "--mqueue", "/dev/mqueue"]
    # /dev/shm (POSIX shared memory) on a size-limited tmpfs of its own, not bwrap's /dev.
    if mounts is not None:
        cmd += ["--bind", os.path.join(mounts, "shm"), "/dev/shm"]
        cmd += ["--bind", os.path.join(mounts, "tmp"), "/tmp"]
    else:
        cmd += ["--size", str(cfg.shared_mb << 20), "--perms", "1777", "--tmpfs", "/dev/shm"]
        cmd += ["--size", str(cfg.tmp_mb << 20), "--perms", "0711", "--tmpfs", "/tmp"]
    cmd += ["--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin"]
    cmd += [python, "-I", "-S", "-B", _HARNESS_IN_SANDBOX, "--sweep"]
    if root:
        cmd += ["--uid-base", str(uid_base)]
    return cmd


def private_tmpfs_command(cfg: SandboxLimits, mounts: str, cmd: list[str]) -> list[str] | None:
    """``cmd`` run in a private mount namespace (``unshare``, root only) where ``mounts/tmp``
    and ``mounts/shm`` are tmpfs mounts with a size and a kernel inode limit (``nr_inodes``:
    ``max_files``; bubblewrap's ``--tmpfs`` sets only a size). Nothing of them is visible on the
    host, and they vanish with the sandbox. None where ``unshare`` or ``mount`` is missing."""
    unshare, mount = shutil.which("unshare"), shutil.which("mount")
    if os.geteuid() != 0 or unshare is None or mount is None:
        return None
    m = shlex.quote(mounts)
    inodes = cfg.max_files + 1  # the root directory is one

    def tmpfs(size_mb: int, mode: str, where: str) -> str:
        opts = f"size={size_mb << 20},nr_inodes={inodes},mode={mode}"
        return f"{mount} -t tmpfs -o {opts},nosuid,nodev jaxrlvr {where}"

    script = " && ".join(
        [
            f"{mount} -t tmpfs -o size=65536,nr_inodes=8,mode=0755 jaxrlvr {m}",
            f"mkdir {m}/tmp {m}/shm",
            tmpfs(cfg.tmp_mb, "0711", f"{m}/tmp"),
            tmpfs(cfg.shared_mb, "1777", f"{m}/shm"),
            'exec "$@"',
        ]
    )
    return [unshare, "--mount", "--propagation", "private", "/bin/sh", "-c", script, "sh", *cmd]


_UID_SLOTS = 64  # sandboxes one process may hold at once
_uid_slots_used: set[int] = set()
_uid_lock = threading.Lock()


def _take_uid_slot() -> int:
    with _uid_lock:
        free = [i for i in range(_UID_SLOTS) if i not in _uid_slots_used]
        if not free:
            raise SandboxUnavailable(f"one process holds at most {_UID_SLOTS} sandboxes at once")
        _uid_slots_used.add(free[0])
        return free[0]


def _release_uid_slot(slot: int) -> None:
    with _uid_lock:
        _uid_slots_used.discard(slot)


def uid_base(pid: int, slot: int) -> int:
    """The first of the 100 uids of the sandbox in ``slot`` of process ``pid``: from 200,000 up,
    distinct across the processes of one machine (pids below 500,000) and the sandboxes of one
    process, so no two sandboxes share a uid and with it a process count."""
    return 200_000 + ((pid % 500_000) * _UID_SLOTS + slot) * 100


def check_unsandboxed_python(python: str) -> None:
    """``reward.sandbox: none`` as root runs programs as uids of their own. The harness opens
    the import path's directories before the switch (so a 0700 home above the interpreter does
    not matter), but the directories themselves must be readable by any uid: raises
    ``SandboxUnavailable`` naming the one that is not."""
    import sysconfig

    if python != base_python():
        return  # another interpreter's layout is its own; it fails its first program if closed
    paths = sysconfig.get_paths()
    for path in (
        paths["stdlib"],
        paths["platstdlib"],
        os.path.join(paths["stdlib"], "lib-dynload"),
    ):
        try:
            mode = os.stat(path).st_mode
        except OSError:
            continue
        if mode & 0o005 != 0o005:
            raise SandboxUnavailable(
                f"reward.sandbox=none as root runs programs as unprivileged uids, which cannot "
                f"read the standard library directory {path} ({stat.S_IMODE(mode):04o}); use "
                "reward.sandbox=bwrap or an interpreter whose library others may read"
            )


CGROUP_PREFIX = "jaxrlvr-sandbox-"


class MemoryCgroup:
    """A memory cgroup for one sandbox (its limit covers the harness, the programs, their
    tmpfs files and shared memory), where this process may create one: cgroup v2 with the
    memory controller delegated to this process's cgroup, or a writable cgroup v1 memory
    hierarchy (root). ``create`` returns None where neither is there."""

    def __init__(self, path: str, version: int):
        self.path = path
        self.version = version

    @staticmethod
    def _own_dirs() -> list[tuple[str, int]]:
        dirs = []
        try:
            with open("/proc/self/cgroup") as f:
                lines = f.read().splitlines()
        except OSError:
            return dirs
        for line in lines:
            _, controllers, rel = line.split(":", 2)
            rel = rel.lstrip("/")
            if controllers == "" and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
                dirs.append((os.path.join("/sys/fs/cgroup", rel), 2))
            elif "memory" in controllers.split(","):
                dirs.append((os.path.join("/sys/fs/cgroup/memory", rel), 1))
        return dirs

    @staticmethod
    def _remove_stale(parent: str) -> None:
        """Remove the empty cgroups of sandboxes whose process died without closing them (a
        grading worker killed at its deadline)."""
        try:
            names = [n for n in os.listdir(parent) if n.startswith(CGROUP_PREFIX)]
        except OSError:
            return
        for name in names:
            pid = name[len(CGROUP_PREFIX) :].split("-")[0]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass

    @classmethod
    def create(cls, name: str, limit_mb: int) -> MemoryCgroup | None:
        for parent, version in cls._own_dirs():
            cls._remove_stale(parent)
            try:
                if version == 2:
                    with open(os.path.join(parent, "cgroup.subtree_control")) as f:
                        if "memory" not in f.read().split():
                            continue
                path = os.path.join(parent, name)
                os.mkdir(path)
            except OSError:
                continue
            group = cls(path, version)
            try:
                if version == 2:
                    group._write("memory.max", limit_mb << 20)
                    group._write("memory.swap.max", 0, optional=True)
                else:
                    group._write("memory.limit_in_bytes", limit_mb << 20)
                    group._write("memory.memsw.limit_in_bytes", limit_mb << 20, optional=True)
            except OSError:
                group.remove()
                continue
            return group
        return None

    def _write(self, name: str, value: int, optional: bool = False) -> None:
        try:
            with open(os.path.join(self.path, name), "w") as f:
                f.write(str(value))
        except OSError:
            if not optional:
                raise

    @property
    def procs(self) -> str:
        return os.path.join(self.path, "cgroup.procs")

    def holds(self, pid: int) -> bool:
        """Whether ``pid`` is in this cgroup."""
        try:
            with open(self.procs) as f:
                return str(pid) in f.read().split()
        except OSError:
            return False

    def usage_bytes(self) -> int:
        name = "memory.current" if self.version == 2 else "memory.usage_in_bytes"
        with open(os.path.join(self.path, name)) as f:
            return int(f.read())

    def remove(self) -> None:
        for _ in range(100):  # the last processes may still be exiting
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.01)


class Sandbox:
    """One warm sandboxed harness; ``run`` grades one program at a time (not thread-safe).

    Raises ``SandboxUnavailable`` at construction when bwrap is missing or does not start, or
    (``kind="none"`` as root) when the programs' uids cannot read the interpreter.

    Attributes:
      starts: how many times the harness was started (the first start included).
      restarts: how many times it was replaced because a program left it unclean.
      last_dirty: what the last unclean program left ("" when none did).
      memory_cgroup: the sandbox's ``MemoryCgroup`` (None where none can be had).
    """

    def __init__(self, cfg: SandboxConfig = SandboxConfig()):
        self.cfg = cfg
        self.python = cfg.python or base_python()
        if cfg.kind == "none" and os.geteuid() == 0:
            check_unsandboxed_python(self.python)
        self.starts = 0
        self.restarts = 0
        self.last_dirty = ""
        self._slot = _take_uid_slot()
        self.uid_base = uid_base(os.getpid(), self._slot)  # programs' uids (as root): +0..99
        self.memory_cgroup: MemoryCgroup | None = None
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._workdir: str | None = None
        self._mounts: str | None = None  # the private tmpfs mounts' mount point (root)
        try:
            self._start()
        except BaseException:
            self.close()
            raise

    def _start(self) -> None:
        cfg = self.cfg
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}
        if cfg.kind == "bwrap":
            if self._mounts is None and os.geteuid() == 0:
                self._mounts = _host_dir("jaxrlvr-mounts-", self._slot)
            cmd = bwrap_command(cfg, self.python, self.uid_base, self._mounts)
            if self._mounts is not None:
                private = private_tmpfs_command(cfg, self._mounts, cmd)
                if private is None:  # bubblewrap's own tmpfs mounts instead
                    os.rmdir(self._mounts)
                    self._mounts = None
                    cmd = bwrap_command(cfg, self.python, self.uid_base)
                else:
                    cmd = private
        else:
            print(
                "[jaxrlvr] WARNING: reward.sandbox=none: model-written code runs WITHOUT a "
                "sandbox (rlimits and time limits only)",
                file=sys.stderr,
                flush=True,
            )
            if self._workdir is None:
                self._workdir = _host_dir("jaxrlvr-code-", self._slot)
                os.chmod(self._workdir, 0o711)
            else:  # a restart after an unclean program: what it left goes now
                _remove_quietly(self._workdir, keep_root=True)
            env["JAXRLVR_SANDBOX_WORK"] = self._workdir
            cmd = [self.python, "-I", "-S", "-B", HARNESS_PATH]
            if os.geteuid() == 0:
                cmd += ["--uid-base", str(self.uid_base)]
        bwrap_or_harness = cmd
        if self.memory_cgroup is None:
            name = f"{CGROUP_PREFIX}{os.getpid()}-{self._slot}"
            self.memory_cgroup = MemoryCgroup.create(name, cfg.sandbox_memory_mb)
        if self.memory_cgroup is not None:
            # Joins the cgroup before exec, so that everything the sandbox starts is inside it.
            # (A refused join still starts the sandbox; the check after its start says so.)
            cmd = [
                "/bin/sh",
                "-c",
                'echo $$ 2>/dev/null > "$0"; exec "$@"',
                self.memory_cgroup.procs,
            ]
            cmd += bwrap_or_harness
        self._proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env,
            start_new_session=True,
        )
        self._buf = b""
        self.starts += 1
        hello = self._read_line(time.monotonic() + 30.0)
        if hello is None or not hello.get("ready"):
            err = self._stop_and_stderr()
            raise SandboxUnavailable(
                f"the {cfg.kind} sandbox did not start: {err or 'no reply'}"
                + (" (reward.sandbox=none runs without it)" if cfg.kind == "bwrap" else "")
            )
        if self.memory_cgroup is not None and not self.memory_cgroup.holds(self._proc.pid):
            print(
                f"[jaxrlvr] WARNING: the sandbox could not join its memory cgroup "
                f"{self.memory_cgroup.path}; it runs without one (docs/code.md)",
                file=sys.stderr,
                flush=True,
            )
            self.memory_cgroup.remove()
            self.memory_cgroup = None

    def _stop_and_stderr(self) -> str:
        proc = self._proc
        if proc is None:
            return ""
        self._kill()
        try:
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        except Exception:
            err = ""
        return " ".join(err.split())[:300]

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap and, through --die-with-parent, the rest
        except OSError:
            pass
        try:
            proc.kill()
        except OSError:
            pass
        proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except Exception:
                pass

    def _read_line(self, deadline: float) -> dict | None:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def run(
        self, program: str, tests: Sequence[dict] = (), setup: str = "", *, capture: int = 0
    ) -> RunResult:
        """Run ``program`` (then ``setup``) and each test; see ``harness`` for the test
        dicts (``{"expr", "expected"}`` value tests, ``{"stmt"}`` statement tests). A value
        test's ``expected`` (a Python literal) stays in this process: the sandbox gets only
        ``expr`` and sends back the value, which is compared here. ``capture`` > 0: keep the
        first that many bytes the program prints (``RunResult.output``)."""
        if self._proc is None or self._proc.poll() is not None:
            self._kill()
            self._start()
        expected = {}
        for i, test in enumerate(tests):
            if "expr" in test:
                try:
                    expected[i] = ast.literal_eval(test["expected"])
                except Exception:  # not a literal: the test fails (split_test never does this)
                    expected[i] = _UNMATCHABLE
        request = {
            "program": program,
            "setup": setup,
            "tests": [{k: v for k, v in t.items() if k != "expected"} for t in tests],
            "limits": self.cfg.limits(),
        }
        if capture:
            request["capture"] = int(capture)
        try:
            self._proc.stdin.write((json.dumps(request) + "\n").encode())
            self._proc.stdin.flush()
        except OSError:
            self._kill()
            return RunResult((False,) * len(tests), "sandbox_error", 0.0, clean=False)
        # The harness enforces the program's limit itself; the margin covers its clean-up.
        reply = self._read_line(time.monotonic() + self.cfg.program_timeout_s + 10.0)
        if reply is None or not isinstance(reply.get("passed"), list):
            self._kill()
            return RunResult((False,) * len(tests), "sandbox_error", 0.0, clean=False)
        clean = reply.get("clean") is True
        if not clean:  # replaced before the next program: a fresh tmpfs, IPC and pid namespace
            self.last_dirty = str(reply.get("dirty", "unknown"))
            self.restarts += 1
            self._kill()
        passed = [bool(p) for p in reply["passed"]]
        values = reply.get("values")
        if len(passed) != len(tests) or not isinstance(values, list) or len(values) != len(tests):
            passed = [False] * len(tests)
        else:
            for i, want in expected.items():
                passed[i] = _value_matches(values[i], want)
        output = reply.get("output", "")
        return RunResult(
            tuple(passed),
            str(reply.get("status")),
            float(reply.get("seconds", 0.0)),
            reply.get("left", 0),
            output if isinstance(output, str) else "",
            clean,
            float(reply.get("check_s", 0.0)),
        )

    def close(self) -> None:
        self._kill()
        if self._workdir is not None:
            _remove_quietly(self._workdir)
            self._workdir = None
        if self._mounts is not None:  # empty on the host: its mounts were private
            try:
                os.rmdir(self._mounts)
            except OSError:
                pass
            self._mounts = None
        if self.memory_cgroup is not None:
            self.memory_cgroup.remove()
            self.memory_cgroup = None
        if self._slot is not None:
            _release_uid_slot(self._slot)
            self._slot = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


_UNMATCHABLE = object()  # equal to no value a program can send back


def _host_dir(prefix: str, slot: int) -> str:
    """A new host directory ``PREFIX<pid>-<slot>-XXXX`` in the system's temp dir, after removing
    those of processes that died without closing their sandbox (a grading worker killed at its
    deadline leaves its directory behind)."""
    root = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        names = []
    for name in names:
        pid = name[len(prefix) :].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            _remove_quietly(os.path.join(root, name))
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-{slot}-")


def _remove_quietly(path: str, keep_root: bool = False) -> None:
    """The harness's clean-up (no depth or mode stops it), with a generous budget, for the
    host-side directory of ``kind="none"``; what still stays is left to the system's /tmp."""
    try:
        harness.remove_tree(path, keep_root=keep_root, budget_s=120.0)
    except Exception:
        pass


def _value_matches(value_repr, expected) -> bool:
    """Whether a value test's returned ``repr`` (exact built-in types, from the sandbox) equals
    the expected literal; compared here, outside the program's reach."""
    if not isinstance(value_repr, str):
        return False
    try:
        return bool(ast.literal_eval(value_repr) == expected)
    except Exception:  # malformed, too deep (RecursionError), ...
        return False


_SHARED: dict[SandboxConfig, Sandbox] = {}


def shared_sandbox(cfg: SandboxConfig) -> Sandbox:
    """This process's warm sandbox for ``cfg`` (started on first use, closed at exit): what the
    reward function uses inside each grading worker."""
    box = _SHARED.get(cfg)
    if box is None:
        box = _SHARED[cfg] = Sandbox(cfg)
        if len(_SHARED) == 1:
            atexit.register(close_shared)
    return box


def close_shared() -> None:
    for box in _SHARED.values():
        box.close()
    _SHARED.clear()


def check_available(cfg: SandboxConfig) -> None:
    """Start and stop one sandbox: raises ``SandboxUnavailable`` (one line) when it cannot run."""
    with Sandbox(cfg) as box:
        result = box.run("x = 1", [{"expr": "x", "expected": "1"}])
        if not result.all_passed:
            raise SandboxUnavailable(
                f"the {cfg.kind} sandbox started but failed a trivial program ({result.status})"
            )
