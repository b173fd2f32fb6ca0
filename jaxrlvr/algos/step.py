"""Driver-facing compilation of an algorithm record: shardings, donation and host-side checks.

``state_shardings(state, mesh)`` derives a ``NamedSharding`` for every array of a ``TrainState``
from the parameters' logical axes (``model.param_shardings``): the optimiser moments that mirror
the params get the params' sharding, and so do a separate PPO critic's backbone and its moments
(they carry the policy's logical axes); scalars (step, optax counts, rng) and the small PPO value
head are replicated. ``batch_shardings(batch, mesh)`` shards every batch array's leading axis over
('data', 'fsdp'). ``CompiledAlgorithm`` jits a record's ``prepare`` and ``update`` with those as
explicit in/out shardings and ``donate_argnums=0`` for the update (the old state's buffers are
reused), validates the rollouts on the host before the call (so a malformed batch never reaches
the compiler), and optionally raises on a non-finite step. It is the one compiled path: what
``jaxrlvr train`` runs, and what ``jaxrlvr bench update``, ``bench memory`` and the GPU check
time.

Multi-host: every process calls these with the same global mesh. Two ways to feed a batch:

- ``shard_batch``: every process holds the full global batch (the same rows everywhere, e.g. the
  driver's rollouts, which every process computes); each process places only its own devices'
  rows (``jax.make_array_from_callback``).
- ``shard_local_batch``: each process holds only its own rows (a per-host data pipeline, or
  per-host rollouts), the rows of the batch shards its devices hold
  (``jax.make_array_from_process_local_data``); ``process_batch_rows`` says which rows of a
  global batch those are. The global batch is never assembled on any host.
"""

import math
from typing import Any, Literal

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import loss_config
from jaxrlvr.algos import state as state_lib
from jaxrlvr.model import sharding

OnNonfinite = Literal["skip", "raise"]


class NonFiniteUpdateError(FloatingPointError):
    """A ``CompiledAlgorithm(on_nonfinite="raise")`` step whose loss or gradient was not finite."""


def state_shardings(state: state_lib.TrainState, mesh: Mesh) -> state_lib.TrainState:
    """A ``TrainState`` of ``NamedSharding`` with the same tree structure as ``state``.

    Every ``nnx.Variable`` leaf (params, and the optax moments that copy them) is sharded by its
    ``logical_axes``; every other array is replicated (``model.sharding.logical_shardings``).
    """
    return sharding.logical_shardings(state, mesh)


def shard_state(state: state_lib.TrainState, mesh: Mesh) -> state_lib.TrainState:
    """``state`` placed with ``state_shardings(state, mesh)``."""
    return jax.device_put(state, state_shardings(state, mesh))


def batch_shardings(batch: batch_lib.Batch, mesh: Mesh) -> batch_lib.Batch:
    """A ``Batch`` of shardings: each present field's leading (batch) axis over ('data', 'fsdp')."""
    return jax.tree.map(lambda x: sharding.batch_sharding(mesh, np.ndim(x)), batch)


def shard_batch(batch: batch_lib.Batch, mesh: Mesh) -> batch_lib.Batch:
    """Global arrays for a batch that every process holds in full (NumPy or host arrays).

    Use it when every process has the same global batch; when each process has only its own
    rows, use ``shard_local_batch``.
    """

    def put(x, s):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, s, lambda idx: x[idx])

    return jax.tree.map(put, batch, batch_shardings(batch, mesh))


def _batch_shard_layout(mesh: Mesh) -> tuple[int, list[int]]:
    """(number of batch shards over ('data', 'fsdp'), the sorted shard indices that this
    process's devices hold). Processes holding replicas of a shard (a batch axis not split over
    processes) list the same indices."""
    n = math.prod(mesh.shape[a] for a in sharding.BATCH_AXES)
    # On a global shape of n rows every shard is one row, and its start is the shard's index.
    held = sharding.batch_sharding(mesh, 1).addressable_devices_indices_map((n,))
    return n, sorted({idx[0].start or 0 for idx in held.values()})


def batch_shard_count(mesh: Mesh) -> int:
    """How many shards a batch's rows are split into: the product of the ('data', 'fsdp') sizes."""
    return math.prod(mesh.shape.get(a, 1) for a in sharding.BATCH_AXES)


def check_microbatch_split(rows: int, num_microbatches: int, mesh: Mesh) -> None:
    """Raise ``batch.BatchError`` unless ``rows`` cut into ``num_microbatches`` microbatches
    whose rows split evenly over the batch shards ('data', 'fsdp'); otherwise a microbatch of
    fewer rows than devices (or a remainder) makes XLA replicate it ("Involuntary full
    rematerialization") instead of sharding it."""
    shards = batch_shard_count(mesh)
    if rows % (num_microbatches * shards):
        axes = ", ".join(
            f"{a}={mesh.shape.get(a, 1)}"
            for a in sharding.BATCH_AXES
            if a != "expert" or mesh.shape.get(a, 1) > 1
        )
        raise batch_lib.BatchError(
            f"a batch of {rows} rows in {num_microbatches} microbatches does not split over the "
            f"{shards} batch shards ({axes}): rows must be a multiple of microbatches x "
            f"{shards} = {num_microbatches * shards}"
        )


