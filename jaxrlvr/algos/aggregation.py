"""Loss aggregation over tokens and sequences, exact under microbatching.

A per-token loss l[b, t] with mask m[b, t] becomes one scalar in one of five ways:

    token_mean               sum_bt m*l / sum_bt m                      (DAPO, Yu et al. 2025)
    seq_mean_token_mean      (1/B) sum_b [sum_t m*l / max(sum_t m, 1)]   (GRPO, Shao et al. 2024)
    seq_mean_token_sum       (1/B) sum_b sum_t m*l
    seq_mean_token_sum_norm  (1/(B*C)) sum_b sum_t m*l      (Dr. GRPO, Liu et al. 2025)
    prompt_mean_token_mean   (1/P) sum_p [sum_{t in p} m*l / sum_{t in p} m]
                                                            (ScaleRL, Khatri et al. 2025)

with C = norm_constant (e.g. the maximum number of generated tokens). prompt_mean_token_mean is
ScaleRL's "prompt-level" averaging: the mean over all tokens of a prompt's G completions, then
the mean over the P prompts that have any loss token (a group masked out whole, e.g. by
zero-variance filtering, leaves the loss and its count). A prompt's group is told apart on the
device by its shared-prompt block (``prompt_group_ids`` of a packed batch with shared prompts,
``rollout.pack(share_prompts=G)``): a block lies whole in one row, so the group's token count is
a per-row segment sum, and P = sum_bt m / (its group's count), both exact under microbatching.

Every mode is "sum of per-row terms / global denominator". The denominator is computed once on the
FULL batch (``loss_denominator``) before the microbatch loop; ``aggregate`` then returns one
microbatch's share, so the sum over microbatches equals the full-batch loss and the accumulated
gradient equals the full-batch gradient exactly (the token_mean mode would be biased if each
microbatch divided by its own token count). Per-row counts in seq_mean_token_mean are guarded with
max(., 1) so an all-masked row contributes 0 instead of NaN.

Packed rows (``segment_ids``, ``algos.segments``): "sequence" means segment, not row: B is the
number of sequences in the batch and the per-sequence token mean is over each segment's tokens,
so a packed batch aggregates exactly as the same rollouts padded one per row. Microbatches split
rows, never segments, so the per-row terms stay exact.
"""

import jax
import jax.numpy as jnp

from jaxrlvr.algos import loss_config, segments


