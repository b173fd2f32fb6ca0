"""The routed expert block of Qwen3-MoE: router, dropless grouped dispatch, router statistics.

Router (transformers' ``Qwen3MoeTopKRouter``): logits = h W_r, a float32 softmax over all E
experts, the top k (``jax.lax.top_k``), renormalised to sum to 1 when ``norm_topk_prob``; the
gate weights are cast to the compute dtype. Every token reaches its k experts: no capacity
factor, no dropped tokens, so the trainer computes the function the sampler (vLLM) computes.

Dispatch (``grouped_experts``): every token's k (token, expert) slots run through their
experts' SwiGLU and are summed, scaled by the gate weights. Four kernels, chosen by ``impl``:

- ``"block_loop"`` (CPU): the N x k slots sorted by expert (stable: ties keep token order),
  each expert's rows padded to a multiple of a block of b rows (every block belongs to one
  expert), then a loop over the blocks that hold rows, each block through its expert's
  kernels as they are (gate and up as one [D, 2F] matmul, then down): plain 2-D matmuls, no
  weight copies, the all-padding blocks skipped. Its backward is a second loop (custom VJP),
  summing each expert's kernel gradients in float32. The rows move between token order and
  the padded order by gathers only (``_take_rows``: the backward of each gather is the other
  gather), so neither pass runs a scatter-add.
- ``"sorted_blocks"`` (GPU): the same padded layout, one batched matmul running all blocks
  against their experts' weights gathered per block (the weight copies grow with N x k / b).
- ``"dense"`` (CPU, small shapes): every expert on every token as two wide matmuls, the
  activations weighted by the one-hot combine matrix: E / k times the routed work, but no sort,
  gather or scatter (tunix's CPU path).
- ``"ragged_dot"`` (TPU): ``jax.lax.ragged_dot`` on the sorted rows, meant to lower to grouped
  GEMMs without padding and without gathering weights per block. XLA:CPU lowers it densely
  (every group against every row): never the CPU's choice. On the GPU it was measured slower
  than both other kernels (below).

``"auto"`` takes ``ragged_dot`` on TPU and ``sorted_blocks`` on GPU: on one H200 with JAX
0.11.2 (``scripts/gpu_check.sh --parts moe``, docs/gpu/README.md), Qwen3-30B-A3B's expert
block on 4,096 tokens (bf16, forward / forward + backward) took 58.4 / 195 ms with
``ragged_dot``, 3.5 / 20.7 ms with ``sorted_blocks`` and 7.5 / 22.5 ms with ``dense``; the
GRPO update of a 4-layer cut of the model (8 x 1,024 tokens, 4 microbatches) 2.24 s and 101.8
GiB peak with ``ragged_dot`` against 0.47 s and 61.9 GiB with ``sorted_blocks``, the forward
0.486 against 0.060 s (``block_loop`` was not measured on a GPU: a loop of small matmuls is
the wrong shape of work there). On the CPU ``dense`` when E <= 2k and N <= 256 tokens
(``DENSE_MAX_TOKENS``), else ``block_loop``. At the MoE demo's shapes (E=8 top-2, D=128,
F=192, float32, forward + backward of one block, 2-core CPU, 2026-12-07; docs/moe.md)
``block_loop`` against ``sorted_blocks``: 26-32 against 50-58 ms at 2,016 tokens (the GRPO
update), 18-20 against 23-25 at 1,280 (an SFT step), forward 2.4-3.0 against 3.3-3.8 at 256
(a decode step); XLA:CPU runs a small batched matmul slower than the same rows as 2-D
matmuls, and the per-block weight copies cost as much as a third of ``sorted_blocks``'
forward. The ``dense`` crossover was measured against ``sorted_blocks`` (2026-12-03, busy
machine, CPU seconds): at E=8 top-2 the blocks win at every N measured; at E=4 top-2 the dense
kernel wins at N=256 (10.1 / 11.2 ms) and loses at 2,016 (111 / 49); at E=16 top-4 (D=512
F=352) it wins at 256 (225 / 281) and loses at 1,024 (1150 / 555); at E=64 top-8 it loses at
256 already (1075 / 705). ``dense_experts`` (the one-hot reference in its plainest form) is
what the tests compare against.

Expert parallelism: expert weights are stacked ``[E, ...]`` with the logical axis ``expert``,
which ``sharding.LOGICAL_RULES`` maps onto the ``expert`` mesh axis (then ``fsdp``). With
``mesh.expert`` = 1, each batch shard routes and sorts only its own tokens (``decoder._moe_mlp``:
``jax.shard_map`` over the batch axes, the kernels gathered whole as fsdp gathers any layer's
weights). With ``mesh.expert`` > 1 the tokens travel to the experts' devices instead and the
kernels are never gathered: ``expert_parallel`` (a ring of experts on the CPU and the GPU,
``ragged_all_to_all`` with ``ragged_dot``: the TPU's choice), sharing this module's routing,
gate weights and combine.

Padding (``grouped_experts(valid_n=...)``): the decoder passes the attention mask, so padding
positions (a packed row's tail, a left-padded prompt's head) and, in the JAX sampler's decode,
the rows that have finished give 0 and run no expert: in the block kernels their slots form a
group after every expert's (sorted last), which ``block_loop``'s loop never reaches. Their
outputs feed no valid token (masked keys, masked loss), and the router still routes them: their
ids come back for routing replay, and the statistics count the valid tokens only, as before.
Transformers and vLLM run the experts on padding too. At the MoE demo's GRPO update (30 %
padding) one block's forward + backward went from 29.7 to 25.8 ms, an SFT batch's (16 %) from
23.8 to 18.5, a decode step's with half its rows finished from 8.5 to 6.4 (docs/moe.md).

Routing replay (issue 40): ``select_experts`` accepts forced expert ids (a token whose row
holds a -1 uses its live top-k); the gate weights are always gathered from the live float32
softmax at the chosen experts (never from post-top-k zeroed probabilities), so the router keeps
its gradient. The chosen ids of every layer come back in ``RouterOutput.expert_ids``.

Router statistics (``RouterOutput``): per layer, the masked count of top-k assignments per
expert and the masked sum of router probabilities per expert; from them
``load_balancing_loss`` (transformers' ``load_balancing_loss_func``, Switch Transformer eqs.
4-6 with Mixtral's top-k counts) and ``router_metrics``.

Router signals in updates (``collect_routers``): the update engine collects the router outputs of
every MoE forward inside a microbatch's loss and adds the optional auxiliary loss
(``ModelConfig.router_aux_loss``, off by default as RL stacks run it: slime, verl) and the router
metrics every step (``add_router_terms``).

Left out: a shared expert (Qwen2-MoE), capacity factors and token dropping, LoRA on experts or
the router (both stay frozen under LoRA; adapters go on attention and dense MLPs).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrlvr.model import bits
from jaxrlvr.model.config import MoEImpl


@struct.dataclass
class RouterOutput:
    """What the router of every MoE layer saw, for losses, metrics and routing replay.

    expert_ids: [L, B, T, k] int32, the experts each token was sent to (forced ones under
      replay), in top-k order; every decoder layer, -1 on the dense layers of a mixed layout
      (``ModelConfig.sparse_layers``).
    counts: [M, E] float32, top-k assignments per expert over the valid tokens, for the M
      sparse layers.
    prob_sum: [M, E] float32, router probabilities summed per expert over the valid tokens.
    num_tokens: [] float32, the number of valid tokens (attention mask), per layer.
    layers: the decoder layer index of each of the M rows of ``counts`` (static; None: 0..M-1).
    """

    expert_ids: jax.Array
    counts: jax.Array
    prob_sum: jax.Array
    num_tokens: jax.Array
    layers: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)


def resolve_impl(impl: MoEImpl, num_tokens: int = 0, num_experts: int = 0, k: int = 1) -> str:
    """The kernel "auto" means here: by ``jax.default_backend()`` at trace time (TPU
    ``ragged_dot``, GPU ``sorted_blocks``), and on the CPU by shape (module docstring: ``dense``
    when E <= 2k and N <= 256, else ``block_loop``). A program lowered on one platform for
    another (``jax.export`` from a CPU host for TPU or CUDA) should set
    ``ModelConfig.moe_impl`` explicitly."""
    if impl == "auto":
        backend = jax.default_backend()
        if backend == "tpu":
            return "ragged_dot"
        if backend == "gpu":  # measured on an H200 (module docstring)
            return "sorted_blocks"
        small = num_experts <= 2 * k and num_tokens <= DENSE_MAX_TOKENS
        return "dense" if small else "block_loop"
    return impl


# ``auto`` on the CPU takes the dense kernel up to this many tokens when E <= 2k (measured
# crossover, module docstring).
DENSE_MAX_TOKENS = 256


def select_experts(
    probs_ne: jax.Array, k: int, norm_topk_prob: bool, forced_nk: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """(expert ids [N, k] int32, gate weights [N, k] float32) from float32 router probabilities.

    ``forced_nk`` [N, k] (routing replay): a row without -1 is used as the token's experts; a
    row with any -1 falls back to the live top-k. The weights are the live probabilities at the
    chosen experts (renormalised with ``norm_topk_prob``), so they carry the router's gradient.
    """
    _, ids = jax.lax.top_k(probs_ne, k)
    ids = ids.astype(jnp.int32)
    if forced_nk is not None:
        use = jnp.all(forced_nk >= 0, axis=-1, keepdims=True)
        ids = jnp.where(use, forced_nk.astype(jnp.int32), ids)
    weights = jnp.take_along_axis(probs_ne, ids, axis=-1)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids, weights


def _block_size(num_slots: int, num_experts: int, max_rows: int = 128) -> int:
    """Rows per block: the mean group size rounded up to a power of two, within [8, max_rows]
    (small for decode's few rows, large enough for fast matmuls otherwise)."""
    mean = -(-num_slots // num_experts)
    b = 8
    while b < mean and b < max_rows:
        b *= 2
    return b


# ``block_loop``'s largest block: at the MoE demo's update shape (2,016 tokens, 8 experts
# top-2, mean 504 rows per expert) blocks of 256 rows ran the block's forward + backward in
# 24-26 ms against 30 at 128 (docs/moe.md); more padding beyond that.
LOOP_MAX_BLOCK = 256


def _swiglu(x, gate, up):
    return jax.nn.silu(gate) * up


def grouped_experts(
    x_nd: jax.Array,
    ids_nk: jax.Array,
    weights_nk: jax.Array,
    gate_edf: jax.Array,
    up_edf: jax.Array,
    down_efd: jax.Array,
    *,
    impl: MoEImpl = "auto",
    valid_n: jax.Array | None = None,
) -> jax.Array:
    """Dropless routed SwiGLU: sum_j w[n, j] * expert_{ids[n, j]}(x[n]) -> [N, D].

    x [N, D] and the weights in the compute dtype (gate weights cast to it); experts' kernels
    gate / up [E, D, F], down [E, F, D]. Module docstring: the kernels of ``impl``.
    ``valid_n`` [N] bool (None: every row): the rows that hold tokens; the others (padding,
    finished decode rows) give 0, and ``block_loop`` runs no expert work for them.
    """
    n, d = x_nd.shape
    k = ids_nk.shape[1]
    e = gate_edf.shape[0]
    impl = resolve_impl(impl, n, e, k)
    if valid_n is not None:
        weights_nk = jnp.where(valid_n[:, None], weights_nk, jnp.zeros_like(weights_nk))
    if impl == "dense":
        return _dense_onehot(x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd)
    s = n * k
    flat, groups = ids_nk.reshape(s), e
    if valid_n is not None and impl in ("block_loop", "sorted_blocks"):
        # Padding rows' slots go to a group E past the experts: sorted last, never run.
        flat, groups = jnp.where(jnp.repeat(valid_n, k), flat, e), e + 1
    order = jnp.argsort(flat, stable=True)  # slot order sorted by expert
    group_sizes = jnp.bincount(flat, length=groups).astype(jnp.int32)
    if impl == "ragged_dot":
        rows = x_nd[order // k]  # [S, D]
        g = jax.lax.ragged_dot(rows, gate_edf, group_sizes)
        u = jax.lax.ragged_dot(rows, up_edf, group_sizes)
        out = jax.lax.ragged_dot(_swiglu(rows, g, u), down_efd, group_sizes)
        out = out * weights_nk.reshape(s)[order][:, None].astype(out.dtype)
        unsorted = jnp.zeros((s, d), out.dtype).at[order].set(out)
        return jnp.sum(unsorted.reshape(n, k, d), axis=1)
    if impl not in ("sorted_blocks", "block_loop"):
        raise ValueError(
            f"moe impl={impl!r}: expected auto, block_loop, sorted_blocks, dense or ragged_dot"
        )
    loop = impl == "block_loop"
    b = _block_size(s, e, max_rows=LOOP_MAX_BLOCK if loop else 128)
    layout = _padded_layout(flat, order, group_sizes, b, k, experts=e)
    xp = _take_rows(x_nd, layout.token, layout.pos_nk)  # [P, D]
    if loop:
        gate_up = jnp.concatenate([gate_edf, up_edf], axis=-1)
        xp, gate_up, down = _vary_alike(xp, gate_up, down_efd)
        out = _expert_loop(xp, gate_up, down, layout.block_e, layout.used, b)
    else:
        xb = xp.reshape(-1, b, d)
        g = jnp.einsum("nbd,ndf->nbf", xb, gate_edf[layout.block_e])
        u = jnp.einsum("nbd,ndf->nbf", xb, up_edf[layout.block_e])
        out = jnp.einsum("nbf,nfd->nbd", _swiglu(xb, g, u), down_efd[layout.block_e])
        out = out.reshape(-1, d)
    out_nkd = _take_rows(out, layout.pos_nk.reshape(s), layout.src[:, None]).reshape(n, k, d)
    return jnp.sum(out_nkd * weights_nk[:, :, None].astype(out.dtype), axis=1)


@struct.dataclass
class _Layout:
    """The padded expert order of ``sorted_blocks`` and ``block_loop``: the N x k slots sorted
    by expert, each expert's rows padded to whole blocks of b rows (P rows in all).

    pos_nk: [N, k] the padded row of each (token, slot); src: [P] the slot each padded row
    holds (N x k: padding); token: [P] its token (N: padding, read as a zero row); block_e:
    [P / b] each block's expert (E - 1 for the blocks past the last expert's group); used:
    [] the number of blocks that hold any expert's slot (they come first; the slots of
    padding tokens, a group after the experts', and the all-padding blocks come after)."""

    pos_nk: jax.Array
    src: jax.Array
    token: jax.Array
    block_e: jax.Array
    used: jax.Array


def _padded_layout(flat_s, order_s, group_sizes_e, b: int, k: int, experts: int) -> _Layout:
    """The layout of ``_Layout`` from the flat expert ids [N x k], their stable sort by expert
    and the group sizes (``experts``, or one more: the padding tokens' group, id
    ``experts``): int32 bookkeeping only, no float data moved."""
    s = flat_s.shape[0]
    e = group_sizes_e.shape[0]
    sorted_e = flat_s[order_s]
    padded = (group_sizes_e + b - 1) // b * b
    padded_end = jnp.cumsum(padded)
    start = jnp.cumsum(group_sizes_e) - group_sizes_e
    # Each sorted row's place in the padded layout (its expert's padded start + its rank).
    dest = (padded_end - padded)[sorted_e] + jnp.arange(s, dtype=jnp.int32) - start[sorted_e]
    num_blocks = -(-(s + e * (b - 1)) // b)
    p = num_blocks * b
    pos = jnp.zeros((s,), jnp.int32).at[order_s].set(dest)
    src = jnp.full((p,), s, jnp.int32).at[dest].set(order_s.astype(jnp.int32))
    # A block's expert: the first expert whose padded range ends after the block's start
    # (blocks past the last group are all padding; they read expert E-1 and are dropped).
    block_e = jnp.searchsorted(padded_end, jnp.arange(num_blocks) * b, side="right")
    return _Layout(
        pos_nk=pos.reshape(s // k, k),
        src=src,
        token=jnp.where(src < s, src // k, s // k),
        block_e=jnp.minimum(block_e, experts - 1).astype(jnp.int32),
        used=(padded_end[experts - 1] // b).astype(jnp.int32),
    )


def _zeros(shape, dtype, *refs: jax.Array) -> jax.Array:
    """Zeros of ``shape`` that vary over every manual mesh axis any of ``refs`` varies over
    (``zeros_like`` carries its example's): inside ``shard_map`` a loop's initial carry must
    match the axes its body's values vary over. XLA folds the sum of zeros away. Outside
    ``shard_map`` nothing varies: plain zeros (fewer ops to trace, the same program)."""
    if not any(_in_manual_mesh(r) for r in refs):
        return jnp.zeros(shape, dtype)
    return sum(jnp.zeros_like(r, dtype=dtype, shape=shape) for r in refs)


def _in_manual_mesh(x: jax.Array) -> bool:
    """Whether ``x`` is traced inside ``shard_map`` (its mesh has a manual axis)."""
    return jax.sharding.AxisType.Manual in jax.typeof(x).sharding.mesh.axis_types


def _vary_alike(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Each array made to vary over every manual mesh axis any of them varies over (adding
    zeros). Inside ``shard_map`` rows split over ``data`` meet replicated kernels: autodiff
    then sums the kernels' gradient over ``data`` (the transpose of this broadcast), where a
    custom VJP could not return a per-shard gradient for a replicated input."""
    if not any(_in_manual_mesh(a) for a in arrays):
        return arrays
    return tuple(a + _zeros(a.shape, a.dtype, *arrays) for a in arrays)


def _expert_loop_fwd_pass(x_pd, gate_up, down, block_e, used, b):
    """The blocks' SwiGLU one block at a time: (out [P, D], the gate|up activations [P, 2F])
    in the compute dtype, both kept as bits (``bits``) inside the loop."""
    dtype = x_pd.dtype
    f = gate_up.shape[-1] // 2
    x_store = bits.as_bits(x_pd)

    def body(i, carry):
        out, h_all = carry
        e = block_e[i]
        xb = bits.from_bits(jax.lax.dynamic_slice_in_dim(x_store, i * b, b), dtype)
        h = xb @ gate_up[e]  # [b, 2F]
        y = _swiglu(xb, h[:, :f], h[:, f:]) @ down[e]
        out = jax.lax.dynamic_update_slice_in_dim(out, bits.as_bits(y), i * b, 0)
        h_all = jax.lax.dynamic_update_slice_in_dim(h_all, bits.as_bits(h), i * b, 0)
        return out, h_all

    p, d = x_pd.shape
    zeros = lambda shape: _zeros(shape, dtype, x_pd, gate_up, down)  # noqa: E731
    init = (bits.as_bits(zeros((p, d))), bits.as_bits(zeros((p, 2 * f))))
    out, h_all = jax.lax.fori_loop(0, used, body, init)
    return bits.from_bits(out, dtype), h_all


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _expert_loop(x_pd, gate_up, down, block_e, used, b: int) -> jax.Array:
    """``block_loop``: block i of the padded rows x [P, D] through expert block_e[i]'s SwiGLU
    (gate|up [E, D, 2F], down [E, F, D]) -> [P, D], for the ``used`` blocks that hold rows
    (the rest stay zero), one block per loop step with the expert's kernels as they are.

    Against ``sorted_blocks``' batched matmul over per-block weight copies: no weight copies,
    and plain 2-D matmuls, which XLA:CPU runs faster than small batched ones; the padding
    blocks past the last group are skipped. The backward is a second loop (``while`` loops with
    a data-dependent count have no autodiff): per block the input rows' gradient and the
    expert's three kernels' gradients, accumulated in float32 per expert."""
    return _expert_loop_fwd_pass(x_pd, gate_up, down, block_e, used, b)[0]


def _expert_loop_fwd(x_pd, gate_up, down, block_e, used, b):
    out, h_all = _expert_loop_fwd_pass(x_pd, gate_up, down, block_e, used, b)
    return out, (x_pd, gate_up, down, block_e, used, h_all)


def _expert_loop_bwd(b, res, ct_pd):
    x_pd, gate_up, down, block_e, used, h_all = res
    dtype = x_pd.dtype
    f = gate_up.shape[-1] // 2
    x_store, ct_store = bits.as_bits(x_pd), bits.as_bits(ct_pd.astype(dtype))
    f32 = functools.partial(jnp.matmul, preferred_element_type=jnp.float32)

    def body(i, carry):
        dx, d_gate_up, d_down = carry
        e = block_e[i]
        rows = lambda a: bits.from_bits(jax.lax.dynamic_slice_in_dim(a, i * b, b), dtype)  # noqa: E731
        xb, h, dy = rows(x_store), rows(h_all), rows(ct_store)
        g, u = h[:, :f].astype(jnp.float32), h[:, f:].astype(jnp.float32)
        sig = jax.nn.sigmoid(g)
        silu = g * sig
        d_down = d_down.at[e].add(f32(_swiglu(xb, h[:, :f], h[:, f:]).T, dy))
        da = f32(dy, down[e].T)  # [b, F]
        dh = jnp.concatenate([da * u * sig * (1 + g * (1 - sig)), da * silu], axis=1)
        dh = dh.astype(dtype)
        dx = jax.lax.dynamic_update_slice_in_dim(dx, bits.as_bits(dh @ gate_up[e].T), i * b, 0)
        d_gate_up = d_gate_up.at[e].add(f32(xb.T, dh))
        return dx, d_gate_up, d_down

    zeros = lambda a, dt: _zeros(a.shape, dt, x_pd, gate_up, down, ct_pd)  # noqa: E731
    init = (
        bits.as_bits(zeros(x_pd, dtype)),
        zeros(gate_up, jnp.float32),
        zeros(down, jnp.float32),
    )
    dx, d_gate_up, d_down = jax.lax.fori_loop(0, used, body, init)
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731 (integer inputs)
    return (
        bits.from_bits(dx, dtype),
        d_gate_up.astype(gate_up.dtype),
        d_down.astype(down.dtype),
        zero(block_e),
        zero(used),
    )


_expert_loop.defvjp(_expert_loop_fwd, _expert_loop_bwd)


@jax.custom_vjp
def _take_rows(x_md: jax.Array, idx_r: jax.Array, inv_mc: jax.Array) -> jax.Array:
    """x[idx] [R, D] (an index >= M reads a zero row), whose cotangent is again a gather:
    dx[m] = sum_c ct[inv[m, c]] (an index >= R adds nothing), ``inv`` listing the rows that
    read row m. ``block_loop`` and ``sorted_blocks`` move rows between token order and the
    padded order with it both ways, so neither pass runs a scatter-add (XLA:CPU runs scatters
    one row at a time; this took ``sorted_blocks``' forward + backward from ~118 to ~95 ms CPU
    at the MoE demo's update shape)."""
    return jnp.take(x_md, idx_r, axis=0, mode="fill", fill_value=0)


def _take_rows_fwd(x_md, idx_r, inv_mc):
    return _take_rows(x_md, idx_r, inv_mc), (idx_r, inv_mc)


def _take_rows_bwd(res, ct_rd):
    idx_r, inv_mc = res
    dx = jnp.sum(jnp.take(ct_rd, inv_mc, axis=0, mode="fill", fill_value=0), axis=1)
    zero = lambda a: np.zeros(a.shape, jax.dtypes.float0)  # noqa: E731 (integer inputs)
    return dx, zero(idx_r), zero(inv_mc)


_take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def _dense_onehot(x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd) -> jax.Array:
    """``impl="dense"``: every expert on every token as two wide matmuls (gate/up [D, E*2F],
    down [E*F, D]), the activations weighted by the [N, E] combine matrix (the gate weights at
    the chosen experts, 0 elsewhere) before the down projection: E / k times the work of the
    routed rows, but no sort, gather or scatter (tunix runs this on the CPU)."""
    n, d = x_nd.shape
    e, _, f = gate_edf.shape
    onehot = jax.nn.one_hot(ids_nk, e, dtype=weights_nk.dtype)  # [N, k, E]
    combine = jnp.einsum("nke,nk->ne", onehot, weights_nk).astype(x_nd.dtype)
    gate_up = jnp.concatenate([gate_edf, up_edf], axis=-1).transpose(1, 0, 2)
    h = (x_nd @ gate_up.reshape(d, e * 2 * f)).reshape(n, e, 2 * f)
    act = _swiglu(x_nd, h[..., :f], h[..., f:]) * combine[:, :, None]
    return act.reshape(n, e * f) @ down_efd.reshape(e * f, d)


def dense_experts(x_nd, ids_nk, weights_nk, gate_edf, up_edf, down_efd) -> jax.Array:
    """The reference: every expert on every token, combined by a one-hot weight matrix [N, E].
    E times the work of one expert per token; for tests and the dispatch benchmark only."""
    n = x_nd.shape[0]
    e = gate_edf.shape[0]
    combine = jnp.zeros((n, e), weights_nk.dtype).at[jnp.arange(n)[:, None], ids_nk].add(weights_nk)
    g = jnp.einsum("nd,edf->enf", x_nd, gate_edf)
    u = jnp.einsum("nd,edf->enf", x_nd, up_edf)
    y = jnp.einsum("enf,efd->end", _swiglu(x_nd, g, u), down_efd)
    return jnp.einsum("end,ne->nd", y, combine.astype(y.dtype))


def layer_stats(
    ids_nk: jax.Array, probs_ne: jax.Array, valid_n: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """(counts [E], prob_sum [E]) of one layer over the valid tokens (``valid_n`` [N] 0/1)."""
    e = probs_ne.shape[-1]
    v = valid_n.astype(jnp.float32)
    counts = jnp.zeros((e,), jnp.float32).at[ids_nk].add(jnp.broadcast_to(v[:, None], ids_nk.shape))
    prob_sum = jnp.sum(probs_ne * v[:, None], axis=0)
    return counts, prob_sum


def load_balancing_loss(router: RouterOutput) -> jax.Array:
    """transformers' ``load_balancing_loss_func`` over all layers (float32 scalar):

        E * sum_e f_e P_e,  f_e = sum_l counts[l, e] / (L R),  P_e = sum_l prob_sum[l, e] / (L R)

    with R the valid tokens per layer (the attention mask); f sums to k, P to 1, and the loss is
    k for a perfectly balanced router. Switch Transformer (arXiv 2101.03961) eqs. 4-6."""
    num_layers, e = router.counts.shape
    rows = num_layers * router.num_tokens
    f = jnp.sum(router.counts, axis=0) / rows
    p = jnp.sum(router.prob_sum, axis=0) / rows
    return e * jnp.sum(f * p)


def router_metrics(router: RouterOutput) -> dict[str, jax.Array]:
    """Per-layer load diagnostics, each [L] float32: ``load_max_over_mean`` (the busiest
    expert's share of the top-k assignments over the mean share 1/E; 1 = balanced, E = one
    expert takes all) and ``load_entropy`` (entropy of the assignment shares, in nats; log E =
    balanced)."""
    e = router.counts.shape[-1]
    share = router.counts / jnp.maximum(jnp.sum(router.counts, axis=-1, keepdims=True), 1.0)
    entropy = -jnp.sum(
        jnp.where(share > 0, share * jnp.log(jnp.where(share > 0, share, 1.0)), 0.0), -1
    )
    return {"load_max_over_mean": jnp.max(share, axis=-1) * e, "load_entropy": entropy}


# ----------------------------------------------------------------------------------------------
# Router signals for the update's loss and metrics.

_state = threading.local()


@contextlib.contextmanager
def collect_routers() -> Iterator[list]:
    """Collect the ``(config, RouterOutput)`` of every MoE forward traced inside the block.

    ``algos.engine.accumulate_gradients`` opens it around each microbatch's loss, so the
    methods' losses need not know about routers: a MoE model's ``backbone`` reports to it
    (``report``), and ``add_router_terms`` adds the auxiliary loss and the router metrics.
    Dense models report nothing, and the loss is then left exactly as it was."""
    outer = getattr(_state, "sink", None)
    sink: list = []
    _state.sink = sink
    try:
        yield sink
    finally:
        _state.sink = outer


def collecting() -> bool:
    """Whether a ``collect_routers`` block is open (the backbone then computes router outputs)."""
    return getattr(_state, "sink", None) is not None


def report(cfg, router: RouterOutput) -> None:
    sink = getattr(_state, "sink", None)
    if sink is not None:
        sink.append((cfg, router))


def add_router_terms(out, routers: list, num_microbatches: int):
    """``(loss, metrics)`` of one microbatch plus the routers' terms, or ``out`` unchanged when
    no MoE forward ran.

    Loss: + ``router_aux_loss_coef * load_balancing_loss / num_microbatches`` for every
    collected forward whose config has ``router_aux_loss`` on (a per-microbatch loss, as
    transformers computes it per forward; the microbatches' shares sum to their mean).
    Metrics (summed over microbatches, hence divided by their number; of the first collected
    forward, the policy's): ``router/aux_loss`` (reported whether or not it is trained),
    ``router/load_max_over_mean`` and ``router/load_entropy`` (means over layers) and the same
    per sparse layer, ``router/layer{i}/...`` (``i`` the decoder layer)."""
    if not routers:
        return out
    loss, metrics = out
    metrics = dict(metrics)
    scale = 1.0 / num_microbatches
    for cfg, router in routers:
        if cfg.router_aux_loss:
            loss = loss + cfg.router_aux_loss_coef * load_balancing_loss(router) * scale
    _, router = routers[0]
    metrics["router/aux_loss"] = load_balancing_loss(router) * scale
    layers = router.layers or range(router.counts.shape[0])
    for key, per_layer in router_metrics(router).items():
        metrics[f"router/{key}"] = jnp.mean(per_layer) * scale
        for row, i in enumerate(layers):
            metrics[f"router/layer{i}/{key}"] = per_layer[row] * scale
    return loss, metrics
