"""CISPO: the clipped importance-sampling-weight policy objective (MiniMax-M1, arXiv 2506.13585,
sec. 3.1), its config record, update and registration (``rl.algo: cispo``).

Per valid token, with r = pi_theta / pi_old and the advantage A of the token's sequence::

    J = (1 / denominator) sum_i sum_t sg(clip(r_it, 1 - eps_low, 1 + eps_high)) A_i log pi(o_it)

(pi = pi_theta, sg the stop-gradient); the loss is -J. PPO/GRPO clip the ratio inside a min,
which zeroes the gradient of every token whose ratio left the trust region on the side the
advantage favours (in the paper's runs, the rare "fork" tokens with large ratios); CISPO clips
only the importance weight, behind a stop-gradient, and has no min: every token keeps its
REINFORCE gradient A * grad log pi, scaled by a bounded weight. On policy (one epoch on fresh
rollouts: old = current) the weight is exactly 1 and the update is REINFORCE with the group
advantage (the same gradient as GRPO's there: CISPO differs once ratios leave 1).

The clip bounds, as the field sets them (FIELD.md "CISPO and ScaleRL"):

- ``eps_high`` is the distance of the upper bound from 1: the weight is capped at 1 + eps_high.
  Default 4.0 (cap 5): ScaleRL (arXiv 2510.13786) uses an upper bound of about 5, slime
  ``--eps-clip-high`` ~4 with ``1 + eps``, TRL's paper index ``epsilon_high=5.0`` (TRL clamps the
  ratio at ``epsilon_high`` itself). The pitfall this avoids: in TRL ``loss_type="cispo"`` the
  cap IS ``epsilon_high``, which defaults to ``epsilon`` = 0.2, so every weight is at most 0.2
  and every update is shrunk five-fold or more; here 0.2 would mean a cap of 1.2 (verl's
  example), never 0.2.
- ``eps_low`` is the distance of the lower bound from 1. Default 1.0 (bound 0): no lower bound,
  as the paper (which tunes only eps_high; verl's example sets clip_ratio_low=10, the same
  thing since r > 0). Any value >= 1 means no lower bound.

The sum is reduced by ``aggregation.aggregate`` with the loss's ``aggregation`` over the FULL
batch's denominator, so it is exact under microbatching and packing; the paper's normalisation
(by the total token count of the batch) is ``rl.loss.aggregation: token_mean``, ScaleRL's
prompt-level averaging is ``seq_mean_token_mean``. Metrics follow ``policy_loss``'s contract
(sums plus ``token_count``): ``clip_high_frac`` / ``clip_low_frac`` (tokens whose weight the bound
changed, whatever the advantage's sign), ``weight`` (mean weight), ``ratio`` / ``ratio_max`` /
``ratio_min``.

Not here: a KL term to a reference, an entropy bonus and an off-policy correction (refused:
``CISPOUpdateConfig``; ``rl.loss.clip_eps_*`` do not apply, the bounds are ``rl.cispo``'s), and
asynchronous rollouts (not registered as asynchronous; the synchronous loop with any
``rl.epochs_per_step`` is supported).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrlvr.algos import aggregation, engine, loss_config, policy_gradient, registry, segments
from jaxrlvr.algos import algorithm as algorithm_lib

_f32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class CISPOConfig:
    """CISPO's one config record (``rl.cispo`` in YAML): the weight's clip bounds
    [1 - eps_low, 1 + eps_high] (module docstring: defaults and why)."""

    eps_low: float = 1.0
    eps_high: float = 4.0

    def __post_init__(self) -> None:
        for key in ("eps_low", "eps_high"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
                raise ValueError(f"cispo.{key}={value!r}: expected a number >= 0")


def cispo_loss(
    logp_bt: jax.Array,
    old_logp_bt: jax.Array,
    adv: jax.Array,
    mask_bt: jax.Array,
    loss_cfg: loss_config.PolicyLossConfig,
    cfg: CISPOConfig,
    *,
    denominator: jax.Array | float,
    segment_ids_bt: jax.Array | None = None,
    group_ids_bt: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This microbatch's share of the CISPO loss (formula in the module docstring).

    Args:
      logp_bt: floating [B, T] log pi_theta of the response tokens (differentiated).
      old_logp_bt: floating [B, T] log pi_old (no gradient).
      adv: [B] per-sequence advantages, or [B, T] per token (packed rows); no gradient.
      mask_bt: [B, T] 0/1 loss mask.
      loss_cfg: its ``aggregation`` (and ``norm_constant``) reduce the tokens;
        ``log_ratio_clamp`` bounds |log r| before the exp.
      cfg: the clip bounds.
      denominator: ``aggregation.loss_denominator`` of the FULL batch's mask.
      segment_ids_bt: int [B, T] of packed rows (``adv`` then per token); None: a row each.
      group_ids_bt: int [B, T] shared-prompt group ids (prompt_mean_token_mean), or None.
    Returns:
      (loss scalar float32, metrics: sums plus counts, ``policy_loss``'s contract).
    """
    loss_config.expect_array(logp_bt, "logp_bt", rank=2, kind="float")
    shape = logp_bt.shape
    loss_config.expect_array(old_logp_bt, "old_logp_bt", shape=shape, kind="float")
    loss_config.expect_array(adv, "adv", rank={1, 2}, kind="real")
    loss_config.expect_array(adv, "adv", shape=shape[: adv.ndim])
    loss_config.expect_array(mask_bt, "mask_bt", shape=shape, kind="mask")
    if segment_ids_bt is not None:
        loss_config.expect_array(segment_ids_bt, "segment_ids_bt", shape=shape, kind="int")
        loss_config.expect_array(adv, "adv", shape=shape)

    valid = jnp.asarray(mask_bt) != 0
    lp = logp_bt.astype(_f32)
    old = jax.lax.stop_gradient(old_logp_bt.astype(_f32))
    # where() before any arithmetic: padded positions may hold -inf/NaN log-probs.
    lp_valid = jnp.where(valid, lp, 0.0)
    clamp = loss_cfg.log_ratio_clamp
    ratio = jax.lax.stop_gradient(jnp.exp(jnp.clip(jnp.where(valid, lp - old, 0.0), -clamp, clamp)))
    weight = jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    a = jax.lax.stop_gradient(jnp.asarray(adv).astype(_f32))
    a = jnp.broadcast_to(a[:, None] if a.ndim == 1 else a, shape)
    per_token = -weight * a * lp_valid
    loss = aggregation.aggregate(
        per_token, mask_bt, loss_cfg, denominator, segment_ids_bt, group_ids_bt
    )

    def tsum(x: jax.Array) -> jax.Array:
        return jnp.sum(aggregation.masked_rows(x.astype(_f32), mask_bt))

    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "pg_loss": jax.lax.stop_gradient(loss),
        "token_count": jnp.sum(jnp.asarray(mask_bt).astype(_f32)),
        "clip_high_frac_sum": tsum(ratio > 1.0 + cfg.eps_high),
        "clip_low_frac_sum": tsum(ratio < 1.0 - cfg.eps_low),
        "weight_sum": tsum(weight),
        "ratio_sum": tsum(ratio),
        "ratio_max": jnp.max(jnp.where(valid, ratio, 0.0), initial=0.0),
        "ratio_min": jnp.min(jnp.where(valid, ratio, jnp.inf), initial=jnp.inf),
        "seq_count": jnp.sum(segments.last_valid(mask_bt, segment_ids_bt).astype(_f32)),
    }
    return loss, metrics