def loss_denominator(
    mask_bt: jax.Array,
    cfg: loss_config.PolicyLossConfig,
    segment_ids_bt: jax.Array | None = None,
    group_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """The global denominator of ``cfg.aggregation`` for the full batch, float32 scalar
    (token count: DAPO, Yu et al. 2025; B: GRPO, Shao et al. 2024; B * C: Dr. GRPO, Liu et al.
    2025).

    token_mean: max(sum(mask), 1); seq_mean_token_mean and seq_mean_token_sum: B;
    seq_mean_token_sum_norm: B * norm_constant (Dr. GRPO); prompt_mean_token_mean: max(P, 1),
    P the number of prompt groups with loss tokens (ScaleRL).

    Args:
      mask_bt: [B, T] bool/int/float mask of the FULL batch (all microbatches).
      segment_ids_bt: int [B, T] of a packed batch (B then counts its sequences), or None.
      group_ids_bt: int [B, T] shared-prompt group ids (``Batch.prompt_group_ids``); required
        by prompt_mean_token_mean, unread otherwise.
    """
    loss_config.expect_array(mask_bt, "mask_bt", rank=2, kind="mask")
    if segment_ids_bt is not None:
        loss_config.expect_array(segment_ids_bt, "segment_ids_bt", shape=mask_bt.shape, kind="int")
    if cfg.aggregation == "prompt_mean_token_mean":
        m = jnp.asarray(mask_bt).astype(jnp.float32)
        # Every group's tokens weigh 1 / (its count) and sum to 1: the sum counts the groups.
        return jnp.maximum(jnp.sum(m * _inverse_group_counts(m, group_ids_bt)), 1.0)
    if cfg.aggregation == "token_mean":
        return jnp.maximum(jnp.sum(jnp.asarray(mask_bt).astype(jnp.float32)), 1.0)
    b = segments.num_sequences(segment_ids_bt, mask_bt)
    if cfg.aggregation == "seq_mean_token_sum_norm":
        return b * jnp.float32(cfg.norm_constant)
    return b


def _inverse_group_counts(m_bt: jax.Array, group_ids_bt: jax.Array | None) -> jax.Array:
    """1 / (the loss-token count of each token's prompt group), float32 [B, T], no gradient."""
    if group_ids_bt is None:
        raise ValueError(
            "aggregation='prompt_mean_token_mean' needs the batch's prompt_group_ids "
            "(packed rows with shared prompts: rl.packing and rl.share_prompts)"
        )
    loss_config.expect_array(group_ids_bt, "group_ids_bt", shape=m_bt.shape, kind="int")
    counts = segments.segment_sums(m_bt, group_ids_bt)
    return jax.lax.stop_gradient(1.0 / jnp.maximum(counts, 1.0))


def masked_rows(per_token_bt: jax.Array, mask_bt: jax.Array) -> jax.Array:
    """per_token * mask with masked entries forced to exactly 0 (even if they hold inf/NaN)."""
    m = jnp.asarray(mask_bt).astype(jnp.float32)
    return jnp.where(m != 0, per_token_bt.astype(jnp.float32) * m, 0.0)


def aggregate(
    per_token_bt: jax.Array,
    mask_bt: jax.Array,
    cfg: loss_config.PolicyLossConfig,
    denominator: jax.Array | float,
    segment_ids_bt: jax.Array | None = None,
    group_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """This microbatch's contribution to the aggregated loss (DAPO / GRPO / Dr. GRPO / ScaleRL
    modes).

    token_mean and the seq_mean_token_sum modes: sum_bt(m * l) / denominator;
    seq_mean_token_mean: sum_b(sum_t(m * l) / max(sum_t m, 1)) / denominator;
    prompt_mean_token_mean: sum_bt(m * l / (its group's sum of m)) / denominator.
    Summed over the microbatches of a batch, this equals the full-batch aggregation.

    Args:
      per_token_bt: floating [B_mb, T] per-token loss.
      mask_bt: [B_mb, T] mask of the same microbatch.
      cfg: the config whose ``aggregation`` chooses the mode.
      denominator: ``loss_denominator`` of the FULL batch (scalar).
      segment_ids_bt: int [B_mb, T] of a packed microbatch, or None (one sequence per row).
      group_ids_bt: int [B_mb, T] shared-prompt group ids of the microbatch; required by
        prompt_mean_token_mean.
    """
    loss_config.expect_array(per_token_bt, "per_token_bt", rank=2, kind="float")
    loss_config.expect_array(mask_bt, "mask_bt", shape=per_token_bt.shape, kind="mask")
    loss_config.expect_array(denominator, "denominator", rank=0)
    if cfg.aggregation == "prompt_mean_token_mean":
        m = jnp.asarray(mask_bt).astype(jnp.float32)
        weighted = per_token_bt.astype(jnp.float32) * _inverse_group_counts(m, group_ids_bt)
        return jnp.sum(masked_rows(weighted, mask_bt)) / denominator
    if segment_ids_bt is not None:
        loss_config.expect_array(
            segment_ids_bt, "segment_ids_bt", shape=per_token_bt.shape, kind="int"
        )
        if cfg.aggregation == "seq_mean_token_mean":
            # Each token weighted by 1 / (its segment's token count): the sum over a segment is
            # that segment's token mean.
            m = jnp.asarray(mask_bt).astype(jnp.float32)
            counts = jax.lax.stop_gradient(segments.segment_sums(m, segment_ids_bt))
            per_token_bt = per_token_bt.astype(jnp.float32) / jnp.maximum(counts, 1.0)
        return jnp.sum(masked_rows(per_token_bt, mask_bt)) / denominator
    row_sums = jnp.sum(masked_rows(per_token_bt, mask_bt), axis=-1)
    if cfg.aggregation == "seq_mean_token_mean":
        counts = jnp.sum(jnp.asarray(mask_bt).astype(jnp.float32), axis=-1)
        row_sums = row_sums / jnp.maximum(counts, 1.0)
    return jnp.sum(row_sums) / denominator
