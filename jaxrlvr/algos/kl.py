"""Per-token estimators of KL(pi || pi_ref) from samples of pi.

With r = pi_ref(o_t) / pi(o_t) evaluated on tokens sampled from pi (Schulman 2020, "Approximating
KL Divergence", http://joschu.net/blog/kl-approx.html):

    k1 = -log r                 unbiased, high variance, can be negative
    k2 = (log r)^2 / 2          biased, low variance, >= 0
    k3 = (r - 1) - log r        unbiased, low variance, >= 0 (GRPO's penalty, DeepSeekMath eq. 4)

Only the estimator lives here; whether the penalty enters the loss or the reward is decided by
``PolicyLossConfig.kl_in`` in the caller.
"""

import jax
import jax.numpy as jnp

from jaxrlvr.algos import loss_config


def kl_estimate(
    logp_bt: jax.Array,
    ref_logp_bt: jax.Array,
    estimator: loss_config.KLEstimator = "k3",
    *,
    log_ratio_clamp: float = 20.0,
    mask_bt: jax.Array | None = None,
) -> jax.Array:
    """Per-token KL(pi || pi_ref) estimate, float32, same shape as the inputs.

    log r = clip(ref_logp - logp, -log_ratio_clamp, log_ratio_clamp); then k1 = -log r,
    k2 = (log r)^2 / 2, k3 = expm1(log r) - log r (Schulman's KL approximations blog; k3 is the
    GRPO penalty of Shao et al. 2024). The clamp keeps exp finite for large log-prob gaps.

    Args:
      logp_bt: floating [B, T] log pi of the sampled tokens (any rank is accepted; shapes match).
      ref_logp_bt: floating, same shape, log pi_ref of the same tokens.
      estimator: "k1", "k2" or "k3".
      log_ratio_clamp: bound on |log r|.
      mask_bt: optional mask of the inputs' shape: where it is 0, log r is set to 0 right after
        the subtraction (estimate 0), so non-finite log-probs on padding (NaN reference
        log-probs) reach neither the value nor the gradient (a mask applied to the output
        would still let NaN * 0 into the gradient).
    """
    loss_config.expect_array(logp_bt, "logp_bt", kind="float")
    loss_config.expect_array(ref_logp_bt, "ref_logp_bt", shape=jnp.shape(logp_bt), kind="float")
    loss_config.check_literal("estimator", estimator, loss_config.KLEstimator)
    log_r = ref_logp_bt.astype(jnp.float32) - logp_bt.astype(jnp.float32)
    if mask_bt is not None:
        loss_config.expect_array(mask_bt, "mask_bt", shape=jnp.shape(logp_bt), kind="mask")
        log_r = jnp.where(jnp.asarray(mask_bt) != 0, log_r, 0.0)
    log_r = jnp.clip(log_r, -log_ratio_clamp, log_ratio_clamp)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * jnp.square(log_r)
    return k3(log_r)


def k3(log_r: jax.Array) -> jax.Array:
    """k3 = (r - 1) - log r from log r, float32: the one implementation every caller uses.

    expm1 keeps it accurate for tiny log r (exp(x) - 1 - x cancels to a slightly negative value
    in float32 at float32-level mismatch); the max at 0 removes any remaining rounding below the
    true value, which is >= 0.
    """
    log_r = jnp.asarray(log_r, jnp.float32)
    return jnp.maximum(jnp.expm1(log_r) - log_r, 0.0)
