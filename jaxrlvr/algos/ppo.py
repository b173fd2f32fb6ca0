"""PPO with GAE (Schulman et al. 2016, 2017): its config, the update and the record.

The update is the clipped policy loss (``policy_gradient.policy_terms``) on GAE advantages plus
``vf_coef`` times the clipped value loss (``gae.value_loss``); the critic is a value head on the
policy trunk (shared or detached) or a separate critic model (``value``). Advantages and returns
are computed on the full batch (``ppo_advantages``) before the microbatch scan.

Not here: the value head and critic model (``value``), GAE itself (``gae``), the engine
(``engine``).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrlvr.algos import (
    aggregation,
    engine,
    gae,
    kl,
    loss_config,
    policy_gradient,
    registry,
    value,
)
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import batch as batch_lib

_f32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
    """PPO's own settings (Schulman et al. 2016, 2017), apart from the policy loss.

    gamma, lam: discount and GAE lambda.
    value_clip: clip range of the value loss around ``old_values`` (None: unclipped).
    vf_coef: weight of the value loss in the total loss. With ``trunk="separate"`` the two
        losses share no parameter, so it only scales the critic's gradient (its optimiser and
        gradient clipping are its own).
    normalize_advantages: whiten the GAE advantages over the valid tokens of the full batch.
    trunk: where the value head reads its hidden states (``value.Trunk``): "shared" (the policy
        trunk; the value loss also trains it), "detached" (the policy trunk; only the head
        learns) or "separate" (a critic model of its own, ``value.init_value_model``).
    """

    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float | None = 0.2
    vf_coef: float = 0.1
    normalize_advantages: bool = True
    trunk: value.Trunk = "shared"

    def __post_init__(self) -> None:
        loss_config.check_literal("trunk", self.trunk, value.Trunk)
        if not 0 <= self.gamma <= 1:
            raise ValueError(f"gamma must be in [0, 1], got {self.gamma!r}")
        if not 0 <= self.lam <= 1:
            raise ValueError(f"lam must be in [0, 1], got {self.lam!r}")
        if self.value_clip is not None and not self.value_clip > 0:
            raise ValueError(f"value_clip must be None or > 0, got {self.value_clip!r}")
        if not self.vf_coef >= 0:
            raise ValueError(f"vf_coef must be >= 0, got {self.vf_coef!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOUpdateConfig(PPOConfig):
    """The PPO update: ``PPOConfig`` plus the policy objective and microbatching.

    loss: the policy objective; with ``kl_in="reward"`` and ``kl_coef > 0`` the KL to the
        reference (on ``old_logp``) is subtracted from every token's reward (InstructGPT).
    logprob_chunk_size: as ``sft.SFTUpdateConfig``.
    """

    loss: loss_config.PolicyLossConfig = dataclasses.field(
        default_factory=loss_config.PolicyLossConfig
    )
    num_microbatches: int = 1
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        engine.check_microbatches(self.num_microbatches)
        engine.check_chunk_size(self.logprob_chunk_size)


def _update_fields(cfg: PPOUpdateConfig) -> tuple[str, ...]:
    """What ``prepare`` adds that the PPO update requires: rollout-time values, the old policy's
    log-probs and, for a KL term (in the reward or the loss), the reference's."""
    return ("old_values", "old_logp") + (("ref_logp",) if cfg.loss.kl_coef > 0 else ())


def ppo_advantages(batch: batch_lib.Batch, cfg: PPOUpdateConfig) -> tuple[jax.Array, jax.Array]:
    """GAE advantages and returns [B, T] of a PPO batch (full batch, before microbatching).

    Rewards per token: ``gae.ppo_token_rewards`` (task reward on the last response token, minus
    kl_coef * KL(old || ref) per token when ``kl_in == "reward"``); then ``gae.compute_gae`` on
    ``old_values``; optionally whitened over the valid tokens.
    """
    mask = batch.loss_mask
    loss = cfg.loss
    if loss.kl_in == "reward" and loss.kl_coef > 0:
        kl_bt = kl.kl_estimate(
            batch.old_logp,
            batch.ref_logp,
            loss.kl_estimator,
            log_ratio_clamp=loss.log_ratio_clamp,
            mask_bt=mask,
        )
        beta = loss.kl_coef
    else:
        kl_bt, beta = jnp.zeros(mask.shape, _f32), 0.0
    seg = batch.segment_ids
    rewards_bt = gae.ppo_token_rewards(batch.rewards, kl_bt, mask, beta, segment_ids_bt=seg)
    adv, returns = gae.compute_gae(
        rewards_bt, batch.old_values, mask, cfg.gamma, cfg.lam, segment_ids_bt=seg
    )
    if cfg.normalize_advantages:
        m = mask.astype(_f32)
        n = jnp.maximum(jnp.sum(m), 1.0)
        mean = jnp.sum(adv * m) / n
        var = jnp.sum(jnp.square(adv - mean) * m) / n
        adv = jnp.where(m != 0, (adv - mean) * jax.lax.rsqrt(var + 1e-8), 0.0)
    return adv, returns


