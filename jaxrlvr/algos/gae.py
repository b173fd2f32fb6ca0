"""PPO pieces for language models: per-token rewards, GAE and the clipped value loss.

PPO (Schulman et al. 2017) on a token MDP: the reward of a response is the task reward on its
last token plus, when the KL penalty is folded into the reward, -beta * KL on every token
(Ouyang et al. 2022; Ziegler et al. 2019). Advantages come from generalised advantage estimation
(Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE"), computed with a reverse
``lax.scan`` over time; the critic is trained with the clipped value loss.

Not here: the critic itself and the update loop. GRPO-style group advantages live in
``advantages``.
"""

import jax
import jax.numpy as jnp

from jaxrlvr.algos import aggregation, loss_config, segments


def ppo_token_rewards(
    task_reward_b: jax.Array,
    kl_bt: jax.Array,
    mask_bt: jax.Array,
    beta: float,
    segment_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """Per-token PPO rewards, float32 [B, T]: -beta * KL on every valid token, plus the task
    reward on the last valid token of each sequence (InstructGPT-style, Ouyang et al. 2022).

    r[b, t] = m[b, t] * (-beta * kl[b, t]) + task[b] * [t == last valid t of row b].
    A row with no valid token gets no reward at all. Packed rows (``segment_ids_bt``): the same
    per segment, with the task reward given per token (each token holds its sequence's).

    Args:
      task_reward_b: [B] (or per token [B, T]) bool/int/float; kl_bt: floating [B, T] (e.g.
      ``kl.kl_estimate``); mask_bt: [B, T]; beta: KL coefficient; segment_ids_bt: int [B, T]
      or None (one sequence per row).
    """
    loss_config.expect_array(kl_bt, "kl_bt", rank=2, kind="float")
    loss_config.expect_array(task_reward_b, "task_reward_b", rank={1, 2}, kind="real")
    loss_config.expect_array(
        task_reward_b, "task_reward_b", shape=kl_bt.shape[: task_reward_b.ndim]
    )
    loss_config.expect_array(mask_bt, "mask_bt", shape=kl_bt.shape, kind="mask")
    is_last = segments.last_valid(mask_bt, segment_ids_bt)
    task = segments.per_token(jnp.asarray(task_reward_b).astype(jnp.float32), kl_bt.shape)
    rewards = aggregation.masked_rows(-beta * kl_bt.astype(jnp.float32), mask_bt)
    return rewards + jnp.where(is_last, task, 0.0)


def compute_gae(
    rewards_bt: jax.Array,
    values_bt: jax.Array,
    mask_bt: jax.Array,
    gamma: float,
    lam: float,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation (Schulman et al. 2016) over valid tokens.

    Over the valid tokens of a row in order (t' = the next valid token after t; none past the
    last, where V(t') = A(t') = 0):
        delta_t = r_t + gamma * V_{t'} - V_t,     A_t = delta_t + gamma * lam * A_{t'},
        returns_t = A_t + V_t.
    Computed by ``lax.scan`` over reversed time; masked tokens are skipped (the carry passes
    through them) and get A = returns = 0, so right padding and interior masked tokens both work.
    The last valid token of each sequence bootstraps from nothing: with packed rows
    (``segment_ids_bt``) the recursion restarts at every segment, never reading the next one.

    Args:
      rewards_bt, values_bt: floating [B, T]; mask_bt: [B, T]; gamma, lam: discount and GAE lambda;
      segment_ids_bt: int [B, T] of packed rows, or None (one sequence per row).
    Returns:
      (advantages float32 [B, T], returns float32 [B, T]); both carry no gradient.
    """
    loss_config.expect_array(rewards_bt, "rewards_bt", rank=2, kind="float")
    loss_config.expect_array(values_bt, "values_bt", shape=rewards_bt.shape, kind="float")
    loss_config.expect_array(mask_bt, "mask_bt", shape=rewards_bt.shape, kind="mask")
    r = jax.lax.stop_gradient(rewards_bt.astype(jnp.float32))
    v = jax.lax.stop_gradient(values_bt.astype(jnp.float32))
    valid = jnp.asarray(mask_bt) != 0
    r, v = jnp.where(valid, r, 0.0), jnp.where(valid, v, 0.0)
    # The end of a sequence: its successor's value and advantage are 0 (a no-op for the last
    # valid token of an unpacked row, whose carry is still the initial zeros).
    ends = segments.last_valid(mask_bt, segment_ids_bt)

    def step(carry, xs):
        next_v, next_a = carry
        r_t, v_t, m_t, end_t = xs
        next_v, next_a = jnp.where(end_t, 0.0, next_v), jnp.where(end_t, 0.0, next_a)
        delta = r_t + gamma * next_v - v_t
        a_t = delta + gamma * lam * next_a
        new_carry = (jnp.where(m_t, v_t, next_v), jnp.where(m_t, a_t, next_a))
        return new_carry, jnp.where(m_t, a_t, 0.0)

    zeros = jnp.zeros(r.shape[:1], jnp.float32)
    _, adv_tb = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, valid.T, ends.T), reverse=True)
    adv = adv_tb.T
    return adv, jnp.where(valid, adv + v, 0.0)


def value_loss(
    values_bt: jax.Array,
    old_values_bt: jax.Array,
    returns_bt: jax.Array,
    mask_bt: jax.Array,
    clip: float | None,
    *,
    denominator: jax.Array | float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO clipped value loss (Schulman et al. 2017; as in OpenAI baselines ppo2).

    v_clip = old + clip(v - old, -clip, clip);
    loss = sum_bt m * 0.5 * max((v - R)^2, (v_clip - R)^2) / denominator
    (``clip=None``: the plain 0.5 * (v - R)^2). Pass the full batch's token count as
    ``denominator`` (e.g. ``loss_denominator`` with token_mean) so microbatches sum exactly.

    Returns:
      (loss scalar, {"vf_clip_frac_sum": tokens where the clipped term was chosen (strictly
      larger), "vf_error_sq_sum": sum m * (v - R)^2}); the metrics are microbatch-summable sums.
    """
    loss_config.expect_array(values_bt, "values_bt", rank=2, kind="float")
    loss_config.expect_array(old_values_bt, "old_values_bt", shape=values_bt.shape, kind="float")
    loss_config.expect_array(returns_bt, "returns_bt", shape=values_bt.shape, kind="float")
    loss_config.expect_array(mask_bt, "mask_bt", shape=values_bt.shape, kind="mask")
    loss_config.expect_array(denominator, "denominator", rank=0)
    v = values_bt.astype(jnp.float32)
    ret = jax.lax.stop_gradient(returns_bt.astype(jnp.float32))
    err = jnp.square(v - ret)
    if clip is None:
        per_token, clipped = err, jnp.zeros_like(err)
    else:
        old = jax.lax.stop_gradient(old_values_bt.astype(jnp.float32))
        err_clip = jnp.square(old + jnp.clip(v - old, -clip, clip) - ret)
        per_token, clipped = jnp.maximum(err, err_clip), (err_clip > err).astype(jnp.float32)
    loss = jnp.sum(aggregation.masked_rows(0.5 * per_token, mask_bt)) / denominator
    metrics = {
        "vf_clip_frac_sum": jnp.sum(aggregation.masked_rows(clipped, mask_bt)),
        "vf_error_sq_sum": jax.lax.stop_gradient(jnp.sum(aggregation.masked_rows(err, mask_bt))),
    }
    return loss, metrics
