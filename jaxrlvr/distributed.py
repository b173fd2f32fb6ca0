"""Multi-host setup: starting ``jax.distributed`` (flags, env vars, SLURM, Kubernetes), the report
of a lost process, small cross-process reductions, and the vLLM weight sync of a multi-process job.

JAX runs one process per host (multi-controller); after ``initialize`` every process sees all
processes' devices in ``jax.devices()``, so ``model.make_mesh`` spans them and the same jitted,
sharded update runs everywhere. Where the coordinator address, process count and this process's
id come from (``from_flags``; the first that gives a value wins):

1. the flags ``--coordinator HOST:PORT --num-processes N --process-id I``;
2. the env vars ``JAXRLVR_COORDINATOR``, ``JAXRLVR_NUM_PROCESSES``, ``JAXRLVR_PROCESS_ID``;
3. the cluster (unless ``JAXRLVR_DISTRIBUTED=off``): a SLURM job step of several tasks
   (``srun``: ``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS``, the step's first node, port
   ``JAXRLVR_PORT`` or one derived from ``SLURM_JOB_ID``); in a Kubernetes indexed Job or JobSet
   pod the process id is ``JOB_COMPLETION_INDEX`` (coordinator and count come from 1 or 2);
4. the config's ``distributed:`` section.

``--distributed-auto`` (``JAXRLVR_DISTRIBUTED=auto``) instead leaves everything to JAX's own
cluster detection (Open MPI, Cloud TPU, Kubernetes through its API, SLURM with one device per
process). A loopback coordinator address in a job that spans several hosts is refused with an
error naming ``--coordinator``: the other hosts could not reach it.

Failure: JAX's coordination service (run by process 0) expects a heartbeat from every process;
one silent for ``heartbeat_timeout`` seconds is declared dead and JAX stops every other process
(from a C++ thread, even when its main thread waits in a collective) with a multi-line message.
When the failure reaches Python first (a collective fails because a peer's connection closed),
``report_failure`` names the lost processes in one line by a roll call in the service's key-value
store, and exits with status 1 before JAX's verdict. When process 0 itself dies the service dies
with it and JAX stops the others at once with its own message.

Preemption: ``interrupt.GracefulStop.should_stop`` agrees on the stopping step through JAX's
preemption service (``reached_preemption_sync_point``), whose notifier owns SIGTERM.

On the CPU backend cross-process collectives need an implementation chosen before the backend
starts: ``cpu_collectives="gloo"`` (the default here) sets ``jax_cpu_collectives_implementation``.

Not here: launching the processes (``srun``, a Kubernetes Job, ``scripts/launch_local.sh``, or
``subprocess`` as the tests do).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import sys
import time
import traceback
from typing import Any, Literal

import jax
import numpy as np

from jaxrlvr.algos import loss_config

CpuCollectives = Literal["gloo", "mpi", "none"]

ENV_COORDINATOR = "JAXRLVR_COORDINATOR"
ENV_NUM_PROCESSES = "JAXRLVR_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXRLVR_PROCESS_ID"
ENV_AUTO = "JAXRLVR_DISTRIBUTED"  # "auto": let JAX detect the cluster
ENV_PORT = "JAXRLVR_PORT"  # the coordinator's port in a SLURM job (default: from the job id)
# SLURM: a port from the job id, above Linux's default ephemeral range (32768-60999), so that two
# jobs sharing a node rarely collide and no outgoing connection holds it.
_SLURM_PORT_BASE, _SLURM_PORT_SPAN = 61000, 4000


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """enabled: call ``jax.distributed.initialize`` at all (False: single process).
    auto: let JAX detect coordinator, process count and id from the environment; otherwise
    coordinator_address ("host:port"), num_processes and process_id are required.
    local_device_ids: restrict this process to these local devices (None: all).
    cpu_collectives: CPU cross-process collectives ("gloo", "mpi", or "none" to leave JAX's
    default); ignored on GPU/TPU.
    initialization_timeout: seconds to wait for all processes at start.
    heartbeat_timeout: seconds after which JAX's coordination service declares a silent process
    dead and stops the others (module docstring); the lost-process report comes within it.
    shutdown_timeout: seconds a process that ends waits at exit for the others to end too.
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
    shutdown_timeout: int = 300

    def __post_init__(self) -> None:
        loss_config.check_literal("cpu_collectives", self.cpu_collectives, CpuCollectives)
        for key in ("initialization_timeout", "heartbeat_timeout", "shutdown_timeout"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(
                    f"distributed.{key} must be a whole number of seconds >= 1, got {value!r}"
                )
        if not self.enabled or self.auto:
            return
        if not self.coordinator_address or ":" not in self.coordinator_address:
            raise ValueError(
                "coordinator_address must be 'host:port' when enabled and not auto (--coordinator "
                f"HOST:PORT, env {ENV_COORDINATOR}), got {self.coordinator_address!r}"
            )
        if self.num_processes is None or self.num_processes < 1:
            raise ValueError(
                f"num_processes must be an integer >= 1 when enabled and not auto "
                f"(--num-processes N, env {ENV_NUM_PROCESSES}), got {self.num_processes!r}"
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
    (``ENV_*``), then to the cluster (SLURM, Kubernetes; module docstring), then to the config
    file. Any of them set enables the runtime; a count of 1 disables it."""
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

    env_auto = env.get(ENV_AUTO, "")
    if env_auto not in ("", "auto", "0", "off"):
        raise ValueError(f"env {ENV_AUTO}={env_auto!r}: only 'auto' (or unset) is understood")
    if auto or env_auto == "auto":
        return dataclasses.replace(cfg, enabled=True, auto=True)
    given = {
        "coordinator_address": pick(coordinator, ENV_COORDINATOR, str),
        "num_processes": pick(num_processes, ENV_NUM_PROCESSES, int),
        "process_id": pick(process_id, ENV_PROCESS_ID, int),
    }
    explicit = any(v is not None for v in given.values())
    if env_auto in ("0", "off") and not explicit:  # no cluster detection either
        return cfg
    cluster, detected, hosts = _cluster(env, explicit=explicit)
    given = {k: detected.get(k) if v is None else v for k, v in given.items()}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return cfg
    if given.get("num_processes", cfg.num_processes) == 1:
        return dataclasses.replace(cfg, enabled=False)
    out = dataclasses.replace(cfg, enabled=True, auto=False, **given)
    if hosts > 1 and _is_loopback(out.coordinator_address):
        raise ValueError(
            f"coordinator address {out.coordinator_address} is a loopback address but this "
            f"{cluster} job spans {hosts} hosts: pass --coordinator HOST:PORT (env "
            f"{ENV_COORDINATOR}) with an address of process 0's host that the others reach"
        )
    return out


def _cluster(env, *, explicit: bool) -> tuple[str, dict[str, Any], int]:
    """(cluster name, the values it gives, the number of hosts the job spans: 1 when unknown)."""
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 1)
    if "SLURM_PROCID" in env and tasks > 1:  # inside `srun` with several tasks
        port = env.get(ENV_PORT) or _SLURM_PORT_BASE + int(env["SLURM_JOB_ID"]) % _SLURM_PORT_SPAN
        nodes = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
        values = {
            "coordinator_address": f"{first_slurm_host(nodes)}:{port}",
            "num_processes": tasks,
            "process_id": int(env["SLURM_PROCID"]),
        }
        return "SLURM", values, int(env.get("SLURM_STEP_NUM_NODES") or 1)
    if "JOB_COMPLETION_INDEX" in env and explicit:  # a Kubernetes indexed Job / JobSet pod
        n = int(env.get(ENV_NUM_PROCESSES) or 1)
        return "Kubernetes", {"process_id": int(env["JOB_COMPLETION_INDEX"])}, n  # a pod each
    return "multi-process", {}, 1


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM hostlist: 'gpu[003-006,9],cpu1' -> 'gpu003'."""
    m = re.match(r"([^,\[]+)(?:\[([^\],\-]+))?", nodelist.strip())
    if not m:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    return m.group(1) + (m.group(2) or "")


def _is_loopback(address: str | None) -> bool:
    host = (address or "").rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: resolved by each process (process 0's own may map to 127.x)


_state: dict[str, Any] = {"cfg": None, "finished": False}


def initialize(cfg: DistributedConfig) -> bool:
    """Initialise JAX's multi-controller runtime per ``cfg``; returns True if it did.

    Call it first, before anything touches a JAX device. Does nothing (returns False) when
    ``cfg.enabled`` is False or the runtime is already initialised.
    """
    if not cfg.enabled or jax.distributed.is_initialized():
        return False
    if cfg.cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    kwargs: dict[str, Any] = {
        "initialization_timeout": cfg.initialization_timeout,
        "heartbeat_timeout_seconds": cfg.heartbeat_timeout,
        "shutdown_timeout_seconds": cfg.shutdown_timeout,
    }
    if cfg.local_device_ids is not None:
        kwargs["local_device_ids"] = list(cfg.local_device_ids)
    if not cfg.auto:
        # All given: JAX's own detection would otherwise restrict a SLURM task to one GPU.
        kwargs.update(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
            cluster_detection_method="deactivate",
        )
    jax.distributed.initialize(**kwargs)
    _state.update(cfg=cfg, finished=False)
    return True


def finish() -> None:
    """Marks this process's clean end (call it when the job's work is done): an error after it
    is not reported as a lost process. JAX's shutdown barrier runs at exit."""
    _state["finished"] = True


def report_failure(error: BaseException) -> None:
    """Called with the exception that ends a process of a multi-process job: prints one line and
    exits with status 1 (``os._exit``: JAX's shutdown barrier would wait for a dead process, then
    abort). Returns (the caller raises ``error``) in a single-process run or after ``finish()``.

    A runtime failure (``jax.errors.JaxRuntimeError`` in the chain: a collective whose peer
    closed its connection) starts a roll call in JAX's coordination service: each failing
    process checks in under ``jaxrlvr/failed/``; those missing after ``heartbeat_timeout / 6``
    seconds (at most 10) are named as lost. The answer must come before JAX's own verdict
    (measured: from half the heartbeat timeout after the death on), which aborts the process
    from C++ with a multi-line message and leaves Python no time to speak.
    Any other error is this process's own: its line names it (after its traceback unless it is
    a user's error, a ValueError or missing file), and the others report this process as lost.
    """
    cfg = _state["cfg"]
    if cfg is None or _state["finished"] or jax.process_count() == 1:
        return
    me, n = jax.process_index(), jax.process_count()
    what = _one_line(error)
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, jax.errors.JaxRuntimeError):
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        grace = min(cfg.heartbeat_timeout / 6, 10.0)
        answered = _roll_call(me, n, grace)
        if isinstance(answered, str):
            what = f"lost process 0 (JAX's coordination service, which it runs: {answered})"
        elif lost := sorted(set(range(n)) - answered):
            what = (
                f"lost process{'es' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
                f"(a collective failed and it did not check in within {grace:g} s)"
            )
    elif not isinstance(error, (ValueError, FileNotFoundError)):  # a bug: keep its traceback
        traceback.print_exception(error, file=sys.stderr)
    print(
        f"jaxrlvr: error: process {me}: {what}; stopping this process (restart every process "
        "with --resume to continue from the last checkpoint)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(1)


def _roll_call(me: int, n: int, grace: float) -> set[int] | str:
    """The processes that checked in as failed within ``grace`` seconds (this one included), or
    why the coordination service cannot be asked. Its key-value store has no public handle:
    read through ``jax._src.distributed.global_state.client``, as orbax does."""
    from jax._src import distributed as jax_distributed

    try:
        client = jax_distributed.global_state.client
        client.key_value_set(f"jaxrlvr/failed/{me}", "1")
        deadline = time.monotonic() + grace
        while True:
            keys = client.key_value_dir_get("jaxrlvr/failed/")
            answered = {int(k.rsplit("/", 1)[1]) for k, _ in keys}
            if len(answered) >= n or time.monotonic() > deadline:
                return answered
            time.sleep(0.1)
    except Exception as e:  # the service is gone (process 0 died), or its API changed
        return _one_line(e)


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text.splitlines()[0]}" if text else type(e).__name__


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
# vLLM in a multi-process job


def host_weights(tree: Any) -> Any:
    """``tree``'s arrays whole on this host (a collective with several processes: every process
    calls it), e.g. to export sharded weights for a vLLM server; unchanged with one process."""
    if jax.process_count() == 1:
        return tree
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(tree, tiled=True)


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

        host = host_weights(weights)
        out: dict[str, float] = {}
        if not self.shared or jax.process_index() == 0:
            out = self.inner.update_weights(host, version=version)
        self._syncs += 1
        multihost_utils.sync_global_devices(f"jaxrlvr-weights-{self._syncs}")
        return out

    def close(self) -> None:
        self.inner.close()
