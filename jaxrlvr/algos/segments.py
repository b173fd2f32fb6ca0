"""Packed rows: several sequences per row, told apart by segment ids.

A packed batch (``batch.Batch`` with ``segment_ids``) lays whole rollouts one after another in a
row: ``segment_ids[b, t]`` is 1, 2, ... for the first, second, ... sequence of row b (numbered in
order, without gaps) and 0 on padding; ``positions[b, t]`` restarts at 0 with every segment.
Attention never crosses a segment (``model.Qwen2ForCausalLM.backbone(segment_ids=...)``), and
every per-sequence quantity is computed per segment with the helpers below: a sequence's token
count and sums (GRPO's per-sequence token mean, GSPO's sequence ratio, sequence-level TIS), its
last response token (PPO's task reward, GAE's bootstrap boundary), and the number of sequences
(the seq_mean denominators).

An unpacked row is the special case of one segment per row: every helper takes
``segment_ids=None`` to mean that, and then reduces to the plain per-row computation, so the
loss code has one path for both layouts.

Per-sequence values (advantages, rewards, correctness) of a packed batch are stored per token,
[B, T]: each token holds the value of its sequence (0 on padding). That is the layout the losses
read anyway (a per-token advantage broadcasts like PPO's), it needs no static bound on the
number of segments per row, and microbatches that split rows keep every segment whole.

Not here: building packed rows (``rollout.pack``), the attention mask (``model.decoder``).
"""

import jax
import jax.numpy as jnp

_f32 = jnp.float32


def row_segments(segment_ids_bt: jax.Array | None, mask_bt: jax.Array) -> jax.Array:
    """int32 [B, T] segment ids: ``segment_ids_bt``, or 1 on every position when None
    (one sequence per row)."""
    if segment_ids_bt is not None:
        return jnp.asarray(segment_ids_bt).astype(jnp.int32)
    return jnp.ones(jnp.shape(mask_bt), jnp.int32)


def segment_sums(x_bt: jax.Array, segment_ids_bt: jax.Array | None) -> jax.Array:
    """For every token, the sum of ``x`` over the tokens of its segment (same row, same id),
    float32 [B, T]. ``segment_ids_bt=None``: the row sum, broadcast [B, 1]. Differentiable."""
    x = x_bt.astype(_f32)
    if segment_ids_bt is None:
        return jnp.sum(x, axis=-1, keepdims=True)
    t = x.shape[-1]
    seg = jnp.asarray(segment_ids_bt).astype(jnp.int32)

    def one_row(xr, sr):
        sums = jax.ops.segment_sum(xr, sr, num_segments=t + 1, indices_are_sorted=False)
        return sums[sr]

    return jax.vmap(one_row)(x, seg)


def segment_mean(
    x_bt: jax.Array, mask_bt: jax.Array, segment_ids_bt: jax.Array | None
) -> jax.Array:
    """Masked mean of ``x`` over each token's segment, sum(m * x) / max(sum(m), 1), float32,
    [B, T] ([B, 1] when ``segment_ids_bt`` is None). ``x`` must be 0 where the mask is 0."""
    m = jnp.asarray(mask_bt).astype(_f32)
    return segment_sums(x_bt, segment_ids_bt) / jnp.maximum(segment_sums(m, segment_ids_bt), 1.0)


def num_sequences(segment_ids_bt: jax.Array | None, mask_bt: jax.Array) -> jax.Array:
    """Number of sequences in the batch, float32 scalar: B for an unpacked batch, the sum of
    each row's largest segment id for a packed one (ids are 1..k without gaps)."""
    if segment_ids_bt is None:
        return jnp.asarray(float(jnp.shape(mask_bt)[0]), _f32)
    seg = jnp.asarray(segment_ids_bt).astype(jnp.int32)
    return jnp.sum(jnp.max(seg, axis=-1, initial=0)).astype(_f32)


def last_valid(mask_bt: jax.Array, segment_ids_bt: jax.Array | None) -> jax.Array:
    """bool [B, T]: True on the last masked-in token of each segment (of each row when
    ``segment_ids_bt`` is None). A segment without masked-in tokens has none."""
    valid = jnp.asarray(mask_bt) != 0
    t = valid.shape[-1]
    idx = jnp.where(valid, jnp.arange(t, dtype=jnp.int32)[None, :], -1)
    if segment_ids_bt is None:
        last = jnp.max(idx, axis=-1, keepdims=True)
    else:
        seg = jnp.asarray(segment_ids_bt).astype(jnp.int32)

        def one_row(ir, sr):
            return jax.ops.segment_max(ir, sr, num_segments=t + 1)[sr]

        last = jax.vmap(one_row)(idx, seg)
    return valid & (idx == last)


def per_token(values: jax.Array, shape_bt: tuple[int, int]) -> jax.Array:
    """A per-sequence field as [B, T]: [B] values broadcast over their row; [B, T] as given."""
    v = jnp.asarray(values)
    return jnp.broadcast_to(v[:, None] if v.ndim == 1 else v, shape_bt)
