"""JAX's persistent compilation cache for jaxrlvr runs, and a count of the run's compiles.

A jitted program (the SFT and GRPO updates, the sampler's prefill and decode, the evaluation's
sampler calls) is compiled by XLA the first time each shape is seen: on the demo's 2-core CPU that
is 10-20 s of a ~2-minute run. With the persistent cache on, every compiled executable is written
to a directory keyed by the program, its shapes, the jaxlib version, the backend and the XLA flags,
and a later process that asks for the same program loads it instead of compiling (tracing and
lowering still run; XLA does not).

``enable(setting)`` turns it on for this process; ``setting`` is ``run.compile_cache``:

- ``"auto"`` (the default): ``$JAXRLVR_COMPILE_CACHE`` when set, else a user cache directory,
  ``$XDG_CACHE_HOME/jaxrlvr/jax-compile`` (``~/.cache/jaxrlvr/jax-compile``);
- ``"off"`` (or ``""``): no persistent cache (``JAXRLVR_COMPILE_CACHE=off`` does the same for
  "auto");
- any other string: that directory.

Every program is cached, however quick its compile (JAX's default skips those under 1 s, which on
this machine are most of the run's programs); the directory is capped at ``MAX_BYTES`` (2 GiB):
``enable`` removes the least recently used programs past the cap when a process starts. JAX's
own size cap (``jax_compilation_cache_max_size``) is not used: it keeps an ``-atime`` file per
entry under a lock, and a process killed between writing an entry and its ``-atime`` file (a
preempted run, SIGKILL) leaves the directory in a state where every later write of every
process fails with a warning. JAX reads
``jax_compilation_cache_dir`` once, at the process's first compile, so ``enable`` must run
before anything is jitted; a later call with another directory is refused in one line.

``CompileCounter`` listens to JAX's monitoring events and counts the XLA compiles of the process
(``compiles``, ``compile_s``) and the persistent-cache hits (``cache_hits``, ``cache_load_s``),
so a run's summary can say what it compiled and what it loaded. ``compile_in_background``
compiles lowered programs on a thread while the caller works (``run.compile_ahead``), and
``beside`` runs the lowering itself on a thread beside a step that compiles its own programs.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import os
import threading
from collections.abc import Callable

OFF = ("off", "", "none", "false", "0")
# The cache directory's cap: least recently used programs are evicted past it (the demo's 29
# programs take about 1.5 MB; a test suite's few hundred, tens of MB).
MAX_BYTES = 2 * 2**30
ENV = "JAXRLVR_COMPILE_CACHE"

# JAX's monitoring event names (jax._src.dispatch / jax._src.compiler, jaxlib 0.10).
_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_TRACE = "/jax/core/compile/jaxpr_trace_duration"
_LOWER = "/jax/core/compile/jaxpr_to_mlir_module_duration"

_enabled_dir: str | None = None
_lock = threading.Lock()
# JAX records a cache hit inside the timed backend-compile call, on the same thread: the flag
# tells the duration listener that the call it is timing was a load, not a compile.
_hit = threading.local()


def default_dir() -> str:
    """The user cache directory: ``$XDG_CACHE_HOME/jaxrlvr/jax-compile`` (default ~/.cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "jaxrlvr", "jax-compile")


def resolve(setting: str | None) -> str | None:
    """The directory ``setting`` names (see the module docstring), or None for off."""
    if setting is None:
        setting = "auto"
    if not isinstance(setting, str):
        raise ValueError(f"run.compile_cache must be 'auto', 'off' or a directory, got {setting!r}")
    if setting.strip().lower() == "auto":
        env = os.environ.get(ENV)
        if env is None:
            return default_dir()
        setting = env
    if setting.strip().lower() in OFF:
        return None
    return os.path.abspath(os.path.expanduser(setting))


def enable(setting: str | None = "auto") -> str | None:
    """Turns JAX's persistent compilation cache on in the directory ``setting`` names (created if
    missing) and returns it; None (and nothing changed) when ``setting`` means off. Idempotent for
    the same directory; a second, different directory in one process is a ValueError (JAX keeps
    the first)."""
    global _enabled_dir
    directory = resolve(setting)
    if directory is None:
        return None
    with _lock:
        if _enabled_dir is not None:
            if _enabled_dir != directory:
                raise ValueError(
                    f"run.compile_cache: this process already caches compiles in {_enabled_dir}; "
                    f"cannot switch to {directory}"
                )
            return directory
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as e:
            raise ValueError(
                f"run.compile_cache: cannot create {directory} ({e.strerror}); "
                "set run.compile_cache=off or another directory"
            ) from None
        import jax

        jax.config.update("jax_compilation_cache_dir", directory)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
        trim(directory, MAX_BYTES)
        _enabled_dir = directory
    return directory


