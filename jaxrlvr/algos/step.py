"""Driver-facing compilation of an update: shardings, donation and host-side checks.

``state_shardings(state, mesh)`` derives a ``NamedSharding`` for every array of a ``TrainState``
from the parameters' logical axes (``model.param_shardings``): the optimiser moments that mirror
the params get the params' sharding, scalars (step, optax counts, rng) and the small PPO value
head are replicated. ``batch_shardings(batch, mesh)`` shards every batch array's leading axis over
('data', 'fsdp'). ``jit_update`` compiles ``update`` with those as explicit in/out shardings and
``donate_argnums=0`` (the old state's buffers are reused), validates each batch on the host
before the call (so a malformed batch never reaches the compiler), and optionally raises on a
non-finite step.

Multi-host: every process calls these with the same global mesh; ``shard_batch`` builds global
arrays from the batch each process holds in full (``jax.make_array_from_callback``: a process
only touches its own devices' rows).
"""

from collections.abc import Callable
from typing import Any, Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import loss_config
from jaxrlvr.algos import state as state_lib
from jaxrlvr.model import sharding

OnNonfinite = Literal["skip", "raise"]


class NonFiniteUpdateError(FloatingPointError):
    """A ``jit_update(on_nonfinite="raise")`` step whose loss or gradient was not finite."""


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def state_shardings(state: state_lib.TrainState, mesh: Mesh) -> state_lib.TrainState:
    """A ``TrainState`` of ``NamedSharding`` with the same tree structure as ``state``.

    Every ``nnx.Variable`` leaf (params, and the optax moments that copy them) is sharded by its
    ``logical_axes``; every other array is replicated.
    """
    replicated = NamedSharding(mesh, PartitionSpec())

    def leaf(x):
        if _is_variable(x):
            axes = x.get_metadata().get("logical_axes")
            spec = (
                PartitionSpec()
                if axes is None
                else sharding.logical_to_pspec(axes, x.get_value().shape, mesh)
            )
            return x.replace(NamedSharding(mesh, spec))
        return replicated

    return jax.tree.map(leaf, state, is_leaf=_is_variable)


def shard_state(state: state_lib.TrainState, mesh: Mesh) -> state_lib.TrainState:
    """``state`` placed with ``state_shardings(state, mesh)``."""
    return jax.device_put(state, state_shardings(state, mesh))


def batch_shardings(batch: batch_lib.Batch, mesh: Mesh) -> batch_lib.Batch:
    """A ``Batch`` of shardings: each present field's leading (batch) axis over ('data', 'fsdp')."""
    return jax.tree.map(lambda x: sharding.batch_sharding(mesh, np.ndim(x)), batch)


def shard_batch(batch: batch_lib.Batch, mesh: Mesh) -> batch_lib.Batch:
    """Global arrays for a batch that every process holds in full (NumPy or host arrays)."""

    def put(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(put, batch, batch_shardings(batch, mesh))


def jit_update(
    update: Callable,
    state_shardings: state_lib.TrainState,
    batch_shardings: batch_lib.Batch,
    *,
    on_nonfinite: OnNonfinite = "skip",
) -> Callable:
    """Compile ``update`` with explicit shardings and ``donate_argnums=0``.

    Returns ``step(state, batch) -> (state, metrics)``: validates ``batch`` against
    ``update.batch_spec`` on the host (raising ``batch.BatchError`` before any tracing), then calls
    the compiled update. Metrics come back replicated. With ``on_nonfinite="raise"`` the step
    reads ``metrics["nonfinite"]`` (one device-to-host sync) and raises ``NonFiniteUpdateError``;
    the returned state would have been the unchanged input state.
    """
    loss_config.check_literal("on_nonfinite", on_nonfinite, OnNonfinite)
    spec = getattr(update, "batch_spec", None)
    mesh = jax.tree.leaves(state_shardings)[0].mesh
    replicated = NamedSharding(mesh, PartitionSpec())
    compiled = jax.jit(
        update,
        in_shardings=(state_shardings, batch_shardings),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )

    def step(state: state_lib.TrainState, batch: batch_lib.Batch):
        if spec is not None:
            batch_lib.validate_batch(batch, spec)
        new_state, metrics = compiled(state, batch)
        if on_nonfinite == "raise" and float(metrics["nonfinite"]) > 0:
            raise NonFiniteUpdateError(
                f"non-finite loss or gradient at step {int(state_step(new_state))}: "
                f"loss={float(metrics['loss'])}, grad_norm={float(metrics['grad_norm'])}"
            )
        return new_state, metrics

    step.compiled = compiled
    step.batch_spec = spec
    return step


def state_step(state: state_lib.TrainState) -> int:
    """The (replicated) step counter as a Python int."""
    return int(jax.device_get(state.step))
