"""Multi-host setup: a config section for ``jax.distributed.initialize``.

JAX runs one process per host (multi-controller); after ``initialize`` every process sees all
processes' devices in ``jax.devices()``, so ``model.make_mesh`` spans them and the same jitted,
sharded update runs everywhere. Either give the coordinator address, process count and this
process's id explicitly, or set ``auto`` and let JAX detect them from the cluster environment
(SLURM, Open MPI, Kubernetes/GKE, Cloud TPU).

On the CPU backend cross-process collectives need an implementation chosen before the backend
starts: ``cpu_collectives="gloo"`` (the default here) sets ``jax_cpu_collectives_implementation``.

Not here: launching the processes (use your scheduler, or ``subprocess`` as the tests do).
"""

import dataclasses
from typing import Literal

import jax

from jaxrlvr.algos import loss_config

CpuCollectives = Literal["gloo", "mpi", "none"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistributedConfig:
    """enabled: call ``jax.distributed.initialize`` at all (False: single process).
    auto: let JAX detect coordinator, process count and id from the environment; otherwise
    coordinator_address ("host:port"), num_processes and process_id are required.
    local_device_ids: restrict this process to these local devices (None: all).
    cpu_collectives: CPU cross-process collectives ("gloo", "mpi", or "none" to leave JAX's
    default); ignored on GPU/TPU.
    initialization_timeout: seconds to wait for all processes.
    """

    enabled: bool = False
    coordinator_address: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    auto: bool = False
    local_device_ids: tuple[int, ...] | None = None
    cpu_collectives: CpuCollectives = "gloo"
    initialization_timeout: int = 300

    def __post_init__(self) -> None:
        loss_config.check_literal("cpu_collectives", self.cpu_collectives, CpuCollectives)
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


def initialize(cfg: DistributedConfig) -> bool:
    """Initialise JAX's multi-controller runtime per ``cfg``; returns True if it did.

    Call it first, before anything touches a JAX device. Does nothing (returns False) when
    ``cfg.enabled`` is False or the runtime is already initialised.
    """
    if not cfg.enabled or jax.distributed.is_initialized():
        return False
    if cfg.cpu_collectives != "none":
        jax.config.update("jax_cpu_collectives_implementation", cfg.cpu_collectives)
    kwargs = {"initialization_timeout": cfg.initialization_timeout}
    if cfg.local_device_ids is not None:
        kwargs["local_device_ids"] = list(cfg.local_device_ids)
    if not cfg.auto:
        kwargs.update(
            coordinator_address=cfg.coordinator_address,
            num_processes=cfg.num_processes,
            process_id=cfg.process_id,
        )
    jax.distributed.initialize(**kwargs)
    return True