@dataclasses.dataclass(frozen=True, kw_only=True)
class CISPOUpdateConfig:
    """The CISPO update: ``cispo`` (the bounds) with ``loss`` for the aggregation and the log
    ratio clamp; ``num_microbatches`` and ``logprob_chunk_size`` as ``grpo.GRPOUpdateConfig``.
    The options of ``PolicyLossConfig`` that CISPO does not apply are refused when set."""

    cispo: CISPOConfig = dataclasses.field(default_factory=CISPOConfig)
    loss: loss_config.PolicyLossConfig = dataclasses.field(
        default_factory=lambda: loss_config.PolicyLossConfig(aggregation="token_mean")
    )
    num_microbatches: int = 1
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        engine.check_microbatches(self.num_microbatches)
        engine.check_chunk_size(self.logprob_chunk_size)
        loss = self.loss
        unused = {
            "kl_coef": loss.kl_coef != 0,
            "entropy_coef": loss.entropy_coef != 0,
            "correction": loss.correction.mode != "none",
            "dual_clip": loss.dual_clip is not None,
            "ratio_level": loss.ratio_level != "token",
        }
        for key, set_ in unused.items():
            if set_:
                raise ValueError(
                    f"rl.loss.{key}={getattr(loss, key)!r} does not apply to CISPO (its bounds "
                    "are rl.cispo.eps_low / eps_high); leave it at its default"
                )


