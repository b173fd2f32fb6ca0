"""Which GPUs the vLLM servers get and which the trainer's JAX sees, decided before JAX starts.

On a GPU host ``jaxrlvr train`` with ``sampler.kind: vllm`` runs two kinds of processes: the
trainer (JAX) and one or more vLLM servers (torch). JAX takes 75% of the memory of every GPU it
can see when its backend starts, so a server started afterwards on the same GPUs cannot allocate
its cache. `plan` turns the ``sampler`` section into a `Placement`:

- separate GPUs (the default): the servers get ``sampler.vllm_gpus`` (default: the last
  ``vllm_num_servers`` GPUs), split into ``vllm_num_servers`` equal groups, one tensor-parallel
  server per group; the trainer's JAX sees the other GPUs only (``CUDA_VISIBLE_DEVICES``);
- colocated (``sampler.vllm_colocate``): servers and trainer share GPUs; JAX preallocates only
  ``vllm_trainer_memory_fraction`` of each GPU (``XLA_PYTHON_CLIENT_MEM_FRACTION``) and the
  server takes ``vllm_gpu_memory_utilization``, and the two must leave headroom (sum <= 0.95).

`apply` writes the trainer's variables into the environment; it must run before anything touches
a JAX device (``jax.devices()``, ``jax.process_index()``, an array), because JAX reads them once,
when its backend starts. `check_jax_devices` then asks JAX (``jax.local_devices()``, which starts
the backend if nothing did yet) and raises `PlacementError`, one line, when JAX already holds other
GPUs than planned. GPU numbers in the config are positions in the GPUs visible when the trainer
started (its ``CUDA_VISIBLE_DEVICES``, or all of the host's); the first `apply` records that list
in ``JAXRLVR_HOST_GPUS`` so that a second call (and ``jaxrlvr serve-vllm``) numbers them the same.

`plan_serve` plans ``jaxrlvr serve-vllm`` (servers only, no trainer) from its flags with the same
rules. This module is the one place that decides devices, GPU groups, dtypes and memory fractions;
``sampling.vllm_server`` and ``builders.build_sampler`` start what it planned.

On the CPU, with the embedded JAX sampler, or with servers given by URL, the plan changes
nothing. Not here: starting the servers (``builders.build_sampler``, ``sampling.vllm_server``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

HOST_GPUS_ENV = "JAXRLVR_HOST_GPUS"
DEVICES = ("cpu", "cuda")
# The servers' dtype when none is given: float32 on the CPU (logprobs match the trainer's float32
# ones), bfloat16 on GPUs (what the tensor cores run; weights are exported in it too).
DEFAULT_DTYPE = {"cpu": "float32", "cuda": "bfloat16"}
# A server's share of each of its GPUs' memory when it has them to itself.
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Defaults for one shared GPU (80 GB H100, Qwen2.5-1.5B): the trainer's fp32 master weights, Adam
# moments, gradients and remat activations fit in half; vLLM's bf16 weights (3 GB), CUDA graphs
# and a KV cache of ~15 GB (~500k tokens) in 0.35. The rest is for the CUDA contexts.
COLOCATED_TRAINER_FRACTION = 0.5
COLOCATED_SERVER_UTILIZATION = 0.35
MAX_COLOCATED_SUM = 0.95


class PlacementError(ValueError):
    """The GPUs asked for do not exist, or JAX already holds other devices than planned (a
    ValueError, so the CLI prints it as one line)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Placement:
    """Where each process runs.

    device: "cpu" or "cuda" (the servers'); server_gpus: one tuple of ``CUDA_VISIBLE_DEVICES``
    entries per server (empty on the CPU); trainer_gpus: the trainer's ``CUDA_VISIBLE_DEVICES``
    entries, None to leave the environment as it is; memory_fraction: JAX's
    ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (None: JAX's default); gpu_memory_utilization: each
    server's ``--gpu-memory-utilization``; dtype: the servers' dtype (and the weight export's).
    """

    device: str = "cpu"
    server_gpus: tuple[tuple[str, ...], ...] = ()
    trainer_gpus: tuple[str, ...] | None = None
    colocated: bool = False
    memory_fraction: float | None = None
    gpu_memory_utilization: float | None = None
    dtype: str = "float32"

    @property
    def trainer_env(self) -> dict[str, str]:
        """The variables `apply` sets for the trainer's JAX."""
        env = {}
        if self.trainer_gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.trainer_gpus)
        if self.memory_fraction is not None:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{self.memory_fraction:g}"
            # Take the whole share at start: a server started later then finds the rest free,
            # and a layout that does not fit fails at server start, not in the middle of a step.
            env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "true"
        return env

    def describe(self) -> str:
        if self.device == "cpu" or not self.server_gpus:
            return "vLLM on the CPU; the trainer's devices unchanged"
        servers = "; ".join(
            f"server {i}: GPU {','.join(g)} (tp={len(g)})" for i, g in enumerate(self.server_gpus)
        )
        trainer = "all" if self.trainer_gpus is None else ",".join(self.trainer_gpus)
        mem = f", JAX memory fraction {self.memory_fraction:g}" if self.memory_fraction else ""
        return (
            f"{servers}; trainer: GPU {trainer}{mem}; server memory utilisation "
            f"{self.gpu_memory_utilization:g}"
        )


