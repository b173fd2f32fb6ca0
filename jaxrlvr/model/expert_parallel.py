"""Expert parallelism: each MoE layer's experts split over the ``expert`` mesh axis, tokens moved.

On a mesh with ``expert`` > 1 every device holds E / expert of a layer's experts (the logical
axis ``expert`` goes on the mesh axis ``expert``, ``model.sharding``) and its own rows of the
batch (``batch`` is split over ``expert`` too). The decoder's MoE block (``decoder._moe_mlp``)
routes a device's own tokens as before (router, float32 softmax, top-k or routing replay's forced
ids: ``moe.select_experts``), then ``routed_experts`` sends each (token, expert) slot to the
device that holds the expert and brings the outputs back. Dropless: every slot reaches its
expert, whatever the load, so the trainer computes the function the sampler computes. The
routing, the gate weights and the combine (``sum_j w[n, j] * expert_j(x[n])``) are the same for
both dispatches; the experts are never gathered whole, only each device's E / expert of them
(over ``fsdp``, as any fsdp-sharded weight).

Two dispatches, by the kernel (``dispatch_for``; ``moe_impl`` is chosen by platform, so this is
too):

- ``"ring"`` (XLA:CPU and GPU, any kernel but ``ragged_dot``): MaxText's ring of experts. The rows
  of the ``expert`` group are all-gathered (ep x n rows), each device runs its local experts on
  every gathered row, weighted by the gate weights of the slots routed to them (zero elsewhere:
  ``moe.dense_experts`` on the local experts), and ``psum_scatter`` sums the ep partial outputs
  and gives each device its own rows back. Static shapes, no capacity: dropless by
  construction. Its work is E_local x ep x n = E x n expert-rows per device (E / (ep x k) times
  the routed slots; 2x at Qwen3-30B-A3B with ep=8), its buffers ep x n x D tokens and, since
  the local experts take one source device's block of rows at a time, E_local x n x F
  activations. Measured against the alternatives that compile on the CPU,
  see docs/moe.md ("Expert parallelism").
- ``"ragged"`` (TPU, or ``moe_impl: ragged_dot`` asked for on a GPU):
  ``jax.lax.ragged_all_to_all``. Slots sorted by expert go to their experts' devices (sizes
  exchanged with an all-gather of the per-expert counts), each device runs
  ``moe.grouped_experts`` on the rows it received, and a second ragged all-to-all brings them
  back. The receive buffer is the worst case, ep x n x k rows (every slot of the group to one
  device), as MaxText's default. On one H200 (a one-device expert axis, so the exchange moves
  nothing) it took 397 ms for the 30B-A3B block's forward + backward, where ``ragged_dot``
  alone took 195 ms and ``sorted_blocks`` 21 ms (docs/gpu/README.md): not the GPU's default.
  XLA:CPU cannot compile ``ragged-all-to-all`` (jax-ml/jax#34755); ``jax.export`` lowers it
  for TPU and CUDA.

Tokens not split over ``expert`` (a batch the expert axis does not divide, e.g. one decode row)
take SkyRL-tx's replicate-mask-psum: the local experts on the device's (replicated) rows,
summed over the group with ``psum``.

Left out: capacity factors and token dropping (never), overlapping the dispatch with compute,
expert parallelism on the sampler's own sub-mesh (``sampler.jax_devices``).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from jaxrlvr.model import moe

AXIS = "expert"
Dispatch = Literal["ring", "ragged"]


def axis_size(mesh) -> int:
    """The size of the ``expert`` mesh axis (1 without a mesh or without the axis)."""
    return 1 if mesh is None else int(mesh.shape.get(AXIS, 1))


def dispatch_for(impl) -> Dispatch:
    """``"ragged"`` when the grouped kernel is ``ragged_dot`` (TPU, or asked for), else
    ``"ring"``: the dispatch follows ``moe.resolve_impl`` so one setting picks both."""
    return "ragged" if moe.resolve_impl(impl) == "ragged_dot" else "ring"


def check(model_cfg, mesh_expert: int, backend: str | None = None) -> None:
    """One-line ``ValueError`` unless a run can split ``model_cfg``'s experts over
    ``mesh_expert`` devices: a MoE model whose ``num_experts`` the axis divides, and a kernel
    whose dispatch compiles on ``backend`` (default: JAX's)."""
    if mesh_expert <= 1:
        return
    if not model_cfg.is_moe:
        raise ValueError(
            f"mesh.expert={mesh_expert}: expert parallelism needs a MoE model "
            f"(model_type qwen3_moe), got {model_cfg.model_type}"
        )
    if model_cfg.num_experts % mesh_expert:
        raise ValueError(
            f"mesh.expert={mesh_expert} does not divide num_experts={model_cfg.num_experts}"
        )
    backend = backend or jax.default_backend()
    if backend == "cpu" and dispatch_for(model_cfg.moe_impl) == "ragged":
        raise ValueError(
            f"mesh.expert={mesh_expert} with model.moe_impl={model_cfg.moe_impl}: its "
            "ragged_all_to_all dispatch does not compile on XLA:CPU (jax-ml/jax#34755); use "
            "moe_impl auto, block_loop or sorted_blocks (the ring dispatch)"
        )


def kernel_specs(mesh) -> tuple[PartitionSpec, ...]:
    """``shard_map`` in_specs of (router [D, E], gate / up [E, D, F], down [E, F, D]): the
    router whole, each device's E / expert experts whole (gathered over ``fsdp`` and
    ``tensor`` only)."""
    experts = PartitionSpec(AXIS) if axis_size(mesh) > 1 else PartitionSpec()
    return (PartitionSpec(), experts, experts, experts)


def routed_experts(
    x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd, *, impl, mesh, split: bool, valid_n=None
) -> jax.Array:
    """Dropless routed SwiGLU of the device's rows, sum_j w[n, j] * expert_{ids[n, j]}(x[n])
    -> [n, D], inside ``jax.shard_map`` over ``mesh``.

    x [n, D] (this device's rows), ids / weights [n, k] (global expert ids, gate weights in the
    compute dtype), and this device's E_local = E / expert experts' kernels. Without an expert
    axis: ``moe.grouped_experts`` on the device's own rows. ``split``: whether the rows
    are split over the ``expert`` axis (else replicated over it: replicate-mask-psum).
    ``valid_n`` [n] bool: the rows that hold tokens (``moe.grouped_experts``); the others give
    0 (with an expert axis they still travel and run: their gate weights are zeroed)."""
    ep = axis_size(mesh)
    if ep == 1:
        return moe.grouped_experts(
            x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd, impl=impl, valid_n=valid_n
        )
    if valid_n is not None:
        weights_nk = jnp.where(valid_n[:, None], weights_nk, jnp.zeros_like(weights_nk))
    if not split:
        y = _local_experts(x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd)
        return jax.lax.psum(y, AXIS)
    if dispatch_for(impl) == "ragged":
        return ragged_dispatch(x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd, ep=ep)
    return _ring(x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd)


def _local_experts(x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd) -> jax.Array:
    """This device's experts on every row of x, each slot weighted by its gate weight when it
    was routed to one of them (zero otherwise) -> [N, D], the device's partial output."""
    e_local = gate_edf.shape[0]
    lo = jax.lax.axis_index(AXIS) * e_local
    here = (ids_nk >= lo) & (ids_nk < lo + e_local)
    ids = jnp.where(here, ids_nk - lo, 0)
    weights = jnp.where(here, weights_nk, jnp.zeros_like(weights_nk))
    return moe.dense_experts(x_nd, ids, weights, gate_edf, up_edf, down_efd)


def _ring(x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd) -> jax.Array:
    """Ring of experts: all-gather the group's rows, local experts, reduce-scatter.

    The local experts run on one source device's n rows at a time (``lax.map`` over the ep
    blocks of the gather, each block rematerialised in the backward), so the dense
    [E_local, n, F] activations and [E_local, n, D] per-expert outputs live for one block, not
    for all ep x n rows: ep times less of the layer's largest temporaries, the same sums."""
    gather = lambda a: jax.lax.all_gather(a, AXIS)  # [ep, n, ...]  # noqa: E731

    @jax.checkpoint
    def block(args):
        x, ids, weights = args
        return _local_experts(x, ids, weights, gate_edf, up_edf, down_efd)

    y = jax.lax.map(block, (gather(x_nd), gather(ids_nk), gather(weights_nk)))  # [ep, n, D]
    return jax.lax.psum_scatter(y, AXIS, scatter_dimension=0, tiled=False)


def ragged_dispatch(x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd, *, ep) -> jax.Array:
    """Ragged all-to-all dispatch and combine (module docstring)."""
    n, d = x_nd.shape
    k = ids_nk.shape[1]
    e_local = gate_edf.shape[0]
    s = n * k
    me = jax.lax.axis_index(AXIS)
    flat = ids_nk.reshape(s)
    order = jnp.argsort(flat, stable=True)  # slots by expert, hence by destination device
    rows = x_nd[order // k]
    counts = jnp.bincount(flat, length=e_local * ep).astype(jnp.int32)  # [E]
    # sizes[i, j]: slots device i sends to device j; mine[i, e]: slots of my expert e from i.
    all_counts = jax.lax.all_gather(counts, AXIS).reshape(ep, ep, e_local)
    sizes = jnp.sum(all_counts, axis=-1)
    mine = jax.lax.dynamic_index_in_dim(all_counts, me, axis=1, keepdims=False)
    send, recv = sizes[me], sizes[:, me]
    send_off = jnp.cumsum(send) - send  # where each destination's slots start in ``rows``
    recv_off = jnp.cumsum(recv) - recv  # where each source's slots start in my buffer
    # Where my slots land in each receiver's buffer: after those of the lower sources.
    land = (jnp.cumsum(sizes, axis=0) - sizes)[me]
    buf = jnp.zeros((ep * s, d), rows.dtype)
    got = jax.lax.ragged_all_to_all(rows, buf, send_off, send, land, recv, axis_name=AXIS)
    # Each received row's local expert: buffer segments are (source, expert) in that order.
    ends = jnp.cumsum(mine.reshape(-1))
    pos = jnp.arange(ep * s, dtype=jnp.int32)
    seg = jnp.searchsorted(ends, pos, side="right")
    valid = pos < ends[-1]
    # Rows past the received ones get expert id E_local: out of every group (``bincount``
    # drops it, ``ragged_dot`` computes only the groups' rows), masked to zero below.
    local = jnp.where(valid, seg % e_local, e_local).astype(jnp.int32)
    ones = valid.astype(rows.dtype)[:, None]
    out = moe.grouped_experts(
        got, local[:, None], ones, gate_edf, up_edf, down_efd, impl="ragged_dot"
    )
    out = jnp.where(valid[:, None], out, jnp.zeros_like(out))
    # Back to the senders: my segment for source i goes where i's slots for me started.
    back_land = (jnp.cumsum(sizes, axis=1) - sizes)[:, me]
    back = jax.lax.ragged_all_to_all(
        out, jnp.zeros_like(rows), recv_off, recv, back_land, send, axis_name=AXIS
    )
    back = back * weights_nk.reshape(s)[order][:, None].astype(back.dtype)
    unsorted = jnp.zeros((s, d), back.dtype).at[order].set(back)
    return jnp.sum(unsorted.reshape(n, k, d), axis=1)
