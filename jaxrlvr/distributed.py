"""Multi-host setup: ``jax.distributed`` start-up, small cross-process reductions, a liveness
watchdog, and the vLLM weight sync of a multi-process job.

JAX runs one process per host (multi-controller); after ``initialize`` every process sees all
processes' devices in ``jax.devices()``, so ``model.make_mesh`` spans them and the same jitted,
sharded update runs everywhere. Either give the coordinator address, process count and this
process's id explicitly (config ``distributed.*``, ``jaxrlvr train --coordinator HOST:PORT
--num-processes N --process-id I``, or the env vars ``JAXRLVR_COORDINATOR``,
``JAXRLVR_NUM_PROCESSES``, ``JAXRLVR_PROCESS_ID``), or set ``auto`` (``--distributed-auto``,
``JAXRLVR_DISTRIBUTED=auto``) and let JAX detect them from the cluster environment (SLURM, Open
MPI, Kubernetes/GKE, Cloud TPU).

On the CPU backend cross-process collectives need an implementation chosen before the backend
starts: ``cpu_collectives="gloo"`` (the default here) sets ``jax_cpu_collectives_implementation``.

Failure: a process that dies leaves the others blocked in a collective (gloo and the coordination
service wait for minutes). ``Watchdog`` keeps one TCP connection from every process to process 0
with a heartbeat; a connection that closes without a clean goodbye, or stays silent for
``watchdog_timeout`` seconds, makes every surviving process print one line naming the lost
process and exit with status 1 (``os._exit``: the main thread may be stuck in a collective).

Not here: launching the processes (``scripts/launch_local.sh``, your scheduler, or
``subprocess`` as the tests do).
"""

from __future__ import annotations

import dataclasses
import json
import os
import select
import socket
import sys
import threading
import time
from typing import Any, Literal

import jax
import numpy as np

from jaxrlvr.algos import loss_config

CpuCollectives = Literal["gloo", "mpi", "none"]

ENV_COORDINATOR = "JAXRLVR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRLVR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRLVR_PROCESS_ID"
ENV_AUTO = "JAXRLVR_DISTRIBUTED"  # "auto": let JAX detect the cluster


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """enabled: call ``jax.distributed.initialize`` at all (False: single process).
    auto: let JAX detect coordinator, process count and id from the environment; otherwise
    coordinator_address ("host:port"), num_processes and process_id are required.
    local_device_ids: restrict this process to these local devices (None: all).
    cpu_collectives: CPU cross-process collectives ("gloo", "mpi", or "none" to leave JAX's
    default); ignored on GPU/TPU.
    initialization_timeout: seconds to wait for all processes.
    heartbeat_timeout: seconds after which JAX's coordination service declares a silent process
    dead (its own, slower detection; the watchdog normally reports first).
    watchdog: run the liveness watchdog (module docstring); watchdog_timeout: seconds without a
    heartbeat before a process whose connection is still open is declared lost.
    """

    enabled: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    local_device_ids: tuple[int, ...] | None = None
    cpu_collectives: CpuCollectives = "gloo"
    initialization_timeout: int = 300
    heartbeat_timeout: int = 100
    watchdog: bool = True
    watchdog_timeout: float = 60.0

    def __post_init__(self) -> None:
        loss_config.check_literal("cpu_collectives", self.cpu_collectives, CpuCollectives)
        if self.watchdog_timeout <= 0:
            raise ValueError(f"watchdog_timeout must be > 0 seconds, got {self.watchdog_timeout}")
        if not self.enabled or self.auto:
            return
        if not self.coordinator_address or ":" not in self.coordinator_address:
            raise ValueError(
                "coordinator_address must be 'host:port' when enabled and not auto, "
                f"got {self.coordinator_address!r}"
            )
        if self.num_processes is None or self.num_processes < 1:
            raise ValueError(
                f"num_processes must be an integer >= 1 when enabled and not auto, "
                f"got {self.num_processes!r}"
            )
        if self.process_id is None or not 0 <= self.process_id < self.num_processes:
            raise ValueError(
                f"process_id must be in [0, num_processes={self.num_processes}), "
                f"got {self.process_id!r}"
            )


