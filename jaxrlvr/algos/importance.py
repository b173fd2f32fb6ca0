"""Truncated importance sampling (TIS) for the sampler/trainer mismatch.

Rollouts come from a sampler (vLLM, or the JAX sampler in another precision) whose token
probabilities pi_sampler differ from the trainer's pi_old for the same weights. Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", correct the policy
gradient with the truncated weight

    w_t = min(pi_old(o_t) / pi_sampler(o_t), C)            per token, or
    w   = min(prod_t pi_old(o_t) / pi_sampler(o_t), C)     per sequence (broadcast over its tokens)

treated as a constant (no gradient). This module computes the weight and its diagnostics; the
policy loss multiplies its policy-gradient term by it.
"""

import jax
import jax.numpy as jnp

from jaxrlvr.algos import aggregation, loss_config, segments


def tis_weights(
    old_logp_bt: jax.Array,
    sampler_logp_bt: jax.Array,
    mask_bt: jax.Array,
    level: loss_config.TISLevel,
    cap: float,
    *,
    log_ratio_clamp: float = 20.0,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Truncated IS weights (Yao et al. 2025) and the "was truncated" indicator, float32 [B, T].

    token: w[b, t] = min(exp(clip(old - sampler)), cap);
    sequence: w[b, :] = min(exp(clip(sum_t m * (old - sampler))), cap);
    none: w = 1. The log ratio is clamped to +-log_ratio_clamp before exp. The weights carry no
    gradient. The indicator is 1 where the raw ratio exceeded ``cap``.

    Args:
      old_logp_bt, sampler_logp_bt: floating [B, T]; mask_bt: [B, T].
      segment_ids_bt: int [B, T] of packed rows: the sequence weight is per segment.
    """
    loss_config.expect_array(old_logp_bt, "old_logp_bt", rank=2, kind="float")
    loss_config.expect_array(
        sampler_logp_bt, "sampler_logp_bt", shape=old_logp_bt.shape, kind="float"
    )
    loss_config.expect_array(mask_bt, "mask_bt", shape=old_logp_bt.shape, kind="mask")
    loss_config.check_literal("level", level, loss_config.TISLevel)
    if level == "none":
        ones = jnp.ones(old_logp_bt.shape, jnp.float32)
        return ones, jnp.zeros_like(ones)
    diff = aggregation.masked_rows(
        old_logp_bt.astype(jnp.float32) - sampler_logp_bt.astype(jnp.float32), mask_bt
    )
    if level == "sequence":
        diff = jnp.broadcast_to(segments.segment_sums(diff, segment_ids_bt), diff.shape)
    log_w = jax.lax.stop_gradient(jnp.clip(diff, -log_ratio_clamp, log_ratio_clamp))
    truncated = (log_w > jnp.log(cap)).astype(jnp.float32)
    return jnp.minimum(jnp.exp(log_w), cap), truncated


def tis_metrics(
    old_logp_bt: jax.Array,
    sampler_logp_bt: jax.Array,
    mask_bt: jax.Array,
    weights_bt: jax.Array,
    truncated_bt: jax.Array,
) -> dict[str, jax.Array]:
    """Microbatch-summable TIS diagnostics over valid tokens (Yao et al. 2025).

    ``tis_weight_sum``, ``tis_truncated_sum`` and ``logp_diff_abs_sum`` are token sums (divide by
    the summed token count); ``logp_diff_abs_max`` is a max (combine with max). The log-prob
    difference is |old - sampler|, the trainer/sampler mismatch itself.
    """
    loss_config.expect_array(old_logp_bt, "old_logp_bt", rank=2, kind="float")
    for name, x in [
        ("sampler_logp_bt", sampler_logp_bt),
        ("mask_bt", mask_bt),
        ("weights_bt", weights_bt),
        ("truncated_bt", truncated_bt),
    ]:
        loss_config.expect_array(x, name, shape=old_logp_bt.shape)
    absdiff = aggregation.masked_rows(
        jnp.abs(old_logp_bt.astype(jnp.float32) - sampler_logp_bt.astype(jnp.float32)), mask_bt
    )
    return {
        "tis_weight_sum": jnp.sum(aggregation.masked_rows(weights_bt, mask_bt)),
        "tis_truncated_sum": jnp.sum(aggregation.masked_rows(truncated_bt, mask_bt)),
        "logp_diff_abs_sum": jnp.sum(absdiff),
        "logp_diff_abs_max": jnp.max(absdiff, initial=0.0),
    }
