"""GRPO and its variants: the policy-gradient update on per-sequence advantages and its record.

The objective is ``policy_loss.policy_loss`` with every option of ``PolicyLossConfig``
(aggregation incl. Dr. GRPO and DAPO's token mean, clip-higher, dual clip, GSPO, KL, entropy,
off-policy correction); the advantages come from the host (``advantages``, ``shaping``,
``rollout``).

Registered as ``grpo`` (``registry``).

Not here: rewards and group baselines (the driver computes ``batch.advantages``), the engine
(``engine``) and the parts shared with PPO (``policy_gradient``).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import optax
from flax import nnx

from jaxrlvr.algos import aggregation, engine, loss_config, policy_gradient, registry
from jaxrlvr.algos import algorithm as algorithm_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOUpdateConfig:
    """GRPO / policy-gradient update: the ``policy_loss`` objective with every option of
    ``PolicyLossConfig`` (aggregation, clip-higher, dual clip, GSPO, KL, entropy, off-policy
    correction).
    ``logprob_chunk_size`` as ``sft.SFTUpdateConfig`` (also used by the old/reference passes)."""

    loss: loss_config.PolicyLossConfig = dataclasses.field(
        default_factory=loss_config.PolicyLossConfig
    )
    num_microbatches: int = 1
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        engine.check_microbatches(self.num_microbatches)
        engine.check_chunk_size(self.logprob_chunk_size)


def make_grpo_update(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: GRPOUpdateConfig | None = None,
    *,
    lr_schedule: engine.LRSchedule = None,
    mesh: Any = None,
) -> Callable:
    """GRPO / policy-gradient update (one epoch) on per-sequence advantages
    (``policy_loss.policy_loss``).

    The batch needs ``advantages`` [B]; ``old_logp`` (None: on-policy, ratio 1); ``ref_logp``
    when ``kl_coef > 0`` with ``kl_in="loss"``; ``sampler_logp`` when
    ``loss.correction`` reads it (``CorrectionConfig.uses_sampler``); ``behaviour_logp``
    optional (stale batches: the staleness source).
    Other arguments as ``sft.make_sft_update``.
    """
    cfg = cfg or GRPOUpdateConfig()
    entropy_grad = cfg.loss.entropy_coef != 0
    _, spec = policy_gradient.policy_specs(cfg.loss, ("advantages",), (), cfg.num_microbatches)

    def full_batch(batch):
        return batch, aggregation.loss_denominator(
            batch.loss_mask, cfg.loss, batch.segment_ids, batch.prompt_group_ids
        )

    def loss_fn(params, mb, denom):
        lm = nnx.merge(graphdef, params)
        logp, ent, _ = engine.token_logprobs(
            lm, mb, entropy_grad=entropy_grad, chunk_size=cfg.logprob_chunk_size
        )
        return policy_gradient.policy_terms(
            logp, ent, mb, mb.advantages, mb.loss_mask, cfg.loss, denom
        )

    return engine.make_update(
        spec=spec,
        tx=tx,
        lr_schedule=lr_schedule,
        mesh=mesh,
        full_batch=full_batch,
        loss_fn=loss_fn,
    )


def grpo_algorithm(
    graphdef: nnx.GraphDef,
    optimizer: algorithm_lib.Optimizer,
    cfg: GRPOUpdateConfig | None = None,
    *,
    mesh: Any = None,
    epochs_per_batch: int = 1,
    rollouts_may_be_stale: bool = False,
    logprob_microbatches: int | None = None,
    reference_routes: str = "auto",
) -> algorithm_lib.Algorithm:
    """GRPO and its variants (``make_grpo_update`` on per-sequence advantages), each batch
    trained ``epochs_per_batch`` times per ``update`` call (``algorithm.with_epochs``).

    ``init`` copies the policy as the frozen KL reference when ``loss.kl_coef > 0``.
    ``prepare`` computes ``ref_logp`` and, with ``epochs_per_batch`` > 1, ``old_logp`` (the
    policy before this rollout's updates: the ratio's denominator, so later epochs clip against
    it), in one jitted call, in ``logprob_microbatches`` chunks (default: the update's
    microbatches) to bound the [B, T, V] logits memory. With one epoch on fresh rollouts the old
    policy IS the current one, so the update uses its own log-probs behind a stop-gradient (ratio
    exactly 1) and a forward pass is saved (TRL does the same).

    ``rollouts_may_be_stale``: the driver may hand ``prepare`` rollouts sampled by older weights
    than ``state.params`` (asynchronous rollouts, ``max_staleness > 0``). The skip is then wrong
    (the ratio's denominator must be the policy the rollouts are corrected against), so the old
    pass always runs: it is skipped only when ``epochs_per_batch == 1`` and the rollouts cannot be
    stale. Either way the off-policy correction (``loss.correction``) weights the tokens by the
    ratio of its source: old / sampler ("both"), behaviour / sampler ("engine") or old /
    behaviour ("staleness"), where the RL phase supplies ``behaviour_logp`` for stale batches.
    """
    cfg = cfg or GRPOUpdateConfig()
    return policy_gradient.policy_gradient_algorithm(
        "grpo",
        graphdef,
        optimizer,
        cfg,
        lambda tx, schedule: make_grpo_update(graphdef, tx, cfg, lr_schedule=schedule, mesh=mesh),
        old=epochs_per_batch > 1 or bool(rollouts_may_be_stale),
        mesh=mesh,
        epochs_per_batch=epochs_per_batch,
        logprob_microbatches=logprob_microbatches,
        reference_routes=reference_routes,
    )


def build(cfg, graphdef, params_shape, mesh, microbatches) -> algorithm_lib.Algorithm:
    """``rl.algo: grpo`` from the run config: ``rl.policy_loss`` and the shared RL fields."""
    del params_shape
    return grpo_algorithm(
        graphdef,
        cfg.optim,
        GRPOUpdateConfig(**policy_gradient.run_fields(cfg, microbatches)),
        mesh=mesh,
        epochs_per_batch=cfg.rl.epochs_per_step,
        reference_routes=cfg.rl.reference_routes,
        rollouts_may_be_stale=cfg.rl.max_staleness > 0,
    )


def check_run(rl) -> None:
    if rl.group_size < 2:
        raise ValueError(f"group_size={rl.group_size}: GRPO needs at least 2 samples per prompt")


registry.register(
    registry.Method(
        name="grpo",
        build=build,
        asynchronous=True,
        state_keys=policy_gradient.STATE_KEYS,
        check=check_run,
    )
)