def process_batch_rows(mesh: Mesh, global_batch_size: int) -> np.ndarray:
    """The rows of a ``global_batch_size``-row batch that this process feeds to
    ``shard_local_batch``, in order (int64 [B_local]): global rows ``rows[i]`` sit at local row
    ``i``. With one process, all rows in order."""
    n, held = _batch_shard_layout(mesh)
    if global_batch_size % n:
        raise batch_lib.BatchError(
            f"process_batch_rows: global batch size {global_batch_size} is not divisible by "
            f"the {n} batch shards over ('data', 'fsdp')"
        )
    per = global_batch_size // n
    return np.concatenate([np.arange(i * per, (i + 1) * per) for i in held])


def process_row_block(mesh: Mesh) -> tuple[int, int]:
    """(block, blocks): the rows of a batch that this process's devices hold (over ('data',
    'fsdp')) are block ``block`` of ``blocks`` equal, contiguous blocks of the global rows, in
    order. Processes whose devices hold the same shards (a batch axis not split over processes)
    get the same block. With one process, (0, 1).

    The driver gives each block its own prompts: block b's rollouts are global rows
    [b * B / blocks, (b + 1) * B / blocks).

    Raises:
      batch.BatchError: this process's batch shards are not one contiguous, aligned run (a mesh
        whose device order interleaves processes on the batch axes).
    """
    n, held = _batch_shard_layout(mesh)
    k = len(held)
    if held != list(range(held[0], held[0] + k)) or n % k or held[0] % k:
        raise batch_lib.BatchError(
            f"process {jax.process_index()} holds batch shards {held} of {n}: not one contiguous "
            "block; build the mesh over jax.devices() in process order (model.make_mesh)"
        )
    return held[0] // k, n // k


def pad_rows(local_batch: batch_lib.Batch, rows: int, length: int) -> batch_lib.Batch:
    """``local_batch`` (NumPy) padded with rows and trailing positions that hold nothing (zero
    ids, attention, loss mask and values; each field's ``batch.Field.fill``: -1 in expert ids, the
    "no recorded route" of MoE routes) to ``rows`` x ``length``: every process's share of a
    global batch must have the same shape."""

    def pad(x, fill=0):
        x = np.asarray(x)
        widths = [(0, rows - x.shape[0])] + [(0, 0)] * (x.ndim - 1)
        if x.ndim >= 2:
            widths[1] = (0, length - x.shape[1])
        return np.pad(x, widths, constant_values=fill) if any(w[1] for w in widths) else x

    fields = local_batch.as_dict().items()
    return batch_lib.Batch(**{n: pad(x, fill=batch_lib.get_field(n).fill) for n, x in fields})


def agree_local_shapes(local_batch: batch_lib.Batch) -> batch_lib.Batch:
    """Every process's share padded (``pad_rows``) to the largest rows x positions over the
    processes (one small collective); one process: unchanged. Padding rows and positions carry
    no attention and no loss, so the update is that of the unpadded rows."""
    if jax.process_count() == 1:
        return local_batch
    from jax.experimental import multihost_utils

    ids = np.asarray(local_batch.input_ids)
    shape = np.asarray([ids.shape[0], ids.shape[1] if ids.ndim > 1 else 0], np.int64)
    rows, length = np.asarray(multihost_utils.process_allgather(shape)).max(axis=0)
    return pad_rows(local_batch, int(rows), int(length))


def shard_local_batch(local_batch: batch_lib.Batch, mesh: Mesh) -> batch_lib.Batch:
    """Global arrays from the rows that this process holds (NumPy or host arrays).

    Multi-host input without a global batch on any host: process p passes the rows of the batch
    shards its own devices hold (rows split over ('data', 'fsdp') as ``batch_shardings``), in
    global order. With P processes that split the batch axis evenly, each passes B / P rows and
    the global batch is their concatenation in the mesh's process order (``process_batch_rows``
    gives the exact global row indices); processes whose devices hold the same shards (a batch
    axis not split over processes) must pass identical rows. Built with
    ``jax.make_array_from_process_local_data``. With one process this equals
    ``shard_batch(local_batch, mesh)``.

    Raises:
      batch.BatchError: the fields' row counts differ, or the local row count is not a multiple
        of the number of batch shards this process holds.
    """
    n, held = _batch_shard_layout(mesh)
    rows = {name: np.shape(x)[0] for name, x in local_batch.as_dict().items()}
    if len(set(rows.values())) > 1:
        raise batch_lib.BatchError(f"shard_local_batch: fields have different row counts {rows}")
    local_rows = next(iter(rows.values()))
    if local_rows % len(held):
        raise batch_lib.BatchError(
            f"shard_local_batch: {local_rows} local rows do not split evenly over the "
            f"{len(held)} of {n} batch shards over ('data', 'fsdp') that process "
            f"{jax.process_index()} holds; pass a multiple of {len(held)} rows"
        )
    global_rows = local_rows // len(held) * n

    def put(x, s):
        x = np.asarray(x)
        return jax.make_array_from_process_local_data(s, x, (global_rows, *x.shape[1:]))

    return jax.tree.map(put, local_batch, batch_shardings(local_batch, mesh))


