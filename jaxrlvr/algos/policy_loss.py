"""The configurable RLVR policy objective: one function for GRPO, Dr. GRPO, DAPO, GSPO and PPO.

Per valid token (advantage A broadcast from its sequence, or per token for PPO/GAE):

    log rho   = clip(lp - old_lp, +-clamp)                 token ratio (PPO, Schulman et al. 2017)
              | clip(mean_t(lp - old_lp), +-clamp)         sequence ratio (GSPO, Zheng et al. 2025)
    pg        = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A)
                                                   (clip-higher: DAPO, Yu et al. 2025)
              | -rho * A                           when cfg.clip is False (no trust region)
    pg        = min(pg, -c * A) where A < 0        (dual clip, Ye et al. 2020)
    loss_t    = w_t * pg + beta * KL_t - alpha * H_t
                 w_t: the off-policy correction's weight (``importance``: engine mismatch and/or
                 staleness; token / sequence / geometric; truncate, mask or IcePop),
                 KL_t: k1/k2/k3 (Schulman's blog) when kl_in == "loss" (GRPO, Shao et al.
                 2024), H_t: entropy bonus

aggregated by ``aggregation.aggregate`` with the full-batch denominator, so the loss and its
gradient add up exactly over microbatches.

Metrics contract (so an update can accumulate them over microbatches): every value is a float32
scalar and its key says how to combine it:
  - ``loss``, ``pg_loss`` and ``kl_loss`` are already divided by the global denominator: add them.
  - keys ending in ``_sum`` are sums over valid tokens; ``token_count`` is the number of valid
    tokens: add them, then divide (``finalize_metrics`` does it, giving the ``_sum``-less name).
  - keys ending in ``_seqsum`` are sums over sequences (those with a loss token);
    ``seq_count`` counts them: add, then divide by ``seq_count``.
  - keys ending in ``_max`` / ``_min`` combine with max / min.
The off-policy diagnostics (``importance.correction_metrics``) come under ``offpolicy/engine/``,
``offpolicy/staleness/`` and ``offpolicy/both/``, every step whatever the correction's mode:
``k1``, ``k3`` (mismatch KL), ``ess``, ``ratio_max`` / ``ratio_min`` (level ratio), ``masked`` /
``truncated`` (token fractions), ``seq_masked`` / ``seq_truncated`` (sequence fractions);
``offpolicy/weight`` is the mean weight applied, ``logp_diff_abs(_max)`` |old - sampler|.
``metrics_identity``, ``accumulate_metrics`` and ``finalize_metrics`` implement this; the key set
depends only on the config, never on which optional inputs were given (absent ones report 0).

Not here: advantages (``advantages``), the model forward, and truncation masking (the caller
passes a mask from ``shaping.mask_truncated_completions``).
"""

import jax
import jax.numpy as jnp

from jaxrlvr.algos import aggregation, importance, kl, loss_config, segments

_f32 = jnp.float32