def from_flags(
    cfg: DistributedConfig,
    *,
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    auto: bool = False,
    environ: dict[str, str] | None = None,
) -> DistributedConfig:
    """``cfg`` with the command line's flags applied, each falling back to its env var
    (``ENV_*``); any of them set enables the runtime. Flags win over env vars, both over the
    config file."""
    env = os.environ if environ is None else environ

    def pick(flag, name, cast):
        if flag is not None:
            return flag
        raw = env.get(name)
        if raw in (None, ""):
            return None
        try:
            return cast(raw)
        except ValueError:
            raise ValueError(f"env {name}={raw!r} is not a valid {cast.__name__}") from None

    coordinator = pick(coordinator, ENV_COORDINATOR, str)
    num_processes = pick(num_processes, ENV_NUM_PROCESSES, int)
    process_id = pick(process_id, ENV_PROCESS_ID, int)
    env_auto = env.get(ENV_AUTO, "")
    if env_auto not in ("", "auto", "0", "off"):
        raise ValueError(f"env {ENV_AUTO}={env_auto!r}: only 'auto' (or unset) is understood")
    auto = auto or env_auto == "auto"
    given = {
        k: v
        for k, v in dict(
            coordinator_address=coordinator, num_processes=num_processes, process_id=process_id
        ).items()
        if v is not None
    }
    if not given and not auto:
        return cfg
    if num_processes == 1 and not auto:
        return dataclasses.replace(cfg, enabled=False)
    return dataclasses.replace(cfg, enabled=True, auto=auto, **given)


def initialize(cfg: DistributedConfig) -> bool:
    """Initialise JAX's multi-controller runtime per ``cfg``; returns True if it did.

    Call it first, before anything touches a JAX device. Does nothing (returns False) when
    ``cfg.enabled`` is False or the runtime is already initialised. With more than one process
    and ``cfg.watchdog``, starts the ``Watchdog``.
    """
    if not cfg.enabled or jax.distributed.is_initialized():
        return False
    if cfg.cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    kwargs = {
        "initialization_timeout": cfg.initialization_timeout,
        "heartbeat_timeout_seconds": cfg.heartbeat_timeout,
    }
    if cfg.local_device_ids is not None:
        kwargs["local_device_ids"] = list(cfg.local_device_ids)
    if not cfg.auto:
        kwargs.update(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
        )
    jax.distributed.initialize(**kwargs)
    if cfg.watchdog and jax.process_count() > 1:
        host = cfg.coordinator_address.rsplit(":", 1)[0] if cfg.coordinator_address else None
        Watchdog.start(host=host, timeout=cfg.watchdog_timeout)
    return True


def finish() -> None:
    """Tells the other processes that this one ends cleanly (no "lost process" report); call it
    when the job's work is done. A process that exits without it counts as lost."""
    if Watchdog.current is not None:
        Watchdog.current.goodbye()


# ----------------------------------------------------------------------------------------------
# Cross-process reductions (collectives: every process calls them, in the same order)


def allgather(x: Any) -> np.ndarray:
    """``x`` (a NumPy-able array or scalar) of every process, stacked: [num_processes, ...]."""
    x = np.asarray(x)
    if jax.process_count() == 1:
        return x[None]
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x))


def allgather_json(obj: Any) -> list[Any]:
    """Every process's JSON-serialisable ``obj``, in process order."""
    if jax.process_count() == 1:
        return [obj]
    data = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    size = int(allgather(np.int64(data.size)).max())
    buf = np.zeros(size, np.uint8)
    buf[: data.size] = data
    return [json.loads(bytes(row).rstrip(b"\0").decode()) for row in allgather(buf)]


def agree_max(*values: int) -> tuple[int, ...]:
    """The elementwise maximum of ``values`` over all processes (shapes every process must share,
    e.g. a length bucket)."""
    return tuple(int(v) for v in allgather(np.asarray(values, np.int64)).max(axis=0))


# Metrics of a step that are totals over the job (summed), maxima, or the global batch's shape;
# every other metric is a mean over equal-sized per-process shares (averaged).
_SUM_PREFIXES = ("throughput/", "grading/n", "grading/timeouts", "grading/errors")
_SUM_KEYS = {"tokens/response", "tokens/attended", "tokens/batch_shape_B", "eval/n"}
_MAX_SUFFIXES = ("_max",)
_MAX_KEYS = {"tokens/batch_shape_T"}