def trim(directory: str, max_bytes: int) -> int:
    """Removes the least recently used programs of the cache ``directory`` (by the later of
    their access and modification times) until their bytes are at most ``max_bytes``, and the
    ``-atime`` files JAX's own eviction leaves; returns the bytes removed. Best effort: a file
    another process removes or is writing meanwhile is skipped."""
    entries = []
    with os.scandir(directory) as it:
        for e in it:
            try:
                if e.name.endswith("-atime"):
                    os.remove(e.path)
                elif e.name.endswith("-cache") and e.is_file():
                    st = e.stat()
                    entries.append((max(st.st_atime, st.st_mtime), st.st_size, e.path))
            except OSError:
                continue
    total = sum(size for _, size, _ in entries)
    removed = 0
    for _, size, path in sorted(entries):
        if total - removed <= max_bytes:
            break
        with contextlib.suppress(OSError):
            os.remove(path)
            removed += size
    return removed


def enabled_dir() -> str | None:
    """The directory ``enable`` turned on in this process, or None."""
    return _enabled_dir


_counters: list[CompileCounter] = []
_listening = False


def _on_duration(event: str, seconds: float, **_) -> None:
    hit = False
    if event == _BACKEND_COMPILE and getattr(_hit, "pending", 0):
        _hit.pending -= 1
        hit = True
    with _lock:
        for c in _counters:
            c._add(event, seconds, hit)


def _on_event(event: str, **_) -> None:
    if event == _CACHE_HIT:
        _hit.pending = getattr(_hit, "pending", 0) + 1


def _listen() -> None:
    """Registers the two JAX monitoring listeners, once per process."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_on_duration)
    monitoring.register_event_listener(_on_event)


@dataclasses.dataclass(eq=False)
class CompileCounter:
    """XLA compiles and persistent-cache loads seen since ``start()`` (all threads).

    compiles / compile_s: programs XLA compiled, and their seconds (a cache miss or no cache);
    cache_hits / cache_load_s: programs loaded from the persistent cache instead, and the
    seconds of those loads;
    trace_s / lower_s: seconds of JAX tracing and lowering to StableHLO (paid with or without
    the cache).
    """

    compiles: int = 0
    compile_s: float = 0.0
    cache_hits: int = 0
    cache_load_s: float = 0.0
    trace_s: float = 0.0
    lower_s: float = 0.0

    def start(self) -> CompileCounter:
        """Starts counting (idempotent); returns self."""
        with _lock:
            if self not in _counters:
                _counters.append(self)
        _listen()
        return self

    def stop(self) -> None:
        """Stops counting (the numbers so far stay)."""
        with _lock:
            if self in _counters:
                _counters.remove(self)

    def _add(self, event: str, seconds: float, hit: bool) -> None:
        if event == _BACKEND_COMPILE:
            if hit:
                self.cache_hits += 1
                self.cache_load_s += seconds
            else:
                self.compiles += 1
                self.compile_s += seconds
        elif event == _TRACE:
            self.trace_s += seconds
        elif event == _LOWER:
            self.lower_s += seconds

    def as_dict(self) -> dict[str, float]:
        """The counts and seconds (rounded to ms), for a run's summary."""
        return {
            "compiles": self.compiles,
            "compile_s": round(self.compile_s, 3),
            "cache_hits": self.cache_hits,
            "cache_load_s": round(self.cache_load_s, 3),
            "trace_s": round(self.trace_s, 3),
            "lower_s": round(self.lower_s, 3),
        }


_process_counter = CompileCounter()


def process_counter() -> CompileCounter:
    """The process's own counter (``train.run`` starts it; a run's summary reports it)."""
    return _process_counter


def wait_for(after: threading.Thread | threading.Event | None) -> None:
    """Blocks until ``after`` is done: a thread has ended, an event is set (None: at once)."""
    if isinstance(after, threading.Event):
        after.wait()
    elif after is not None:
        after.join()


def compile_in_background(
    programs,
    *,
    after: threading.Thread | threading.Event | None = None,
    then: Callable[[int], None] | None = None,
) -> threading.Thread:
    """A started daemon thread that waits for ``after`` (``wait_for``: e.g. the sampler's
    compiles ahead, or the end of the run's first step), then compiles ``programs``
    (``jax.stages.Lowered``, lowered on the caller's thread: tracing holds the GIL) in order,
    calling ``then(i)`` when program i is done; jit keeps what it compiles, so a later call of
    the same shapes runs them. One that fails to compile is skipped (``then`` still runs): the
    call that needs it meets the same error where it would have without this."""

    def work():
        wait_for(after)
        for i, lowered in enumerate(programs):
            try:
                with contextlib.suppress(Exception):
                    lowered.compile()
            finally:
                if then is not None:
                    then(i)

    thread = threading.Thread(target=work, name="jaxrlvr-compile-ahead", daemon=True)
    thread.start()
    return thread


def beside(fn, *args, **kwargs) -> concurrent.futures.Future:
    """``fn(*args, **kwargs)`` started on a daemon thread; the returned future gives its result
    or raises its error. For tracing and lowering programs ahead while the caller's own step
    runs XLA's compile, which releases the GIL (``train``: the run's first step)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def work():
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as err:  # noqa: BLE001 (handed to the caller by ``result``)
            future.set_exception(err)

    threading.Thread(target=work, name="jaxrlvr-lower-ahead", daemon=True).start()
    return future