def make_ppo_update(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    value_tx: optax.GradientTransformation,
    cfg: PPOUpdateConfig | None = None,
    *,
    lr_schedule: engine.LRSchedule = None,
    value_graphdef: nnx.GraphDef | None = None,
    mesh: Any = None,
) -> Callable:
    """PPO update (one epoch): clipped policy loss on GAE advantages + vf_coef * clipped value loss.

    The state must carry ``value_params`` and ``value_opt_state`` (of ``value_tx``):
    ``value.init_value_head`` for ``trunk="shared"``/``"detached"``; for ``trunk="separate"``
    the critic of ``value.init_value_model``, whose graph definition is passed here as
    ``value_graphdef`` (static, like ``graphdef``). The batch needs ``rewards`` [B],
    ``old_values`` [B, T] (from ``value.make_value_fn`` at rollout time) and ``old_logp``;
    ``ref_logp`` when ``kl_coef > 0``. Advantages and returns are computed on the full batch
    (``ppo_advantages``) before the microbatch scan; the value loss is normalised by the full
    batch's loss-token count. A separate critic runs its own forward pass inside the same
    microbatch scan; its gradient is exactly vf_coef * grad(value loss).
    """
    cfg = cfg or PPOUpdateConfig()
    separate = cfg.trunk == "separate"
    if separate != (value_graphdef is not None):
        raise ValueError(
            f"make_ppo_update: trunk={cfg.trunk!r} "
            + (
                "needs value_graphdef (from value.init_value_model)"
                if separate
                else "takes no value_graphdef (only trunk='separate' has a critic model)"
            )
        )
    _, spec = policy_gradient.policy_specs(
        cfg.loss, ("rewards",), _update_fields(cfg), cfg.num_microbatches
    )
    entropy_grad = cfg.loss.entropy_coef != 0
    token_mean = dataclasses.replace(cfg.loss, aggregation="token_mean", norm_constant=None)

    def full_batch(batch):
        adv_bt, returns_bt = ppo_advantages(batch, cfg)
        denom = aggregation.loss_denominator(
            batch.loss_mask, cfg.loss, batch.segment_ids, batch.prompt_group_ids
        )
        v_denom = aggregation.loss_denominator(batch.loss_mask, token_mean)
        return (batch, adv_bt, returns_bt), (denom, v_denom)

    def loss_fn(both, xs, consts):
        params, value_params = both
        mb, adv, returns = xs
        denom, v_denom = consts
        lm = nnx.merge(graphdef, params)
        logp, ent, hidden = engine.token_logprobs(
            lm, mb, entropy_grad=entropy_grad, chunk_size=cfg.logprob_chunk_size
        )
        if separate:
            # The critic's own trunk: no parameter in common with the policy, so each loss's
            # gradient reaches only its own model.
            values = value.value_model_values(
                value_graphdef,
                value_params,
                mb.input_ids,
                mb.attention_mask,
                positions_bt=mb.positions,
                segment_ids_bt=mb.segment_ids,
                prompt_group_ids_bt=mb.prompt_group_ids,
            )
        else:
            if cfg.trunk == "detached":
                hidden = jax.lax.stop_gradient(hidden)
            values = value.values_from_hidden(value_params, hidden)
        p_loss, metrics = policy_gradient.policy_terms(
            logp, ent, mb, adv, mb.loss_mask, cfg.loss, denom
        )
        v_loss, v_metrics = gae.value_loss(
            values, mb.old_values, returns, mb.loss_mask, cfg.value_clip, denominator=v_denom
        )
        total = p_loss + cfg.vf_coef * v_loss
        m = mb.loss_mask
        metrics.update(v_metrics)
        metrics.update(
            loss=jax.lax.stop_gradient(total),
            vf_loss=jax.lax.stop_gradient(v_loss),
            advantage_mean_sum=jnp.sum(aggregation.masked_rows(adv, m)),
            return_mean_sum=jnp.sum(aggregation.masked_rows(returns, m)),
            value_mean_sum=jax.lax.stop_gradient(jnp.sum(aggregation.masked_rows(values, m))),
        )
        return total, metrics

    return engine.make_update(
        spec=spec,
        tx=tx,
        lr_schedule=lr_schedule,
        mesh=mesh,
        full_batch=full_batch,
        loss_fn=loss_fn,
        value_tx=value_tx,
    )


