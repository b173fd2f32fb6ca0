"""What the policy-gradient methods share (GRPO, PPO, distillation, CISPO): the batch specs, the
policy objective on one microbatch, the old / reference log-prob passes of ``prepare``, the record
skeleton (``policy_gradient_algorithm``) and the run config's common update fields
(``run_fields``).

``policy_specs`` is the one place that decides which log-prob fields a policy-gradient method
reads: the sampler's log-probs are required by an off-policy correction that reads them
(``loss.correction`` with source "engine" or "both") and otherwise used for the engine
diagnostics when present; ``behaviour_logp`` (the trainer's log-probs under the version that
sampled, which the RL phase adds to a stale batch) is always optional; the reference's are
required when the KL term is in the loss; ``old_logp`` is optional (None: one on-policy epoch,
ratio 1) unless the method says otherwise.

Not here: the loss math (``policy_loss``), the update skeleton (``engine``) and each method's
own update and registration (``grpo``, ``ppo``, ``distill``, ``cispo``).
"""

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import engine, loss_config, policy_loss, routing
from jaxrlvr.algos import state as state_lib
from jaxrlvr.model import lora

Metrics = dict[str, jax.Array]
LOGPROB_FIELDS = ("ref_logp", "sampler_logp", "old_logp", "behaviour_logp")


def policy_specs(
    loss: loss_config.PolicyLossConfig,
    rollout_fields: tuple[str, ...],
    update_fields: tuple[str, ...],
    num_microbatches: int,
) -> tuple[batch_lib.BatchSpec, batch_lib.BatchSpec]:
    """(rollout_spec, batch_spec) of a policy-gradient method.

    Args:
      loss: the policy objective (its ``correction``, ``kl_coef`` and ``kl_in`` decide the
        log-prob fields).
      rollout_fields: what the host computes for every rollout (GRPO's ``advantages``, PPO's
        ``rewards``); required by both specs.
      update_fields: what ``prepare`` adds and the update requires (PPO's ``old_values``,
        ``old_logp``, and ``ref_logp`` for its reward KL).
      num_microbatches: the update's microbatches (both specs carry it).
    """
    tis = ("sampler_logp",) if loss.correction.uses_sampler else ()
    ref = ("ref_logp",) if loss.kl_coef > 0 and loss.kl_in == "loss" else ()
    rollout = batch_lib.BatchSpec(
        required=rollout_fields + tis,
        optional=() if tis else ("sampler_logp",),
        num_microbatches=num_microbatches,
    )
    required = tuple(dict.fromkeys(rollout_fields + update_fields + ref + tis))
    update = batch_lib.BatchSpec(
        required=required,
        optional=tuple(f for f in LOGPROB_FIELDS if f not in required),
        num_microbatches=num_microbatches,
    )
    return rollout, update


def policy_terms(
    logp_bt: jax.Array,
    entropy_bt: jax.Array,
    mb: batch_lib.Batch,
    adv: jax.Array,
    mask_bt: jax.Array,
    loss_cfg: loss_config.PolicyLossConfig,
    denominator: jax.Array,
) -> tuple[jax.Array, Metrics]:
    """One microbatch's share of the policy objective (``policy_loss.policy_loss``) and its
    metric sums, ``policy_loss`` added as a copy of ``loss``. ``mb.old_logp`` None (one
    on-policy epoch) uses ``logp_bt`` behind a stop-gradient: ratio exactly 1."""
    old = mb.old_logp if mb.old_logp is not None else jax.lax.stop_gradient(logp_bt)
    loss, metrics = policy_loss.policy_loss(
        logp_bt,
        old,
        adv,
        mask_bt,
        loss_cfg,
        denominator=denominator,
        ref_logp_bt=mb.ref_logp,
        sampler_logp_bt=mb.sampler_logp,
        behaviour_logp_bt=mb.behaviour_logp,
        entropy_bt=entropy_bt,
        segment_ids_bt=mb.segment_ids,
        group_ids_bt=mb.prompt_group_ids,
    )
    metrics = dict(metrics)
    metrics["policy_loss"] = metrics["loss"]
    return loss, metrics