def state_step(state: state_lib.TrainState) -> int:
    """The (replicated) step counter as a Python int."""
    return int(jax.device_get(state.step))


class CompiledAlgorithm:
    """An ``algorithm.Algorithm`` compiled for a mesh: what the driver calls every step.

    ``prepare(state, rollouts)`` takes the host batch of the rollout fields (NumPy; with
    ``local_rows``, the default in a multi-process job, only this process's rows: its block of
    ``process_row_block``, padded to the processes' common shape), validates it
    once against ``algorithm.rollout_spec`` (a ``batch.BatchError`` naming the field, before any
    tracing) and ``check_microbatch_split`` (every microbatch's rows divide over the mesh),
    places it on the mesh (the one host-to-device transfer of the step) and runs the
    jitted prepare; ``update(state, batch)`` runs the jitted, donated update on the prepared
    device batch (validated at trace time by the update itself, so not again on the host): the
    whole step, every epoch of it (the record owns its epochs), so a driver calls it once per
    step.
    Both compile once per batch shape (length bucket); their metrics stay on device until the
    driver fetches them together.
    """

    def __init__(
        self,
        algorithm: algorithm_lib.Algorithm,
        mesh: Mesh,
        state_shardings: state_lib.TrainState,
        *,
        on_nonfinite: OnNonfinite = "skip",
        local_rows: bool | None = None,
    ):
        loss_config.check_literal("on_nonfinite", on_nonfinite, OnNonfinite)
        self.algorithm = algorithm
        self.mesh = mesh
        # Multi-process: each process passes only its own rows (``process_row_block``).
        self.local_rows = jax.process_count() > 1 if local_rows is None else local_rows
        self.state_shardings = state_shardings
        self.on_nonfinite = on_nonfinite
        replicated = NamedSharding(mesh, PartitionSpec())
        # One sharding for every field of a batch (a prefix of each field's rank): rows over
        # ('data', 'fsdp'), the rest whole, as ``batch_shardings``.
        rows = sharding.batch_sharding(mesh, 1)
        self._prepare = jax.jit(
            algorithm.prepare,
            in_shardings=(state_shardings, rows),
            out_shardings=(rows, replicated),
        )
        self._update = jax.jit(
            algorithm.update,
            in_shardings=(state_shardings, rows),
            out_shardings=(state_shardings, replicated),
            donate_argnums=0,
        )

    def prepare(self, state: state_lib.TrainState, rollouts: batch_lib.Batch):
        return self._prepare(state, self._place(rollouts))

    def _place(self, rollouts: batch_lib.Batch) -> batch_lib.Batch:
        """The host ``rollouts`` validated and placed on the mesh, as ``_prepare`` takes them."""
        batch_lib.validate_batch(rollouts, self.algorithm.rollout_spec)
        rows = np.shape(rollouts.input_ids)[0]
        if self.local_rows:
            rollouts = agree_local_shapes(rollouts)
            rows = np.shape(rollouts.input_ids)[0] * process_row_block(self.mesh)[1]
        check_microbatch_split(rows, self.algorithm.rollout_spec.num_microbatches, self.mesh)
        if self.local_rows:
            return shard_local_batch(rollouts, self.mesh)
        return shard_batch(rollouts, self.mesh)

    def lower_step(self, state: Any, rollouts: batch_lib.Batch) -> list[jax.stages.Lowered]:
        """``prepare`` and ``update`` lowered, not run, for ``state`` (its arrays, or their
        ``jax.ShapeDtypeStruct`` shapes with the state's shardings) and the host ``rollouts``
        (validated and placed as ``prepare`` places them): compiled, they are the programs a
        step of the same shapes runs (jit keeps what it compiles), so a step's programs can
        compile ahead of it (``phases.rl.RLPhase.programs_ahead``)."""
        placed = self._place(rollouts)
        prepare = self._prepare.lower(state, placed)
        batch, _ = jax.eval_shape(self._prepare, state, placed)  # weak types kept
        return [prepare, self._update.lower(state, batch)]

    def lower_update(self, state: Any, batch: Any) -> jax.stages.Lowered:
        """The compiled update's program lowered for ``state`` and ``batch`` (arrays or their
        ``jax.ShapeDtypeStruct`` shapes): ``.compile().memory_analysis()`` gives its memory
        without running it (``jaxrlvr bench memory``)."""
        return self._update.lower(state, batch)

    def update(self, state: state_lib.TrainState, batch: batch_lib.Batch):
        new_state, metrics = self._update(state, batch)
        if self.on_nonfinite == "raise" and float(metrics["nonfinite"]) > 0:
            raise NonFiniteUpdateError(
                f"non-finite loss or gradient at step {int(state_step(new_state))}: "
                f"loss={float(metrics['loss'])}, grad_norm={float(metrics['grad_norm'])}"
            )
        return new_state, metrics