def reduce_metrics(
    metrics: dict[str, float], weights: dict[str, float] | None = None
) -> dict[str, float]:
    """One step's host metrics, each process holding its own rows' values, reduced over the
    processes (one collective): sums (totals, throughputs), maxima (``*_max``, time/* of the
    slowest process; sync/*), pooled standard deviations (``*_std`` with a ``*_mean`` beside it) and
    means for the rest; per-process shares are equal in size (the driver splits rows evenly),
    except for the means over a subset of the rows named in ``weights`` (key -> this process's
    row count of that subset), which are weighted by it. Device metrics (replicated) come out
    unchanged. Single process: ``metrics`` as they are.
    """
    if jax.process_count() == 1 or not metrics:
        return metrics
    # A metric only some processes report (e.g. sync/* of the process that pushes weights to a
    # shared vLLM) is reduced over those that do.
    keys = sorted(set().union(*map(set, allgather_json(sorted(metrics)))))
    weights = weights or {}
    wkeys = sorted(weights)
    row = [float(metrics.get(k, np.nan)) for k in keys] + [float(weights[k]) for k in wkeys]
    values = allgather(np.asarray(row, np.float64))
    out = {}
    for j, k in enumerate(keys):
        col = values[:, j]
        if k in weights:
            w = values[:, len(keys) + wkeys.index(k)]
            ok = ~np.isnan(col) & (w > 0)
            out[k] = float(np.sum(col[ok] * w[ok]) / np.sum(w[ok])) if ok.any() else float("nan")
            continue
        col = col[~np.isnan(col)] if not np.isnan(col).all() else col[:1]
        if k in _SUM_KEYS or k.startswith(_SUM_PREFIXES):
            out[k] = float(col.sum())
        elif k in _MAX_KEYS or k.endswith(_MAX_SUFFIXES) or k.startswith(("time/", "sync/")):
            out[k] = float(col.max())
        elif k.endswith("_std") and k[: -len("_std")] + "_mean" in keys:
            means = values[:, keys.index(k[: -len("_std")] + "_mean")]
            out[k] = float(np.sqrt(max(np.mean(col**2 + means**2) - np.mean(means) ** 2, 0.0)))
        else:
            out[k] = float(col.mean())
    return out


# ----------------------------------------------------------------------------------------------
# Liveness


