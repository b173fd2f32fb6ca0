"""Off-policy correction: importance weights for engine mismatch and staleness, and diagnostics.

The tokens of a rollout were drawn by the sampler, yet the loss treats them as drawn by the
policy it corrects against. Two gaps separate those (``loss_config.CorrectionConfig``):

    engine     log pi_behaviour - log pi_sampler   same weights, different numerics (vLLM, bf16)
    staleness  log pi_old - log pi_behaviour       the weights moved on (asynchronous rollouts)
    both       log pi_old - log pi_sampler         the sum of the two

(pi_behaviour: the trainer's log-probs under the parameter version that sampled; pi_old: under
the parameters the step starts from.) ``correction_weights`` turns a per-token log-ratio into
the weight w that multiplies each token's policy-gradient term: at token, sequence (sum of the
log-ratios over each sequence) or geometric-mean (their mean) level, truncated (Yao et al. 2025,
"Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"), masked to a band
(rejection sampling as in verl's rollout correction) or masked to a band keeping the ratio
(IcePop, Ling Team 2025, "Every Step Evolves"). The weight is a constant (no gradient).

``correction_metrics`` reports, for one source, what the correction sees: the mismatch KL
KL(pi_b || pi_t) estimated on the sampled tokens with k1 = -d and k3 = expm1(d) - d (``kl.k3``)
(Schulman's estimators, d = log pi_t - log pi_b), the level ratio's largest and smallest value,
its effective sample size ESS = (sum w)^2 / (n sum w^2) in (0, 1] (Kong 1992; verl reports the
same normalised form), and the fractions of tokens and of sequences that the configured mode
masks or truncates. Every value is a sum (or max/min) that adds exactly over microbatches
(``policy_loss`` metrics contract); ``finalize`` turns them into means and the ESS.

The policy loss's denominators are not changed by a masked token: its weight is 0, so it adds
nothing, and the batch normalises as before (TRL's and NeMo-RL's choice; verl's rejection
instead drops the token from the response mask). That keeps the loss exact under microbatching.

Not here: where the log-probs come from (``phases.rl``: the sampler's with every completion,
the behaviour version's from kept parameter versions) and the loss itself (``policy_loss``).
"""

import jax
import jax.numpy as jnp

from jaxrlvr.algos import aggregation, kl, loss_config, segments

_f32 = jnp.float32
SOURCES = ("engine", "staleness", "both")


def level_log_ratio(
    log_ratio_bt: jax.Array,
    mask_bt: jax.Array,
    level: loss_config.CorrectionLevel,
    segment_ids_bt: jax.Array | None = None,
) -> jax.Array:
    """The log-ratio at ``level``, float32 [B, T], 0 outside the mask.

    token: d_t; sequence: sum of d over the token's sequence (segment); geometric: its masked
    mean. Only masked-in tokens enter the sums (padding and environment tokens never do).
    """
    loss_config.expect_array(log_ratio_bt, "log_ratio_bt", rank=2, kind="float")
    loss_config.expect_array(mask_bt, "mask_bt", shape=log_ratio_bt.shape, kind="mask")
    loss_config.check_literal("level", level, loss_config.CorrectionLevel)
    d = aggregation.masked_rows(log_ratio_bt, mask_bt)
    if level == "sequence":
        d = segments.segment_sums(d, segment_ids_bt)
    elif level == "geometric":
        d = segments.segment_mean(d, mask_bt, segment_ids_bt)
    d = jnp.broadcast_to(d, log_ratio_bt.shape)
    return jnp.where(jnp.asarray(mask_bt) != 0, d, 0.0)