def policy_passes(
    logprob_fn: Callable,
    state: state_lib.TrainState,
    rollouts: batch_lib.Batch,
    *,
    old: bool = True,
    reference_routes: str = "auto",
) -> tuple[batch_lib.Batch, Metrics]:
    """The rollouts with ``old_logp`` (the current policy's; skipped when ``old`` is False) and,
    when the state holds a KL reference, ``ref_logp``.

    MoE routes (``rollouts.routes``) are replayed in the old pass; in the reference's only as
    ``reference_routes`` says (``routing.reference_batch``: "auto", the default, replays under
    LoRA only; "replay"; "live"), so by default the KL penalty compares with the reference under
    its own experts, not the sampler's (R3) or the policy's (R2).

    The sampler/trainer gap needs no pass of its own: the update reports it as ``logp_diff_abs``
    (mean over loss tokens), ``logp_diff_abs_max`` and the ``offpolicy/*`` diagnostics whenever
    the batch carries the sampler's log-probs (against ``old_logp``, or against the current
    log-probs on policy). The behaviour version's log-probs of a stale batch are this same pass
    run with that version's parameters (``phases.rl``).
    """
    old_logp = logprob_fn(state.params, rollouts)[0] if old else None
    ref = state.reference_params()
    ref_logp = None
    if ref is not None:
        at = routing.reference_batch(
            rollouts, reference_routes, lora=lora.has_adapters(state.params)
        )
        ref_logp = logprob_fn(ref, at)[0]
    return rollouts.replace(old_logp=old_logp, ref_logp=ref_logp), {}


# The config key whose change a checkpointed policy-gradient state cannot follow: the frozen KL
# reference is in the state only when ``loss.kl_coef`` > 0.
STATE_KEYS = ("rl.loss.kl_coef",)


def run_fields(cfg: Any, microbatches: int) -> dict[str, Any]:
    """The update-config fields every policy-gradient method takes from the run config:
    ``loss`` (``rl.policy_loss``: with the async default correction), ``num_microbatches`` and
    ``logprob_chunk_size``."""
    return {
        "loss": cfg.rl.policy_loss,
        "num_microbatches": microbatches,
        "logprob_chunk_size": cfg.rl.logprob_chunk_size,
    }


def policy_gradient_algorithm(
    name: str,
    graphdef: nnx.GraphDef,
    optimizer: algorithm_lib.Optimizer,
    cfg: Any,
    make_update: Callable[[optax.GradientTransformation, engine.LRSchedule], Callable],
    *,
    old: bool,
    rollout_fields: tuple[str, ...] = ("advantages",),
    update_fields: tuple[str, ...] = (),
    rollout_spec: batch_lib.BatchSpec | None = None,
    mesh: Any = None,
    epochs_per_batch: int = 1,
    logprob_microbatches: int | None = None,
    critic: Callable[[nnx.State, jax.Array], object] | None = None,
    value_tx: optax.GradientTransformation | None = None,
    extra_pass: Callable[[state_lib.TrainState, batch_lib.Batch], batch_lib.Batch] | None = None,
    reference_routes: str = "auto",
) -> algorithm_lib.Algorithm:
    """The record skeleton of a policy-gradient method, in one order: resolve the optimiser,
    build the one-epoch update (``make_update(tx, schedule)``; ``cfg``: the method's update
    config, whose ``loss``, ``num_microbatches`` and ``logprob_chunk_size`` are read here), the
    rollout spec (``policy_specs`` of ``rollout_fields`` / ``update_fields`` unless
    ``rollout_spec`` is given), the log-prob function (in
    ``logprob_microbatches`` chunks, default the update's), ``prepare`` (``policy_passes``: the
    reference's log-probs when ``loss.kl_coef`` > 0, MoE routes replayed there as
    ``reference_routes`` says, the old policy's when ``old``; then
    ``extra_pass(state, batch)`` if given, e.g. PPO's rollout-time values; then the update's
    fields), ``init`` (``algorithm.make_init`` with the KL reference, and PPO's ``critic`` /
    ``value_tx``), and ``with_epochs``."""
    tx, schedule = algorithm_lib.resolve_optimizer(optimizer)
    engine.check_epochs(epochs_per_batch)
    routing.check_mode(reference_routes, "rl.reference_routes", routing.ReferenceRoutes)
    update = make_update(tx, schedule)
    if rollout_spec is None:
        rollout_spec, _ = policy_specs(
            cfg.loss, rollout_fields, update_fields, cfg.num_microbatches
        )
    logprob_fn = engine.make_logprob_fn(
        graphdef,
        num_microbatches=logprob_microbatches or cfg.num_microbatches,
        chunk_size=cfg.logprob_chunk_size,
        mesh=mesh,
    )

    def prepare(state, rollouts):
        batch, metrics = policy_passes(
            logprob_fn, state, rollouts, old=old, reference_routes=reference_routes
        )
        if extra_pass is not None:
            batch = extra_pass(state, batch)
        return algorithm_lib.select_fields(batch, update.batch_spec), metrics

    init = algorithm_lib.make_init(
        graphdef, tx, reference=cfg.loss.kl_coef > 0, critic=critic, value_tx=value_tx
    )
    record = algorithm_lib.Algorithm(
        name=name, init=init, prepare=prepare, update=update, rollout_spec=rollout_spec
    )
    return algorithm_lib.with_epochs(record, epochs_per_batch)