def host_gpus(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries, without starting JAX.

    Order of sources: ``JAXRLVR_HOST_GPUS`` (what an earlier `apply` saw), then
    ``CUDA_VISIBLE_DEVICES``, then the NVIDIA driver's list (``/proc/driver/nvidia/gpus``).
    """
    environ = os.environ if environ is None else environ
    for key in (HOST_GPUS_ENV, "CUDA_VISIBLE_DEVICES"):
        if key in environ:
            value = environ[key].strip()
            if value in ("", "-1"):
                return ()
            return tuple(v.strip() for v in value.split(",") if v.strip())
    try:
        count = len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        count = 0
    return tuple(str(i) for i in range(count))


def jax_wants_cpu(environ: Mapping[str, str] | None = None) -> bool:
    """True when ``JAX_PLATFORMS`` pins JAX to platforms without a GPU (e.g. "cpu")."""
    environ = os.environ if environ is None else environ
    platforms = environ.get("JAX_PLATFORMS", "").lower()
    return bool(platforms) and not any(p in platforms for p in ("cuda", "gpu", "rocm"))


def resolve_device(device: str, host: Sequence[str], environ: Mapping[str, str] | None = None):
    """ "cpu" or "cuda" for a ``device`` option: "auto" is "cuda" when the host has GPUs and
    ``JAX_PLATFORMS`` does not pin JAX to the CPU."""
    if device == "auto":
        return "cuda" if host and not jax_wants_cpu(environ) else "cpu"
    return device


def split_groups(gpus: Sequence[Any], num_servers: int, key: str = "sampler.vllm_gpus"):
    """``gpus`` cut into ``num_servers`` equal consecutive groups, one tensor-parallel server
    each."""
    if num_servers < 1 or len(gpus) % num_servers:
        raise PlacementError(
            f"{key}={list(gpus)!r}: {len(gpus)} GPUs do not split into {num_servers} equal "
            "server groups"
        )
    size = len(gpus) // num_servers
    return tuple(tuple(gpus[i * size : (i + 1) * size]) for i in range(num_servers))


def plan(
    sampler: Any,
    *,
    gpus: Sequence[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Placement:
    """The placement a ``config.SamplerSection`` asks for on this host.

    Args:
      sampler: the config's sampler section.
      gpus: the host's GPUs (``CUDA_VISIBLE_DEVICES`` entries); default `host_gpus`.
      environ: the environment to read (default ``os.environ``).

    Raises:
      PlacementError: a GPU number beyond the host's GPUs, no GPU left for the trainer, or
        ``vllm_device: cuda`` on a host without GPUs.
    """
    environ = os.environ if environ is None else environ
    s = sampler
    dtype_for = lambda device: s.vllm_dtype if s.vllm_dtype != "auto" else DEFAULT_DTYPE[device]
    host = tuple(host_gpus(environ) if gpus is None else gpus)
    device = resolve_device(s.vllm_device, host, environ)
    if s.kind != "vllm" or s.vllm_urls:
        # No server of ours: nothing to place (a server given by URL runs where its owner put
        # it; its export dtype assumes it runs on this host's kind of device).
        return Placement(dtype=dtype_for(device))
    if device == "cpu":
        return Placement(device="cpu", dtype=dtype_for("cpu"))
    if not host:
        raise PlacementError(
            "sampler.vllm_device='cuda': no GPU visible (CUDA_VISIBLE_DEVICES and "
            "/proc/driver/nvidia/gpus list none); use sampler.vllm_device=cpu"
        )
    n = len(host)
    wanted = tuple(s.vllm_gpus)
    if not wanted:
        wanted = tuple(range(n)) if s.vllm_colocate else tuple(range(n - s.vllm_num_servers, n))
    bad = [g for g in wanted if not 0 <= g < n]
    if bad:
        raise PlacementError(
            f"sampler.vllm_gpus={list(wanted)!r}: GPU {bad[0]} does not exist on this host "
            f"({n} GPU{'s' if n != 1 else ''} visible: 0..{n - 1})"
        )
    groups = split_groups([host[g] for g in wanted], s.vllm_num_servers)
    if s.vllm_colocate:
        fraction = s.vllm_trainer_memory_fraction or COLOCATED_TRAINER_FRACTION
        util = s.vllm_gpu_memory_utilization or COLOCATED_SERVER_UTILIZATION
        return Placement(
            device="cuda",
            server_gpus=groups,
            trainer_gpus=None,
            colocated=True,
            memory_fraction=fraction,
            gpu_memory_utilization=util,
            dtype=dtype_for("cuda"),
        )
    rest = tuple(host[i] for i in range(n) if i not in wanted)
    if not rest and not jax_wants_cpu(environ):
        raise PlacementError(
            f"sampler.vllm_gpus={list(wanted)!r} takes all {n} GPUs and leaves none for the "
            "trainer; give the servers fewer, or set sampler.vllm_colocate=true to share them"
        )
    return Placement(
        device="cuda",
        server_gpus=groups,
        # The trainer on the CPU (JAX_PLATFORMS=cpu) with every GPU serving: hide them all.
        trainer_gpus=rest,
        memory_fraction=s.vllm_trainer_memory_fraction,
        gpu_memory_utilization=s.vllm_gpu_memory_utilization or DEFAULT_GPU_MEMORY_UTILIZATION,
        dtype=dtype_for("cuda"),
    )


def plan_serve(
    *,
    device: str,
    gpus: Sequence[int],
    num_servers: int,
    gpu_memory_utilization: float,
    dtype: str,
    host: Sequence[str],
    environ: Mapping[str, str] | None = None,
) -> Placement:
    """The placement of ``jaxrlvr serve-vllm``'s servers for its flags (``--device``, ``--gpus``,
    ``--num-servers``, ``--gpu-memory-utilization``, ``--dtype``) on a host with GPUs ``host``
    (``CUDA_VISIBLE_DEVICES`` entries). On GPUs: ``gpus`` (default: the first ``num_servers``,
    one each) in ``num_servers`` equal tensor-parallel groups; on the CPU one empty group per
    server. No trainer: ``trainer_gpus`` is None.

    Raises:
      ValueError: ``num_servers`` < 1, a GPU beyond the host's, or ``gpus`` on the CPU.
    """
    device = resolve_device(device, host, environ)
    if num_servers < 1:
        raise ValueError(f"--num-servers {num_servers}: must be >= 1")
    groups: tuple[tuple[str, ...], ...] = ((),) * num_servers
    if device == "cuda":
        wanted = tuple(gpus) or tuple(range(num_servers))
        bad = [g for g in wanted if not 0 <= g < len(host)]
        if bad:
            raise ValueError(
                f"--gpus {','.join(map(str, wanted))}: GPU {bad[0]} does not exist "
                f"({len(host)} visible)"
            )
        groups = split_groups([host[g] for g in wanted], num_servers, "--gpus")
    elif gpus:
        raise ValueError("--gpus needs --device cuda (or auto on a host with GPUs)")
    return Placement(
        device=device,
        server_gpus=groups,
        gpu_memory_utilization=gpu_memory_utilization,
        dtype=DEFAULT_DTYPE[device] if dtype == "auto" else dtype,
    )


def apply(placement: Placement, environ: MutableMapping[str, str] | None = None) -> Placement:
    """Sets the trainer's variables (`Placement.trainer_env`) in ``environ`` (``os.environ``).

    Call before anything touches a JAX device; `check_jax_devices` afterwards tells whether it
    was in time. Records the host's GPUs in ``JAXRLVR_HOST_GPUS`` first, so that GPU numbers
    keep meaning the same GPUs after ``CUDA_VISIBLE_DEVICES`` has been narrowed.
    """
    environ = os.environ if environ is None else environ
    env = placement.trainer_env
    if not env:
        return placement
    if HOST_GPUS_ENV not in environ:
        environ[HOST_GPUS_ENV] = ",".join(host_gpus(environ))
    environ.update(env)
    return placement


def check_jax_devices(
    placement: Placement, devices: Callable[[], Sequence[Any]] | Sequence[Any] | None = None
) -> None:
    """Raises `PlacementError` when JAX's GPUs are not the trainer's planned ones.

    ``devices``: this process's JAX devices (default: ``jax.local_devices()``, which starts the
    backend with the environment `apply` set if nothing started it before). Only the count can
    be compared (JAX numbers the visible GPUs 0..n-1): a backend started before `apply` sees
    every GPU.
    """
    if placement.trainer_gpus is None:
        return
    if devices is None:
        import jax

        devices = jax.local_devices
    found = list(devices() if callable(devices) else devices)
    gpus = [d for d in found if d.platform in ("gpu", "cuda", "rocm")]
    if not gpus:
        return  # the trainer runs on the CPU (JAX_PLATFORMS=cpu): the GPUs are the servers'
    if len(gpus) != len(placement.trainer_gpus):
        servers = ";".join(",".join(g) for g in placement.server_gpus)
        raise PlacementError(
            f"JAX already started on {len(gpus)} GPUs, but the trainer should see "
            f"{len(placement.trainer_gpus)} (GPU {','.join(placement.trainer_gpus)}; vLLM gets "
            f"GPU {servers}): something touched a JAX device before the placement; start "
            f"jaxrlvr in a fresh process or set CUDA_VISIBLE_DEVICES="
            f"{','.join(placement.trainer_gpus)} yourself"
        )


def place_trainer(sampler: Any) -> Placement:
    """`plan` + `apply` for this process (idempotent): what ``Trainer.__init__`` calls first."""
    return apply(plan(sampler))
