"""One record per training algorithm, optax-style: ``init`` / ``prepare`` / ``update``.

An ``Algorithm`` is everything a driver needs to train with one method, so the driver itself has
no per-algorithm branches:

- ``init(params, rng) -> TrainState``: the state at step 0. It owns the optimiser (the one the
  update applies, so state and update cannot disagree), the PPO critic, and a frozen copy of the
  policy as the KL reference when the loss needs one.
- ``prepare(state, rollouts) -> (batch, metrics)``: runs on device the passes that need the
  current weights (old log-probs, reference log-probs, rollout-time values, the expert-iteration
  filter) and returns the exact batch ``update`` consumes (and metrics of those passes, if any).
  ``rollouts`` is a ``Batch`` holding the fields of ``rollout_spec`` that the host computed
  (tokens and masks, advantages, rewards, correctness, the sampler's log-probs).
- ``update(state, batch) -> (state, metrics)``: the pure transition of ``updates``.
- ``rollout_spec`` / ``batch_spec``: the ``BatchSpec`` of what ``prepare`` reads and of what
  ``update`` reads.

The three functions are pure and un-jitted (tests run them both ways); ``step.CompiledAlgorithm``
jits them with explicit shardings for the driver. Factories: ``sft``, ``expert_iteration``,
``grpo`` (every ``PolicyLossConfig`` variant: Dr. GRPO, DAPO, GSPO, KL, TIS, ...) and ``ppo``
(value head on the policy trunk, shared or detached, or a separate critic), and ``preference``
(offline DPO, IPO, SimPO, ORPO on chosen/rejected pairs).

Not here: sampling, grading and reward shaping (host-side, in the driver and ``rollout``), and
compilation (``step``).
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import optim, updates, value
from jaxrlvr.algos import preference as preference_lib
from jaxrlvr.algos import state as state_lib

_f32 = jnp.float32
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


def _optimizer(opt: Optimizer) -> tuple[optax.GradientTransformation, optax.Schedule | None]:
    """(transformation, schedule reported as ``learning_rate``) from a config or a ready tx."""
    if isinstance(opt, optim.OptimizerConfig):
        return optim.make_optimizer(opt), optim.make_schedule(opt)
    if isinstance(opt, optax.GradientTransformation):
        return opt, None
    raise TypeError(
        f"optimizer: expected an OptimizerConfig or an optax.GradientTransformation, "
        f"got {type(opt).__name__}"
    )


def _key(rng: jax.Array | int) -> jax.Array:
    """A raw PRNG key from a key or an integer seed (also a traced scalar seed)."""
    return jax.random.PRNGKey(rng) if jnp.ndim(rng) == 0 else rng


def select_fields(batch: batch_lib.Batch, spec: batch_lib.BatchSpec) -> batch_lib.Batch:
    """``batch`` with every field that ``spec`` neither requires nor uses set to None."""
    keep = set(batch_lib.BASE_FIELDS) | set(spec.required) | set(spec.optional)
    keep |= set(batch_lib.PACKING_FIELDS)  # every update reads packed rows
    return batch.replace(**{f.name: None for f in dataclasses.fields(batch) if f.name not in keep})


# ---------------------------------------------------------------------------------------------
# Factories.


def sft(
    graphdef: nnx.GraphDef,
    optimizer: Optimizer,
    cfg: updates.SFTUpdateConfig | None = None,
    *,
    mesh: Any = None,
) -> Algorithm:
    """Supervised fine-tuning on (prompt, response) rows (``updates.make_sft_update``).

    ``prepare`` only drops fields the update does not read: the batch is the rollouts.
    """
    tx, schedule = _optimizer(optimizer)
    update = updates.make_sft_update(graphdef, tx, cfg, lr_schedule=schedule, mesh=mesh)

    def init(params: nnx.State, rng: jax.Array | int = 0) -> state_lib.TrainState:
        return state_lib.TrainState.create(graphdef, params, tx, _key(rng))

    def prepare(state, rollouts):
        del state
        return select_fields(rollouts, update.batch_spec), {}

    return Algorithm(
        name="sft", init=init, prepare=prepare, update=update, rollout_spec=update.batch_spec
    )


def expert_iteration(
    graphdef: nnx.GraphDef,
    optimizer: Optimizer,
    cfg: updates.SFTUpdateConfig | None = None,
    *,
    mesh: Any = None,
) -> Algorithm:
    """Expert iteration (Anthony et al. 2017; the CS336 EI experiment): SFT on the policy's own
    rollouts that the verifier accepted.

    Rollouts carry ``correct`` [B] (1 = accepted; per token [B, T] in packed rows); ``prepare``
    zeroes the loss mask of every other sequence, so rejected completions add nothing to the
    loss or its token count.
    """
    inner = sft(graphdef, optimizer, cfg, mesh=mesh)
    spec = inner.batch_spec
    rollout_spec = dataclasses.replace(spec, required=("correct",))

    def prepare(state, rollouts):
        del state
        correct = rollouts.correct  # [B], or per token [B, T] in packed rows
        keep = (correct > 0) if correct.ndim == 2 else (correct > 0)[:, None]
        mask = jnp.where(keep, rollouts.loss_mask, jnp.zeros_like(rollouts.loss_mask))
        return select_fields(rollouts.replace(loss_mask=mask), spec), {}

    return dataclasses.replace(
        inner, name="expert_iteration", prepare=prepare, rollout_spec=rollout_spec
    )


def _policy_rollout_spec(
    loss: Any, required: tuple[str, ...], num_microbatches: int
) -> batch_lib.BatchSpec:
    """Rollout fields of a policy-gradient method: ``required`` plus the sampler's log-probs
    (required by truncated IS, otherwise used for the gap metric when present)."""
    tis = loss.tis != "none"
    return batch_lib.BatchSpec(
        required=required + (("sampler_logp",) if tis else ()),
        optional=() if tis else ("sampler_logp",),
        num_microbatches=num_microbatches,
    )


def _policy_passes(
    logprob_fn, state, rollouts, *, old: bool = True
) -> tuple[batch_lib.Batch, Metrics]:
    """The rollouts with ``old_logp`` (the current policy's; skipped when ``old`` is False) and,
    when the state holds a KL reference, ``ref_logp``.

    The sampler/trainer gap needs no pass of its own: the update reports it as ``logp_diff_abs``
    (mean over loss tokens) and ``logp_diff_abs_max`` whenever the batch carries the sampler's
    log-probs (``importance.tis_metrics`` of ``old_logp``, or of the current log-probs on policy).
    """
    old_logp = logprob_fn(state.params, rollouts)[0] if old else None
    ref_logp = None if state.ref_params is None else logprob_fn(state.ref_params, rollouts)[0]
    return rollouts.replace(old_logp=old_logp, ref_logp=ref_logp), {}


def _reference(params: nnx.State, needed: bool) -> nnx.State | None:
    # Fresh buffers: the state is donated every step, the reference must outlive that.
    return jax.tree.map(jnp.copy, params) if needed else None


def grpo(
    graphdef: nnx.GraphDef,
    optimizer: Optimizer,
    cfg: updates.GRPOUpdateConfig | None = None,
    *,
    mesh: Any = None,
    epochs_per_batch: int = 1,
    rollouts_may_be_stale: bool = False,
    logprob_microbatches: int | None = None,
) -> Algorithm:
    """GRPO and its variants (``updates.make_grpo_update`` on per-sequence advantages).

    ``init`` copies the policy as the frozen KL reference when ``loss.kl_coef > 0``.
    ``prepare`` computes ``ref_logp`` and, when the driver applies the update
    ``epochs_per_batch`` > 1 times to one batch, ``old_logp`` (the policy before this rollout's
    updates: the ratio's denominator, so later epochs clip against it), in one jitted call, in
    ``logprob_microbatches`` chunks (default: the update's microbatches) to bound the [B, T, V]
    logits memory. With one epoch on fresh rollouts the old policy IS the current one, so the
    update uses its own log-probs behind a stop-gradient (ratio exactly 1) and a forward pass is
    saved (TRL does the same).

    ``rollouts_may_be_stale``: the driver may hand ``prepare`` rollouts sampled by older weights
    than ``state.params`` (asynchronous rollouts, ``max_staleness > 0``). The skip is then wrong
    (the ratio's denominator must be the policy the rollouts are corrected against), so the old
    pass always runs: it is skipped only when ``epochs_per_batch == 1`` and the rollouts cannot be
    stale. Either way truncated IS weights the tokens by old / sampler log-probs, with the
    sampler's own log-probs (``sampler_logp``) as the denominator.
    """
    cfg = cfg or updates.GRPOUpdateConfig()
    tx, schedule = _optimizer(optimizer)
    update = updates.make_grpo_update(graphdef, tx, cfg, lr_schedule=schedule, mesh=mesh)
    if not (isinstance(epochs_per_batch, int) and epochs_per_batch >= 1):
        raise ValueError(f"epochs_per_batch must be an integer >= 1, got {epochs_per_batch!r}")
    chunks = logprob_microbatches or cfg.num_microbatches
    logprob_fn = updates.make_logprob_fn(
        graphdef, num_microbatches=chunks, chunk_size=cfg.logprob_chunk_size, mesh=mesh
    )
    needs_ref = cfg.loss.kl_coef > 0
    needs_old = epochs_per_batch > 1 or bool(rollouts_may_be_stale)

    def init(params, rng=0):
        return state_lib.TrainState.create(
            graphdef, params, tx, _key(rng), ref_params=_reference(params, needs_ref)
        )

    def prepare(state, rollouts):
        batch, metrics = _policy_passes(logprob_fn, state, rollouts, old=needs_old)
        return select_fields(batch, update.batch_spec), metrics

    return Algorithm(
        name="grpo",
        init=init,
        prepare=prepare,
        update=update,
        rollout_spec=_policy_rollout_spec(cfg.loss, ("advantages",), cfg.num_microbatches),
    )


def ppo(
    graphdef: nnx.GraphDef,
    optimizer: Optimizer,
    cfg: updates.PPOUpdateConfig | None = None,
    *,
    params_shape: nnx.State | None = None,
    mesh: Any = None,
    value_optimizer: Optimizer | None = None,
    logprob_microbatches: int | None = None,
) -> Algorithm:
    """PPO with GAE (``updates.make_ppo_update``), the critic built by ``init``.

    ``cfg.trunk`` "shared"/"detached": a zero-initialised value head on the policy's hidden
    states; "separate": a critic model copied from the policy's weights at ``init`` (verl's
    default), whose graph definition is derived here from ``params_shape`` (the policy's params
    or their ``jax.ShapeDtypeStruct`` shapes; required for "separate"). The critic's optimiser
    is ``value_optimizer`` (default: the policy's settings). ``prepare`` computes ``old_logp``,
    ``ref_logp`` (KL) and the rollout-time ``old_values``.
    """
    cfg = cfg or updates.PPOUpdateConfig()
    tx, schedule = _optimizer(optimizer)
    value_tx, _ = _optimizer(optimizer if value_optimizer is None else value_optimizer)
    value_graphdef = None
    if cfg.trunk == "separate":
        if params_shape is None:
            raise ValueError("ppo(trunk='separate'): pass params_shape (the policy's params)")
        value_graphdef = value.critic_graphdef(graphdef, params_shape)
    update = updates.make_ppo_update(
        graphdef,
        tx,
        value_tx,
        cfg,
        lr_schedule=schedule,
        value_graphdef=value_graphdef,
        mesh=mesh,
    )
    chunks = logprob_microbatches or cfg.num_microbatches
    logprob_fn = updates.make_logprob_fn(
        graphdef, num_microbatches=chunks, chunk_size=cfg.logprob_chunk_size, mesh=mesh
    )
    value_fn = value.make_value_fn(graphdef, value_graphdef=value_graphdef)
    needs_ref = cfg.loss.kl_coef > 0

    def init(params, rng=0):
        key = _key(rng)
        head_key = jax.random.fold_in(key, 1)
        if value_graphdef is not None:
            _, critic = value.init_value_model(graphdef, params, rng=head_key)
        else:
            hidden_size = nnx.merge(graphdef, params).config.hidden_size
            critic = value.init_value_head(hidden_size, head_key)
        return state_lib.TrainState.create(
            graphdef,
            params,
            tx,
            key,
            value_params=critic,
            value_tx=value_tx,
            ref_params=_reference(params, needs_ref),
        )

    def prepare(state, rollouts):
        batch, metrics = _policy_passes(logprob_fn, state, rollouts)
        batch = batch.replace(old_values=value_fn(state.params, state.value_params, rollouts))
        return select_fields(batch, update.batch_spec), metrics

    return Algorithm(
        name="ppo",
        init=init,
        prepare=prepare,
        update=update,
        rollout_spec=_policy_rollout_spec(cfg.loss, ("rewards",), cfg.num_microbatches),
    )


def preference(
    graphdef: nnx.GraphDef,
    optimizer: Optimizer,
    cfg: preference_lib.PreferenceUpdateConfig | None = None,
    *,
    mesh: Any = None,
    logprob_microbatches: int | None = None,
) -> Algorithm:
    """Offline preference optimisation: DPO, IPO, SimPO or ORPO (``cfg.loss.kind``, also the
    record's name) on stacked pair batches (``preference`` module docstring: P chosen rows,
    then the P rejected rows in the same order; unpacked).

    ``init`` copies the policy as the frozen reference for DPO and IPO (SimPO and ORPO are
    reference-free). ``prepare`` computes the reference's ``ref_logp`` for the batch, in
    ``logprob_microbatches`` chunks (default: the update's microbatches), unless the batch
    already carries ``ref_logp``: a reference computed once for the whole data set and cached
    (the driver's ``pref.cache_reference``; the reference is frozen, so the values are the
    same) passes through, and no reference forward runs.
    """
    cfg = cfg or preference_lib.PreferenceUpdateConfig()
    tx, schedule = _optimizer(optimizer)
    update = preference_lib.make_preference_update(
        graphdef, tx, cfg, lr_schedule=schedule, mesh=mesh
    )
    needs_ref = cfg.loss.needs_reference
    logprob_fn = updates.make_logprob_fn(
        graphdef,
        num_microbatches=logprob_microbatches or cfg.num_microbatches,
        chunk_size=cfg.logprob_chunk_size,
        mesh=mesh,
    )

    def init(params, rng=0):
        return state_lib.TrainState.create(
            graphdef, params, tx, _key(rng), ref_params=_reference(params, needs_ref)
        )

    def prepare(state, rollouts):
        if needs_ref and rollouts.ref_logp is None:
            rollouts = rollouts.replace(ref_logp=logprob_fn(state.ref_params, rollouts)[0])
        return select_fields(rollouts, update.batch_spec), {}

    return Algorithm(
        name=cfg.loss.kind,
        init=init,
        prepare=prepare,
        update=update,
        rollout_spec=batch_lib.BatchSpec(
            optional=("ref_logp",) if needs_ref else (), num_microbatches=cfg.num_microbatches
        ),
    )