def policy_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv_b: jax.Array,
    mask_bt: jax.Array,
    cfg: loss_config.PolicyLossConfig,
    *,
    denominator: jax.Array | float,
    ref_logp_bt: jax.Array | None = None,
    sampler_logp_bt: jax.Array | None = None,
    behaviour_logp_bt: jax.Array | None = None,
    entropy_bt: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    group_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This microbatch's share of the policy loss (formula in the module docstring).

    Args:
      logp_bt: floating [B, T] log pi_theta of the response tokens (differentiated).
      old_logp_bt: floating [B, T] log pi_old from the trainer (no gradient).
      adv_b: [B] per-sequence advantages, or [B, T] per-token ones (PPO with GAE); no gradient.
      mask_bt: [B, T] 0/1 loss mask (response tokens; truncated rows already removed if wanted).
      cfg: the objective.
      denominator: ``aggregation.loss_denominator`` of the FULL batch's mask.
      ref_logp_bt: [B, T] log pi_ref; required when kl_coef > 0 and kl_in == "loss"; when given
        the KL metric is reported whatever kl_in is.
      sampler_logp_bt: [B, T] the sampler's own log-probs; required when the correction's
        mode is not "none" and its source is "engine" or "both"; when given, the engine and
        composed diagnostics are reported (0 otherwise).
      behaviour_logp_bt: [B, T] the trainer's log-probs under the parameter version that
        sampled the rollouts (no gradient). None: that version is the one of ``old_logp_bt``
        (synchronous rollouts), so the staleness ratio is 1.
      entropy_bt: [B, T] token entropy (``losses.compute_entropy``), differentiable; required
        when entropy_coef != 0; reported when given.
      segment_ids_bt: int [B, T] of packed rows (``algos.segments``): the sequence-level terms
        (GSPO's ratio, sequence TIS, the seq_mean aggregations) are then per segment, and
        ``adv_b`` must be per token. None: one sequence per row.
      group_ids_bt: int [B, T] shared-prompt group ids (``Batch.prompt_group_ids``), read by
        the prompt_mean_token_mean aggregation.
    Returns:
      (loss scalar float32, metrics) as described in the module docstring.
    """
    loss_config.expect_array(logp_bt, "logp_bt", rank=2, kind="float")
    shape = logp_bt.shape
    loss_config.expect_array(old_logp_bt, "old_logp_bt", shape=shape, kind="float")
    loss_config.expect_array(adv_b, "adv_b", rank={1, 2}, kind="real")
    loss_config.expect_array(adv_b, "adv_b", shape=shape[: adv_b.ndim])
    loss_config.expect_array(mask_bt, "mask_bt", shape=shape, kind="mask")
    loss_config.expect_array(denominator, "denominator", rank=0)
    for name, x in [
        ("ref_logp_bt", ref_logp_bt),
        ("sampler_logp_bt", sampler_logp_bt),
        ("behaviour_logp_bt", behaviour_logp_bt),
        ("entropy_bt", entropy_bt),
    ]:
        if x is not None:
            loss_config.expect_array(x, name, shape=shape, kind="float")
    if segment_ids_bt is not None:
        loss_config.expect_array(segment_ids_bt, "segment_ids_bt", shape=shape, kind="int")
        loss_config.expect_array(adv_b, "adv_b", shape=shape)
    if cfg.kl_coef > 0 and cfg.kl_in == "loss" and ref_logp_bt is None:
        raise ValueError("kl_coef > 0 with kl_in='loss' requires `ref_logp_bt`")
    corr = cfg.correction
    if corr.uses_sampler and sampler_logp_bt is None:
        raise ValueError(
            f"correction mode={corr.mode!r} source={corr.source!r} requires `sampler_logp_bt`"
        )
    if cfg.entropy_coef != 0 and entropy_bt is None:
        raise ValueError("entropy_coef != 0 requires `entropy_bt`")

    valid = jnp.asarray(mask_bt) != 0
    m = jnp.asarray(mask_bt).astype(_f32)
    clamp = cfg.log_ratio_clamp
    lp = logp_bt.astype(_f32)
    old = jax.lax.stop_gradient(old_logp_bt.astype(_f32))
    # where() before any arithmetic: padded positions may hold -inf/NaN log-probs.
    diff = jnp.where(valid, lp - old, 0.0)
    if cfg.ratio_level == "sequence":
        # GSPO: s_i = (pi/pi_old)^(1/|y_i|), the same for every token of the sequence.
        # Packed rows: the mean over each token's own segment.
        diff = jnp.broadcast_to(segments.segment_mean(diff, m, segment_ids_bt), shape)
    ratio = jnp.exp(jnp.clip(diff, -clamp, clamp))

    adv = jax.lax.stop_gradient(jnp.asarray(adv_b).astype(_f32))
    adv = adv[:, None] if adv.ndim == 1 else adv
    adv = jnp.broadcast_to(adv, shape)
    surr = ratio * adv
    if cfg.clip:
        surr_clip = jnp.clip(ratio, 1.0 - cfg.clip_eps_low, 1.0 + cfg.clip_eps_high) * adv
    else:
        surr_clip = surr  # min(surr, surr) = surr: the unclipped objective, never "clipped"
    pg = -jnp.minimum(surr, surr_clip)
    clipped = surr_clip < surr  # the constant branch won: zero gradient on this token
    if cfg.dual_clip is not None:
        cap = -cfg.dual_clip * adv
        dual = (adv < 0) & (pg > cap)
        pg = jnp.where(dual, cap, pg)
    else:
        dual = jnp.zeros(shape, bool)

    behaviour = old if behaviour_logp_bt is None else behaviour_logp_bt.astype(_f32)
    behaviour = jax.lax.stop_gradient(behaviour)
    corr_stats: dict[str, jax.Array] = {}
    log_ratios = {}
    for source in importance.SOURCES:
        log_ratios[source] = importance.source_log_ratio(source, old, behaviour, sampler_logp_bt)
        corr_stats.update(
            importance.correction_metrics(
                f"offpolicy/{source}/",
                log_ratios[source],
                mask_bt,
                corr,
                log_ratio_clamp=clamp,
                segment_ids_bt=segment_ids_bt,
            )
        )
    if corr.mode != "none":
        w = importance.correction_weights(
            log_ratios[corr.source],
            mask_bt,
            corr,
            log_ratio_clamp=clamp,
            segment_ids_bt=segment_ids_bt,
        )[0]
    else:
        w = jnp.ones(shape, _f32)
    if sampler_logp_bt is not None:
        gap = aggregation.masked_rows(jnp.abs(old - sampler_logp_bt.astype(_f32)), mask_bt)
    else:
        gap = jnp.zeros(shape, _f32)
    corr_stats["offpolicy/weight_sum"] = jnp.sum(aggregation.masked_rows(w, mask_bt))
    corr_stats["logp_diff_abs_sum"] = jnp.sum(gap)
    corr_stats["logp_diff_abs_max"] = jnp.max(gap, initial=0.0)
    pg = pg * w

    zeros = jnp.zeros(shape, _f32)
    kl_t = (
        kl.kl_estimate(lp, ref_logp_bt, cfg.kl_estimator, log_ratio_clamp=clamp, mask_bt=mask_bt)
        if ref_logp_bt is not None
        else zeros
    )
    kl_term = cfg.kl_coef * kl_t if cfg.kl_in == "loss" else zeros
    ent = entropy_bt.astype(_f32) if entropy_bt is not None else zeros

    per_token = pg + kl_term - cfg.entropy_coef * ent

    def agg(x: jax.Array) -> jax.Array:
        return aggregation.aggregate(x, mask_bt, cfg, denominator, segment_ids_bt, group_ids_bt)

    loss = agg(per_token)

    def tsum(x: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(jnp.sum(aggregation.masked_rows(x, mask_bt)))

    sg_ratio = jax.lax.stop_gradient(ratio)
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "pg_loss": jax.lax.stop_gradient(agg(pg)),
        "kl_loss": jax.lax.stop_gradient(agg(kl_term)),
        "token_count": jnp.sum(m),
        "clip_frac_sum": tsum(clipped.astype(_f32)),
        "clip_low_frac_sum": tsum(((sg_ratio < 1.0 - cfg.clip_eps_low) & (adv < 0)).astype(_f32)),
        "clip_high_frac_sum": tsum(((sg_ratio > 1.0 + cfg.clip_eps_high) & (adv > 0)).astype(_f32)),
        "dual_clip_frac_sum": tsum(dual.astype(_f32)),
        "kl_sum": tsum(kl_t),
        "entropy_sum": tsum(ent),
        "ratio_sum": tsum(sg_ratio),
        "ratio_max": jnp.max(jnp.where(valid, sg_ratio, 0.0), initial=0.0),
        "ratio_min": jnp.min(jnp.where(valid, sg_ratio, jnp.inf), initial=jnp.inf),
        "seq_count": jnp.sum(segments.last_valid(mask_bt, segment_ids_bt).astype(_f32)),
        **corr_stats,
    }
    return loss, metrics


def accumulate_metrics(
    acc: dict[str, jax.Array] | None, new: dict[str, jax.Array]
) -> dict[str, jax.Array]:
    """Combine two microbatches' metrics: max for ``_max``, min for ``_min``, add otherwise.

    ``acc=None`` starts the accumulation with ``new``. Jit- and ``lax.scan``-friendly.
    """
    if acc is None:
        return dict(new)
    if acc.keys() != new.keys():
        raise ValueError(f"metric keys differ: {sorted(acc)} vs {sorted(new)}")
    out = {}
    for key, value in new.items():
        if key.endswith("_max"):
            out[key] = jnp.maximum(acc[key], value)
        elif key.endswith("_min"):
            out[key] = jnp.minimum(acc[key], value)
        else:
            out[key] = acc[key] + value
    return out


def metrics_identity(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The neutral element of ``accumulate_metrics`` for metrics shaped like ``metrics``.

    0 for summed keys, -inf for ``_max``, +inf for ``_min``: a ready ``lax.scan`` carry init
    (``metrics`` may be the output of ``jax.eval_shape`` on ``policy_loss``).
    """
    out = {}
    for key, value in metrics.items():
        fill = -jnp.inf if key.endswith("_max") else jnp.inf if key.endswith("_min") else 0.0
        out[key] = jnp.full(jnp.shape(value), fill, _f32)
    return out


def finalize_metrics(acc: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Turn accumulated metrics into means: ``x_sum`` -> ``x`` = x_sum / max(token_count, 1),
    ``x_seqsum`` -> ``x`` = x_seqsum / max(seq_count, 1), and every source's ``ess``
    (``importance.finalize``; its squared-weight sum is dropped).

    ``_max`` / ``_min`` keys are kept (reported as 0 when there was no valid token), the already
    normalised losses, ``token_count`` and ``seq_count`` pass through.
    """
    acc = importance.finalize(acc)
    count = acc["token_count"]
    seqs = acc.get("seq_count", jnp.ones((), _f32))
    out = {}
    for key, value in acc.items():
        if key.endswith("/is_w2_sum"):
            continue
        if key.endswith("_seqsum"):
            out[key[: -len("_seqsum")]] = value / jnp.maximum(seqs, 1.0)
        elif key.endswith("_sum"):
            out[key[: -len("_sum")]] = value / jnp.maximum(count, 1.0)
        elif key.endswith(("_max", "_min")):
            out[key] = jnp.where(count > 0, value, 0.0)
        else:
            out[key] = value
    return out
