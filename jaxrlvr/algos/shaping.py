"""Reward shaping on response lengths, and truncated-completion masking.

- Kimi k1.5 length reward (Kimi Team 2025, "Kimi k1.5: Scaling Reinforcement Learning with
  LLMs", sec. 2.3.3): within each group, shorter correct answers earn up to +0.5, longer ones
  down to -0.5; incorrect answers only ever lose (min(0, lambda)).
- DAPO soft overlong punishment (Yu et al. 2025, "DAPO", eq. 13): a linear penalty in the last
  ``cache_len`` tokens before ``max_len``, and -1 beyond it.
- DAPO overlong filtering: truncated completions are dropped from the loss mask.

These act on per-response arrays before ``advantages.group_advantages``; the verifiers that
produce correctness live in ``jaxrlvr.rewards``, which this package never imports.
"""

import jax
import jax.numpy as jnp

from jaxrlvr.algos import loss_config


def kimi_length_reward(
    lengths: jax.Array,
    correct: jax.Array,
    group_size: int,
    cfg: loss_config.LengthRewardConfig | None = None,
) -> jax.Array:
    """Kimi k1.5 length reward, float32 [N] (times ``cfg.weight`` when a config is given).

    Per group: lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len); the reward is lambda_i
    for a correct answer and min(0, lambda_i) for an incorrect one. When all lengths in the group
    are equal the reward is 0 (no division by zero).

    Args:
      lengths: integer or floating [N], groups as contiguous blocks of ``group_size``.
      correct: bool/int/float [N] (nonzero = correct).
      group_size: G (static).
    """
    loss_config.expect_array(lengths, "lengths", rank=1, kind="real")
    loss_config.expect_array(correct, "correct", shape=lengths.shape, kind="real")
    if group_size < 1 or lengths.shape[0] % group_size:
        raise ValueError(
            f"group_size must divide the number of responses {lengths.shape[0]}, got {group_size}"
        )
    n = jnp.asarray(lengths).astype(jnp.float32).reshape(-1, group_size)
    lo = jnp.min(n, axis=-1, keepdims=True)
    span = jnp.max(n, axis=-1, keepdims=True) - lo
    lam = jnp.where(span > 0, 0.5 - (n - lo) / jnp.where(span > 0, span, 1.0), 0.0)
    ok = (jnp.asarray(correct) != 0).reshape(lam.shape)
    reward = jnp.where(ok, lam, jnp.minimum(0.0, lam)).reshape(-1)
    return reward * (1.0 if cfg is None else cfg.weight)


def dapo_overlong_penalty(
    lengths: jax.Array,
    max_len: int,
    cache_len: int,
) -> jax.Array:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), float32, shape of ``lengths``.

    R(L) = 0 if L <= max_len - cache_len; ((max_len - cache_len) - L) / cache_len if
    max_len - cache_len < L <= max_len; -1 if L > max_len. Added to the task reward.
    """
    loss_config.expect_array(lengths, "lengths", kind="real")
    loss_config.OverlongConfig(max_len=max_len, cache_len=cache_len)  # validates the pair
    n = jnp.asarray(lengths).astype(jnp.float32)
    soft = max_len - cache_len
    return jnp.where(n <= soft, 0.0, jnp.where(n <= max_len, (soft - n) / cache_len, -1.0))


def overlong_reward(lengths: jax.Array, cfg: loss_config.OverlongConfig) -> jax.Array:
    """``dapo_overlong_penalty`` with the limits and weight of an ``OverlongConfig``."""
    return cfg.weight * dapo_overlong_penalty(lengths, cfg.max_len, cfg.cache_len)


def mask_truncated_completions(mask_bt: jax.Array, truncated_b: jax.Array) -> jax.Array:
    """Zero the loss mask of truncated completions (DAPO overlong filtering, Yu et al. 2025).

    mask'[b, t] = mask[b, t] * (1 - truncated[b]), in the mask's dtype. Used when
    ``PolicyLossConfig.mask_truncated`` is set; compute ``loss_denominator`` on the result.

    Args:
      mask_bt: [B, T]; truncated_b: [B] bool/int (nonzero = hit the length limit).
    """
    loss_config.expect_array(mask_bt, "mask_bt", rank=2, kind="mask")
    loss_config.expect_array(truncated_b, "truncated_b", shape=mask_bt.shape[:1], kind="real")
    keep = (jnp.asarray(truncated_b) == 0)[:, None]
    mask = jnp.asarray(mask_bt)
    return jnp.where(keep, mask, jnp.zeros_like(mask))