def ppo_algorithm(
    graphdef: nnx.GraphDef,
    optimizer: algorithm_lib.Optimizer,
    cfg: PPOUpdateConfig | None = None,
    *,
    params_shape: nnx.State | None = None,
    mesh: Any = None,
    value_optimizer: algorithm_lib.Optimizer | None = None,
    logprob_microbatches: int | None = None,
    epochs_per_batch: int = 1,
    reference_routes: str = "auto",
) -> algorithm_lib.Algorithm:
    """PPO with GAE (``make_ppo_update``), the critic built by ``init``, each batch trained
    ``epochs_per_batch`` times per ``update`` call (``algorithm.with_epochs``).

    ``cfg.trunk`` "shared"/"detached": a zero-initialised value head on the policy's hidden
    states; "separate": a critic model copied from the policy's weights at ``init`` (verl's
    default), whose graph definition is derived here from ``params_shape`` (the policy's params
    or their ``jax.ShapeDtypeStruct`` shapes; required for "separate"). The critic's optimiser
    is ``value_optimizer`` (default: the policy's settings). ``prepare`` computes ``old_logp``,
    ``ref_logp`` (KL) and the rollout-time ``old_values``.
    """
    cfg = cfg or PPOUpdateConfig()
    value_tx, _ = algorithm_lib.resolve_optimizer(
        optimizer if value_optimizer is None else value_optimizer
    )
    value_graphdef = None
    if cfg.trunk == "separate":
        if params_shape is None:
            raise ValueError("ppo(trunk='separate'): pass params_shape (the policy's params)")
        value_graphdef = value.critic_graphdef(graphdef, params_shape)
    value_fn = value.make_value_fn(graphdef, value_graphdef=value_graphdef)

    def critic(params, key):
        if value_graphdef is not None:
            return value.init_value_model(graphdef, params, rng=key)[1]
        return value.init_value_head(nnx.merge(graphdef, params).config.hidden_size, key)

    def rollout_values(state, batch):
        return batch.replace(old_values=value_fn(state.params, state.value_params, batch))

    def make_update(tx, schedule):
        return make_ppo_update(
            graphdef,
            tx,
            value_tx,
            cfg,
            lr_schedule=schedule,
            value_graphdef=value_graphdef,
            mesh=mesh,
        )

    return policy_gradient.policy_gradient_algorithm(
        "ppo",
        graphdef,
        optimizer,
        cfg,
        make_update,
        old=True,
        rollout_fields=("rewards",),
        update_fields=_update_fields(cfg),
        mesh=mesh,
        epochs_per_batch=epochs_per_batch,
        logprob_microbatches=logprob_microbatches,
        reference_routes=reference_routes,
        critic=critic,
        value_tx=value_tx,
        extra_pass=rollout_values,
    )


def build(cfg, graphdef, params_shape, mesh, microbatches) -> algorithm_lib.Algorithm:
    """``rl.algo: ppo`` from the run config: ``rl.ppo`` (this module's ``PPOConfig``, the record
    YAML builds) with the shared RL fields."""
    ppo_cfg = PPOUpdateConfig(
        **policy_gradient.run_fields(cfg, microbatches), **dataclasses.asdict(cfg.rl.ppo)
    )
    return ppo_algorithm(
        graphdef,
        cfg.optim,
        ppo_cfg,
        params_shape=params_shape,
        mesh=mesh,
        epochs_per_batch=cfg.rl.epochs_per_step,
        reference_routes=cfg.rl.reference_routes,
    )


registry.register(
    registry.Method(
        name="ppo",
        build=build,
        section=PPOConfig,
        asynchronous=True,
        # The critic (its trunk and head) is in the state.
        state_keys=("rl.ppo.", *policy_gradient.STATE_KEYS),
    )
)