class Watchdog:
    """Every process keeps one TCP connection to process 0 (a star), each side sending a
    heartbeat byte every ``timeout / 6`` seconds. Process 0 reports a connection that closes
    without a goodbye, or stays silent for ``timeout`` seconds, and tells the others which
    process was lost; a non-zero process reports process 0's connection closing. The report is
    one line on stderr, then ``os._exit(1)``."""

    current: Watchdog | None = None

    def __init__(self, timeout: float):
        self.timeout = timeout
        self.interval = max(timeout / 6, 0.2)
        self.pid = jax.process_index()
        self.lost: str | None = None
        self._done = threading.Event()
        self._peers: dict[int, socket.socket] = {}
        self._lock = threading.Lock()

    @classmethod
    def start(cls, *, host: str | None, timeout: float) -> Watchdog:
        """Connects every process to process 0 (a collective: all processes call it)."""
        from jax.experimental import multihost_utils

        dog = cls(timeout)
        n = jax.process_count()
        listener = None
        if dog.pid == 0:
            listener = socket.create_server(("", 0), backlog=n)
            port = listener.getsockname()[1]
            ip = socket.gethostbyname(host) if host else _own_ip()
            packed = np.asarray([port, *map(int, ip.split("."))], np.int64)
        else:
            packed = np.zeros(5, np.int64)
        packed = np.asarray(multihost_utils.broadcast_one_to_all(packed))
        port, ip = int(packed[0]), ".".join(str(int(x)) for x in packed[1:])
        if dog.pid == 0:
            listener.settimeout(120)
            for _ in range(n - 1):
                conn, _ = listener.accept()
                peer = int(conn.makefile("rb").readline().decode().strip() or -1)
                dog._peers[peer] = conn
            listener.close()
        else:
            conn = socket.create_connection((ip, port), timeout=120)
            conn.sendall(f"{dog.pid}\n".encode())
            dog._peers[0] = conn
        for conn in dog._peers.values():
            conn.setblocking(False)
        threading.Thread(target=dog._watch, name="jaxrlvr-watchdog", daemon=True).start()
        cls.current = dog
        return dog

    def goodbye(self) -> None:
        """A clean end: tell the peers, stop watching."""
        if self._done.is_set():
            return
        self._done.set()
        with self._lock:
            for conn in self._peers.values():
                try:
                    conn.setblocking(True)
                    conn.sendall(b"B")
                    conn.close()
                except OSError:
                    pass

    def _send_all(self, data: bytes) -> None:
        with self._lock:
            for conn in self._peers.values():
                try:
                    conn.send(data)
                except (BlockingIOError, OSError):
                    pass

    def _fatal(self, message: str) -> None:
        if self._done.is_set():
            return
        self.lost = message
        if self.pid == 0:  # let the others name the same lost process
            self._send_all(f"L{message}\n".encode())
        print(
            f"jaxrlvr: error: process {self.pid}: {message}; stopping this process (restart "
            "every process with --resume to continue from the last checkpoint)",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    def _watch(self) -> None:
        last_seen = {p: time.monotonic() for p in self._peers}
        last_sent = 0.0
        buffers = {p: b"" for p in self._peers}
        while not self._done.is_set():
            now = time.monotonic()
            if now - last_sent >= self.interval:
                self._send_all(b".")
                last_sent = now
            conns = {c: p for p, c in self._peers.items()}
            try:
                readable, _, _ = select.select(list(conns), [], [], self.interval / 2)
            except (OSError, ValueError):
                return
            if self._done.is_set():
                return
            for conn in readable:
                peer = conns[conn]
                try:
                    data = conn.recv(4096)
                except BlockingIOError:
                    continue
                except OSError as e:
                    self._fatal(f"lost process {peer} (connection error: {e})")
                    return
                if not data:
                    self._fatal(f"lost process {peer} (it exited or was killed mid-run)")
                    return
                last_seen[peer] = time.monotonic()
                buffers[peer] += data
                if b"L" in buffers[peer]:  # process 0 names a lost process
                    text = buffers[peer].split(b"L", 1)[1]
                    if b"\n" in text:
                        self._fatal(text.split(b"\n", 1)[0].decode() + " (reported by process 0)")
                        return
                    continue
                if b"B" in buffers[peer]:  # a clean goodbye: stop watching that peer
                    if self.pid != 0:
                        self._done.set()
                        return
                    with self._lock:
                        self._peers.pop(peer).close()
                    last_seen.pop(peer)
            if self.pid == 0 and not self._peers:
                return
            for peer, seen in last_seen.items():
                if time.monotonic() - seen > self.timeout:
                    self._fatal(f"lost process {peer} (no heartbeat for {self.timeout:.0f} s)")
                    return


def _own_ip() -> str:
    """This host's address as the other hosts see it (auto-detected clusters)."""
    try:
        return socket.gethostbyname(socket.getfqdn())
    except OSError:
        return socket.gethostbyname(socket.gethostname())


# ----------------------------------------------------------------------------------------------
# vLLM in a multi-process job


class ProcessSyncedSampler:
    """A vLLM sampler inside an N-process job: ``update_weights`` gathers the sharded weights to
    every host (a collective), pushes them (process 0 only when ``shared``: one server group for
    the job; every process to its own servers otherwise: one group per host) and waits at a
    barrier, so no process samples before every server serves the new weights.
    ``generate`` is the inner sampler's, on this process's prompts only."""

    def __init__(self, inner: Any, *, shared: bool):
        self.inner = inner
        self.shared = shared
        self._syncs = 0

    def generate(self, prompt_token_ids, n, sampling_params):
        return self.inner.generate(prompt_token_ids, n, sampling_params)

    def update_weights(self, weights: Any, *, version: int | None = None) -> dict[str, float]:
        from jax.experimental import multihost_utils

        host = multihost_utils.process_allgather(weights, tiled=True)
        out: dict[str, float] = {}
        if not self.shared or jax.process_index() == 0:
            out = self.inner.update_weights(host, version=version)
        self._syncs += 1
        multihost_utils.sync_global_devices(f"jaxrlvr-weights-{self._syncs}")
        return out

    def close(self) -> None:
        self.inner.close()
