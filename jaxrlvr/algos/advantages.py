"""Group advantages for RLVR: baselines (mean, leave-one-out, none) and scales (group/batch std).

For the G responses to one prompt with rewards r_1..r_G:

    mean  (GRPO, Shao et al. 2024 "DeepSeekMath"):      A_i = r_i - mean(r)
    rloo  (Ahmadian et al. 2024 "Back to Basics"):      A_i = r_i - (sum_j r_j - r_i) / (G - 1)
    none  (REINFORCE on raw rewards):                   A_i = r_i

then divided by (std + eps) where std is the group's unbiased std ("group_std", GRPO), the whole
batch's unbiased reward std ("batch_std", Liu et al. 2025 "Tricks or Traps" / Lite PPO), or not
at all ("none", Dr. GRPO, Liu et al. 2025 "Understanding R1-Zero-Like Training").

Rewards arrive already shaped (``shaping``) and, for ``kl_in == "reward"``, already penalised;
this module only centres and scales them. It is jit-able: group sizes are static shapes.
"""

import jax
import jax.numpy as jnp

from jaxrlvr.algos import loss_config


def group_advantages(
    rewards: jax.Array,
    group_size: int,
    cfg: loss_config.AdvantageConfig,
) -> jax.Array:
    """Advantages of grouped rewards, float32, same shape as ``rewards``.

    mean: A = r - mean_g(r); rloo: A = r - (sum_g(r) - r) / (G - 1) = G/(G-1) * (r - mean_g(r));
    none: A = r; then / (std + eps) for group_std (unbiased std over each group) or batch_std
    (unbiased std of all rewards). Sources: GRPO (DeepSeekMath), RLOO (Ahmadian et al. 2024),
    Dr. GRPO (Liu et al. 2025).

    Args:
      rewards: [N] with groups as contiguous blocks of ``group_size``, or [P, G] with
        G == group_size; bool/int/float.
      group_size: G (static). rloo and group_std need G >= 2.
      cfg: baseline, scale and eps.
    """
    loss_config.expect_array(rewards, "rewards", rank={1, 2}, kind="real")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.ndim == 2:
        loss_config.expect_array(rewards, "rewards", shape=(None, group_size))
    elif rewards.shape[0] % group_size:
        raise ValueError(
            f"group_size ({group_size}) must divide the length of rewards ({rewards.shape[0]})"
        )
    if group_size < 2 and (cfg.baseline == "rloo" or cfg.scale == "group_std"):
        raise ValueError(
            f"baseline='rloo' and scale='group_std' need group_size >= 2, got {group_size}"
        )
    r = jnp.asarray(rewards).astype(jnp.float32).reshape(-1, group_size)
    if cfg.baseline == "mean":
        adv = r - jnp.mean(r, axis=-1, keepdims=True)
    elif cfg.baseline == "rloo":
        adv = r - (jnp.sum(r, axis=-1, keepdims=True) - r) / (group_size - 1)
    else:
        adv = r
    if cfg.scale == "group_std":
        adv = adv / (jnp.std(r, axis=-1, ddof=1, keepdims=True) + cfg.eps)
    elif cfg.scale == "batch_std":
        ddof = 1 if r.size > 1 else 0
        adv = adv / (jnp.std(r, ddof=ddof) + cfg.eps)
    return adv.reshape(rewards.shape)
