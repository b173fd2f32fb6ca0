"""One record per training method, optax-style: ``init`` / ``prepare`` / ``update``.

An ``Algorithm`` is everything a driver needs to train with one method, so the driver itself has
no per-method branches:

- ``init(params, rng) -> TrainState``: the state at step 0. It owns the optimiser (the one the
  update applies, so state and update cannot disagree), the PPO critic, and a frozen copy of the
  policy as the KL reference when the loss needs one.
- ``prepare(state, rollouts) -> (batch, metrics)``: runs on device the passes that need the
  current weights (old log-probs, reference log-probs, rollout-time values, the expert-iteration
  filter) and returns the exact batch ``update`` consumes (and metrics of those passes, if any).
  ``rollouts`` is a ``Batch`` holding the fields of ``rollout_spec`` that the host computed
  (tokens and masks, advantages, rewards, correctness, the sampler's log-probs).
- ``update(state, batch) -> (state, metrics)``: the whole optimisation of one step on one batch,
  every epoch of it (``with_epochs``): a driver calls it once per step. Every record's
  ``init`` is ``make_init``'s.
- ``rollout_spec`` / ``batch_spec``: the ``BatchSpec`` of what ``prepare`` reads and of what
  ``update`` reads.

The three functions are pure and un-jitted (tests run them both ways); ``step.CompiledAlgorithm``
jits them with explicit shardings for the driver. The factories live with their method:
``sft.sft_algorithm`` and ``sft.expert_iteration_algorithm``, ``grpo.grpo_algorithm`` (every
``PolicyLossConfig`` variant: Dr. GRPO, DAPO, GSPO, KL, TIS, ...), ``ppo.ppo_algorithm`` (value
head on the policy trunk, shared or detached, or a separate critic) and
``preference.preference_algorithm`` (offline DPO, IPO, SimPO, ORPO on chosen/rejected pairs).
This module holds the record and the pieces every factory shares.

Not here: sampling, grading and reward shaping (host-side, in the driver and ``rollout``), and
compilation (``step``).
"""

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import engine, optim
from jaxrlvr.algos import state as state_lib
from jaxrlvr.model import lora

Optimizer = optim.OptimizerConfig | optax.GradientTransformation
Metrics = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Algorithm:
    """A training method as four pure pieces; see the module docstring."""

    name: str
    init: Callable[[nnx.State, jax.Array | int], state_lib.TrainState]
    prepare: Callable[[state_lib.TrainState, batch_lib.Batch], tuple[batch_lib.Batch, Metrics]]
    update: Callable[[state_lib.TrainState, batch_lib.Batch], tuple[state_lib.TrainState, Metrics]]
    rollout_spec: batch_lib.BatchSpec

    @property
    def batch_spec(self) -> batch_lib.BatchSpec:
        return self.update.batch_spec


def resolve_optimizer(
    opt: Optimizer,
) -> tuple[optax.GradientTransformation, optax.Schedule | None]:
    """(transformation, schedule reported as ``learning_rate``) from a config or a ready tx."""
    if isinstance(opt, optim.OptimizerConfig):
        return optim.make_optimizer(opt), optim.make_schedule(opt)
    if isinstance(opt, optax.GradientTransformation):
        return opt, None
    raise TypeError(
        f"optimizer: expected an OptimizerConfig or an optax.GradientTransformation, "
        f"got {type(opt).__name__}"
    )


def prng_key(rng: jax.Array | int) -> jax.Array:
    """A raw PRNG key from a key or an integer seed (also a traced scalar seed)."""
    return jax.random.PRNGKey(rng) if jnp.ndim(rng) == 0 else rng


def frozen_reference(params: nnx.State, needed: bool) -> nnx.State | None:
    """A copy of ``params`` as the frozen KL / DPO reference when ``needed``, else None; with
    LoRA adapters, a copy of the adapters only (``TrainState.reference_params`` joins them with
    the frozen base, which is then not held twice)."""
    # Fresh buffers: the state is donated every step, the reference must outlive that.
    return jax.tree.map(jnp.copy, lora.trainable(params)) if needed else None


def make_init(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    *,
    reference: bool = False,
    critic: Callable[[nnx.State, jax.Array], object] | None = None,
    value_tx: optax.GradientTransformation | None = None,
) -> Callable[[nnx.State, jax.Array | int], state_lib.TrainState]:
    """The one ``init`` of every record: the state at step 0 with the optimiser ``tx``, a frozen
    copy of the policy as the reference when ``reference`` (``frozen_reference``), and a critic
    ``critic(params, key)`` trained by ``value_tx`` (PPO; its key is the state's key folded with
    1)."""

    def init(params: nnx.State, rng: jax.Array | int = 0) -> state_lib.TrainState:
        key = prng_key(rng)
        value_params = None if critic is None else critic(params, jax.random.fold_in(key, 1))
        return state_lib.TrainState.create(
            graphdef,
            params,
            tx,
            key,
            value_params=value_params,
            value_tx=value_tx,
            ref_params=frozen_reference(params, reference),
        )

    return init


def with_epochs(algorithm: Algorithm, epochs: int) -> Algorithm:
    """``algorithm`` whose ``update`` trains each batch ``epochs`` times in one call
    (``engine.repeat_epochs``), composed onto a record as optax composes transformations; 1:
    the record itself."""
    engine.check_epochs(epochs)
    if epochs == 1:
        return algorithm
    return dataclasses.replace(algorithm, update=engine.repeat_epochs(algorithm.update, epochs))


def select_fields(batch: batch_lib.Batch, spec: batch_lib.BatchSpec) -> batch_lib.Batch:
    """``batch`` with every field that ``spec`` neither requires nor uses set to None."""
    keep = set(batch_lib.BASE_FIELDS) | set(spec.required) | set(spec.optional)
    keep |= set(batch_lib.PACKING_FIELDS)  # every update reads packed rows
    keep |= set(batch_lib.model_fields())  # and the model's own inputs (MoE routes)
    return batch.replace(**{name: None for name in batch.as_dict() if name not in keep})