def make_cispo_update(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: CISPOUpdateConfig | None = None,
    *,
    lr_schedule: engine.LRSchedule = None,
    mesh: Any = None,
) -> Callable:
    """The CISPO update (one epoch) on per-sequence advantages: the batch needs ``advantages``;
    ``old_logp`` None (one on-policy epoch) uses the current log-probs behind a stop-gradient
    (every weight 1). Metrics: ``cispo_loss``'s, with ``policy_loss`` a copy of ``loss``."""
    cfg = cfg or CISPOUpdateConfig()
    _, spec = policy_gradient.policy_specs(cfg.loss, ("advantages",), (), cfg.num_microbatches)

    def full_batch(batch):
        return batch, aggregation.loss_denominator(
            batch.loss_mask, cfg.loss, batch.segment_ids, batch.prompt_group_ids
        )

    def loss_fn(params, mb, denom):
        lm = nnx.merge(graphdef, params)
        logp, _, _ = engine.token_logprobs(
            lm, mb, entropy_grad=False, chunk_size=cfg.logprob_chunk_size
        )
        old = mb.old_logp if mb.old_logp is not None else jax.lax.stop_gradient(logp)
        loss, metrics = cispo_loss(
            logp,
            old,
            mb.advantages,
            mb.loss_mask,
            cfg.loss,
            cfg.cispo,
            denominator=denom,
            segment_ids_bt=mb.segment_ids,
            group_ids_bt=mb.prompt_group_ids,
        )
        metrics["policy_loss"] = metrics["loss"]
        return loss, metrics

    return engine.make_update(
        spec=spec, tx=tx, lr_schedule=lr_schedule, mesh=mesh, full_batch=full_batch, loss_fn=loss_fn
    )


def cispo_algorithm(
    graphdef: nnx.GraphDef,
    optimizer: algorithm_lib.Optimizer,
    cfg: CISPOUpdateConfig | None = None,
    *,
    mesh: Any = None,
    epochs_per_batch: int = 1,
    logprob_microbatches: int | None = None,
    reference_routes: str = "auto",
) -> algorithm_lib.Algorithm:
    """CISPO as a record (``policy_gradient.policy_gradient_algorithm``): the old pass only with
    several epochs (one epoch on fresh rollouts: weight 1 without it)."""
    cfg = cfg or CISPOUpdateConfig()
    return policy_gradient.policy_gradient_algorithm(
        "cispo",
        graphdef,
        optimizer,
        cfg,
        lambda tx, schedule: make_cispo_update(graphdef, tx, cfg, lr_schedule=schedule, mesh=mesh),
        old=epochs_per_batch > 1,
        mesh=mesh,
        epochs_per_batch=epochs_per_batch,
        logprob_microbatches=logprob_microbatches,
        reference_routes=reference_routes,
    )


def build(cfg, graphdef, params_shape, mesh, microbatches) -> algorithm_lib.Algorithm:
    """``rl.algo: cispo`` from the run config: ``rl.cispo`` with the shared RL fields."""
    del params_shape
    return cispo_algorithm(
        graphdef,
        cfg.optim,
        CISPOUpdateConfig(cispo=cfg.rl.cispo, **policy_gradient.run_fields(cfg, microbatches)),
        mesh=mesh,
        epochs_per_batch=cfg.rl.epochs_per_step,
        reference_routes=cfg.rl.reference_routes,
    )


def check_run(rl) -> None:
    """When the config is read: group advantages need 2 samples per prompt, and the loss
    options CISPO does not apply are refused (``CISPOUpdateConfig``)."""
    if rl.group_size < 2:
        raise ValueError(
            f"group_size={rl.group_size}: CISPO's group advantages need at least 2 samples per "
            "prompt"
        )
    CISPOUpdateConfig(cispo=rl.cispo, loss=rl.policy_loss)


registry.register(registry.Method(name="cispo", build=build, section=CISPOConfig, check=check_run))