def correction_weights(
    log_ratio_bt: jax.Array,
    mask_bt: jax.Array,
    cfg: loss_config.CorrectionConfig,
    *,
    log_ratio_clamp: float = 20.0,
    segment_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(w, masked, truncated, r), float32 [B, T], none of them differentiable.

    r = exp(clip(level log-ratio, +-log_ratio_clamp)); with (low, high) = ``cfg.band``:
    none: w = 1; truncate: w = clip(r, low, high); mask: w = 1[low <= r <= high];
    icepop: w = r 1[low <= r <= high]. ``masked`` is 1 where mask/icepop zeroed the token,
    ``truncated`` 1 where truncate moved r; both are 0 outside ``mask_bt`` (w is 1 there).

    Args:
      log_ratio_bt: floating [B, T] per-token log pi_target - log pi_behaviour.
      mask_bt: [B, T] loss mask (honoured as given: several response spans per row are fine).
      cfg: the correction (its ``source`` is the caller's business).
      segment_ids_bt: int [B, T] of packed rows: sequence levels are per segment.
    """
    loss_config.expect_array(log_ratio_bt, "log_ratio_bt", rank=2, kind="float")
    loss_config.expect_array(mask_bt, "mask_bt", shape=log_ratio_bt.shape, kind="mask")
    if segment_ids_bt is not None:
        loss_config.expect_array(
            segment_ids_bt, "segment_ids_bt", shape=log_ratio_bt.shape, kind="int"
        )
    valid = jnp.asarray(mask_bt) != 0
    d = level_log_ratio(jax.lax.stop_gradient(log_ratio_bt), mask_bt, cfg.level, segment_ids_bt)
    r = jnp.exp(jnp.clip(d, -log_ratio_clamp, log_ratio_clamp))
    low, high = cfg.band
    outside = valid & ((r > high) | (r < low))
    zeros = jnp.zeros(r.shape, _f32)
    if cfg.mode == "none":
        w, masked, truncated = jnp.ones(r.shape, _f32), zeros, zeros
    elif cfg.mode == "truncate":
        w, masked, truncated = jnp.clip(r, low, high), zeros, outside.astype(_f32)
    elif cfg.mode == "mask":
        w, masked, truncated = jnp.where(outside, 0.0, 1.0), outside.astype(_f32), zeros
    else:  # icepop
        w, masked, truncated = jnp.where(outside, 0.0, r), outside.astype(_f32), zeros
    w = jnp.where(valid, w, 1.0)
    return tuple(jax.lax.stop_gradient(x) for x in (w, masked, truncated, r))


def source_log_ratio(
    source: loss_config.CorrectionSource,
    old_logp_bt: jax.Array,
    behaviour_logp_bt: jax.Array,
    sampler_logp_bt: jax.Array | None,
) -> jax.Array | None:
    """The per-token log-ratio of ``source`` (module docstring), float32 [B, T]; None when the
    source needs the sampler's log-probs and there are none."""
    old, behaviour = old_logp_bt.astype(_f32), behaviour_logp_bt.astype(_f32)
    if source == "staleness":
        return old - behaviour
    if sampler_logp_bt is None:
        return None
    sampler = sampler_logp_bt.astype(_f32)
    return (behaviour if source == "engine" else old) - sampler


def metric_keys(prefix: str) -> tuple[str, ...]:
    """The keys ``correction_metrics`` returns under ``prefix`` (e.g. "offpolicy/engine/")."""
    names = (
        "k1_sum",
        "k3_sum",
        "is_w_sum",
        "is_w2_sum",
        "masked_sum",
        "truncated_sum",
        "seq_masked_seqsum",
        "seq_truncated_seqsum",
        "ratio_max",
        "ratio_min",
    )
    return tuple(prefix + n for n in names)


def correction_metrics(
    prefix: str,
    log_ratio_bt: jax.Array | None,
    mask_bt: jax.Array,
    cfg: loss_config.CorrectionConfig,
    *,
    log_ratio_clamp: float = 20.0,
    segment_ids_bt: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """One source's diagnostics (module docstring) as microbatch-summable float32 scalars.

    Token sums (``_sum``: divide by the token count), sequence sums (``_seqsum``: divide by the
    number of sequences with a loss token, ``seq_count``), and ``ratio_max`` / ``ratio_min`` of
    the level ratio. A sequence counts as masked / truncated when any of its tokens is.
    ``log_ratio_bt`` None (the source is unavailable): every value is 0.
    """
    keys = metric_keys(prefix)
    if log_ratio_bt is None:
        zero = jnp.zeros((), _f32)
        return dict.fromkeys(keys, zero)
    loss_config.expect_array(log_ratio_bt, "log_ratio_bt", rank=2, kind="float")
    loss_config.expect_array(mask_bt, "mask_bt", shape=log_ratio_bt.shape, kind="mask")
    valid = jnp.asarray(mask_bt) != 0
    d = jax.lax.stop_gradient(
        jnp.clip(aggregation.masked_rows(log_ratio_bt, mask_bt), -log_ratio_clamp, log_ratio_clamp)
    )
    _, masked, truncated, r = correction_weights(
        log_ratio_bt, mask_bt, cfg, log_ratio_clamp=log_ratio_clamp, segment_ids_bt=segment_ids_bt
    )

    def tsum(x):
        return jnp.sum(aggregation.masked_rows(x, mask_bt))

    last = segments.last_valid(mask_bt, segment_ids_bt)

    def seq_any(x):  # sequences with at least one flagged token, counted at their last token
        per_seq = segments.segment_sums(aggregation.masked_rows(x, mask_bt), segment_ids_bt)
        return jnp.sum(jnp.where(last, jnp.broadcast_to(per_seq, x.shape) > 0, False))

    vals = (
        tsum(-d),
        tsum(kl.k3(d)),
        tsum(r),
        tsum(r * r),
        tsum(masked),
        tsum(truncated),
        seq_any(masked),
        seq_any(truncated),
        jnp.max(jnp.where(valid, r, -jnp.inf), initial=-jnp.inf),
        jnp.min(jnp.where(valid, r, jnp.inf), initial=jnp.inf),
    )
    return {k: jnp.asarray(v, _f32) for k, v in zip(keys, vals)}


def finalize(metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """The effective sample size of every source from its accumulated weight sums: for each
    ``P/is_w_sum`` and ``P/is_w2_sum``, ``P/ess`` = (sum w)^2 / (n sum w^2) (1 when every weight
    is equal, 1/n when one token holds all the weight; 0 without tokens). ``n`` is
    ``token_count``. Keys are returned unchanged besides the added ones."""
    out = dict(metrics)
    n = metrics.get("token_count")
    for key in metrics:
        if key.endswith("/is_w_sum") and n is not None:
            prefix = key[: -len("is_w_sum")]
            s1, s2 = metrics[key], metrics[prefix + "is_w2_sum"]
            out[prefix + "ess"] = jnp.where(s2 > 0, s1 * s1 / jnp.maximum(n * s2, 1e-30), 0.0)
    return out
