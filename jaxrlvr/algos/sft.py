"""Supervised fine-tuning and expert iteration: the masked-NLL loss, its update and records.

``make_sft_update`` builds the update (loss = sum_bt(-logp * loss_mask) / denominator, the
denominator being the full batch's loss-token count or B * C, the CS336 ``masked_normalize``);
``sft_algorithm`` is the record of a (prompt, response) data set, ``expert_iteration_algorithm``
the same update on the policy's own verified rollouts (Anthony et al. 2017; the CS336 EI
experiment).

Registered as ``sft`` (a phase's method) and ``expert_iteration`` (``registry``).

Not here: tokenising SFT pairs and filtering rollouts by reward (the driver), the engine
(``engine``).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrlvr.algos import aggregation, engine, registry, segments
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import batch as batch_lib

_f32 = jnp.float32


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTUpdateConfig:
    """Supervised fine-tuning (and expert iteration) loss.

    normalize_constant: None -> mean NLL over all loss tokens of the batch; a number C -> the
        CS336 ``sft_microbatch_train_step`` loss sum_bt(-logp * mask) / (B * C).
    num_microbatches: gradient-accumulation microbatches per optimiser step.
    logprob_chunk_size: positions per lm_head/log-softmax chunk
        (``engine.token_logprobs_from_hidden``); None: the whole [B, T, V] logits at once.
    """

    normalize_constant: float | None = None
    num_microbatches: int = 1
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.normalize_constant is not None and not self.normalize_constant > 0:
            raise ValueError(
                f"normalize_constant must be None or > 0, got {self.normalize_constant!r}"
            )
        engine.check_microbatches(self.num_microbatches)
        engine.check_chunk_size(self.logprob_chunk_size)


def make_sft_update(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: SFTUpdateConfig | None = None,
    *,
    lr_schedule: engine.LRSchedule = None,
    mesh: Any = None,
) -> Callable:
    """Masked-NLL update: loss = sum_bt(-logp * loss_mask) / denominator, where the denominator
    is the full batch's loss-token count, or B * normalize_constant (CS336 ``masked_normalize``).

    Args:
      graphdef: the policy's graph definition (``nnx.split(model, nnx.Param)[0]``).
      tx: optax transformation (``optim.make_optimizer``).
      cfg: loss and microbatching.
      lr_schedule: reported as ``metrics["learning_rate"]`` at ``state.step`` (optional).
      mesh: the device mesh the batch is sharded over (None: no microbatch constraint).
    Returns:
      ``update(state, batch) -> (state, metrics)``, with ``update.batch_spec`` (the batch needs
      only input_ids, attention_mask, labels, loss_mask).
    """
    cfg = cfg or SFTUpdateConfig()

    def full_batch(batch):
        if cfg.normalize_constant is None:
            denom = jnp.maximum(jnp.sum(batch.loss_mask.astype(_f32)), 1.0)
        else:
            n = segments.num_sequences(batch.segment_ids, batch.loss_mask)
            denom = n * jnp.float32(cfg.normalize_constant)
        return batch, denom

    def loss_fn(params, mb, denom):
        lm = nnx.merge(graphdef, params)
        logp, ent, _ = engine.token_logprobs(lm, mb, chunk_size=cfg.logprob_chunk_size)
        nll = aggregation.masked_rows(-logp, mb.loss_mask)
        loss = jnp.sum(nll) / denom
        return loss, {
            "loss": jax.lax.stop_gradient(loss),
            "nll_sum": jax.lax.stop_gradient(jnp.sum(nll)),
            "entropy_sum": jnp.sum(aggregation.masked_rows(ent, mb.loss_mask)),
            "token_count": jnp.sum(mb.loss_mask.astype(_f32)),
        }

    spec = batch_lib.BatchSpec(num_microbatches=cfg.num_microbatches)
    return engine.make_update(
        spec=spec, tx=tx, lr_schedule=lr_schedule, mesh=mesh, full_batch=full_batch, loss_fn=loss_fn
    )


def sft_algorithm(
    graphdef: nnx.GraphDef,
    optimizer: algorithm_lib.Optimizer,
    cfg: SFTUpdateConfig | None = None,
    *,
    mesh: Any = None,
    epochs_per_batch: int = 1,
) -> algorithm_lib.Algorithm:
    """Supervised fine-tuning on (prompt, response) rows (``make_sft_update``), each batch
    trained ``epochs_per_batch`` times per ``update`` call.

    ``prepare`` only drops fields the update does not read: the batch is the rollouts.
    """
    tx, schedule = algorithm_lib.resolve_optimizer(optimizer)
    engine.check_epochs(epochs_per_batch)
    update = make_sft_update(graphdef, tx, cfg, lr_schedule=schedule, mesh=mesh)

    def prepare(state, rollouts):
        del state
        return algorithm_lib.select_fields(rollouts, update.batch_spec), {}

    record = algorithm_lib.Algorithm(
        name="sft",
        init=algorithm_lib.make_init(graphdef, tx),
        prepare=prepare,
        update=update,
        rollout_spec=update.batch_spec,
    )
    return algorithm_lib.with_epochs(record, epochs_per_batch)


def expert_iteration_algorithm(
    graphdef: nnx.GraphDef,
    optimizer: algorithm_lib.Optimizer,
    cfg: SFTUpdateConfig | None = None,
    *,
    mesh: Any = None,
    epochs_per_batch: int = 1,
) -> algorithm_lib.Algorithm:
    """Expert iteration (Anthony et al. 2017; the CS336 EI experiment): SFT on the policy's own
    rollouts that the verifier accepted.

    Rollouts carry ``correct`` [B] (1 = accepted; per token [B, T] in packed rows); ``prepare``
    zeroes the loss mask of every other sequence, so rejected completions add nothing to the
    loss or its token count.
    """
    inner = sft_algorithm(graphdef, optimizer, cfg, mesh=mesh, epochs_per_batch=epochs_per_batch)
    spec = inner.batch_spec
    rollout_spec = dataclasses.replace(spec, required=("correct",))

    def prepare(state, rollouts):
        del state
        correct = rollouts.correct  # [B], or per token [B, T] in packed rows
        keep = (correct > 0) if correct.ndim == 2 else (correct > 0)[:, None]
        mask = jnp.where(keep, rollouts.loss_mask, jnp.zeros_like(rollouts.loss_mask))
        return algorithm_lib.select_fields(rollouts.replace(loss_mask=mask), spec), {}

    return dataclasses.replace(
        inner, name="expert_iteration", prepare=prepare, rollout_spec=rollout_spec
    )


def build_sft(cfg, graphdef, params_shape, mesh, microbatches) -> algorithm_lib.Algorithm:
    """The SFT phase's record from the run config's ``sft`` section (its own microbatches)."""
    del params_shape, microbatches
    sft_cfg = SFTUpdateConfig(
        num_microbatches=cfg.sft.microbatches, logprob_chunk_size=cfg.sft.logprob_chunk_size
    )
    return sft_algorithm(graphdef, cfg.sft.optim, sft_cfg, mesh=mesh)


def build_expert_iteration(
    cfg, graphdef, params_shape, mesh, microbatches
) -> algorithm_lib.Algorithm:
    """``rl.algo: expert_iteration`` from the run config's ``rl`` section and ``optim``."""
    del params_shape
    ei_cfg = SFTUpdateConfig(
        num_microbatches=microbatches, logprob_chunk_size=cfg.rl.logprob_chunk_size
    )
    return expert_iteration_algorithm(
        graphdef, cfg.optim, ei_cfg, mesh=mesh, epochs_per_batch=cfg.rl.epochs_per_step
    )


registry.register(registry.Method(name=registry.SFT, build=build_sft, data="examples"))
registry.register(
    registry.Method(name="expert_iteration", build=build_expert_iteration, asynchronous=True)
)
