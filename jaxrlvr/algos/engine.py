"""The update engine every method shares: microbatching, gradient accumulation, the one update
skeleton, epochs over one batch, and the log-prob passes.

A method module (``sft``, ``grpo``, ``ppo``, ``preference``) supplies only its loss: ``make_update``
turns ``full_batch(batch) -> (rows, consts)`` and ``loss_fn(params, microbatch, consts) -> (loss
share, metric sums)`` into ``update(state, batch) -> (state, metrics)``. Inside one call:

1. the batch is checked against ``update.batch_spec`` (shapes and dtypes are static, so this
   happens at trace time, before compilation; ``step.CompiledAlgorithm`` also checks the rollouts
   on the host);
2. whatever needs the FULL batch is computed first (loss denominators, PPO's GAE advantages),
   then the rows are cut into ``num_microbatches`` microbatches (``split_microbatches``) and
   ``accumulate_gradients`` sums each one's gradient and metrics in a ``lax.scan``. Every loss is
   "sum of per-row terms / global denominator", so the sum equals the full-batch gradient exactly
   (up to float summation order). Microbatch j holds rows j, j + n, j + 2n, ...: with the batch
   sharded in contiguous blocks over ('data', 'fsdp'), every microbatch stays spread over all
   data shards without any data movement. The scanned (remat) layers and the chunked head add
   their gradient into the accumulator in place (``model.grad_sink``), so no microbatch's whole
   gradient exists beside it;
3. ``finish_update`` applies the optax chain (``optim.make_optimizer``: global-norm clipping,
   AdamW, schedule);
4. if the loss or the pre-clip gradient norm is not finite, the whole state (step, params,
   optimiser state, rng, critic) is returned unchanged (a ``lax.cond`` around the optimiser) and
   ``metrics["nonfinite"] = 1``; ``step.CompiledAlgorithm(on_nonfinite="raise")`` turns that into
   a host-side error.

Metrics are float32 scalars: ``loss``, ``policy_loss``, ``pg_loss``, ``kl_loss``, ``kl``,
``entropy``, ``clip_frac`` (and low/high/dual), ``ratio``/``ratio_max``/``ratio_min``, the
off-policy figures ``offpolicy/weight`` and ``offpolicy/{engine,staleness,both}/*``
(``importance``), ``seq_count``, ``logp_diff_abs``(``_max``),
``grad_norm`` (before clipping), ``learning_rate`` (the rate applied at this step),
``token_count`` (loss tokens), ``tokens`` (all non-pad tokens processed), ``nonfinite``;
PPO adds ``vf_loss``, ``vf_clip_frac``, ``vf_error_sq``, ``value_grad_norm``, ``advantage_mean``,
``return_mean``, ``value_mean``; SFT reports ``nll`` (mean per loss token) instead of the policy
figures.

Several epochs over one rollout batch (``repeat_epochs``): the record's update applies the
one-epoch update ``epochs`` times to the same batch inside one compiled call (a ``lax.scan``),
whose ``old_logp`` was computed once by ``make_logprob_fn`` before the first epoch; the clipped
ratio then measures the drift since the rollout. For a single on-policy epoch ``old_logp`` may be
left None: the update then uses the current log-probs (ratio 1) and saves a forward pass.

Not here: the losses (``policy_loss``, ``gae``, ``preference``), rewards and advantages (the
driver computes them with ``advantages``/``shaping``), compilation (``step``) and checkpointing.
"""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import policy_loss, routing
from jaxrlvr.algos import state as state_lib
from jaxrlvr.model import grad_sink, lora, moe, sharding
from jaxrlvr.model import logprobs as logprobs_lib

_f32 = jnp.float32
LRSchedule = optax.Schedule | float | None
Metrics = dict[str, jax.Array]


def check_microbatches(n: int) -> None:
    """Raise ``ValueError`` unless ``n`` (``num_microbatches``) is an integer >= 1."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"num_microbatches must be an integer >= 1, got {n!r}")


def check_chunk_size(n: int | None) -> None:
    """Raise ``ValueError`` unless ``n`` (``logprob_chunk_size``) is None or an integer >= 1."""
    if n is not None and not (isinstance(n, int) and n >= 1):
        raise ValueError(f"logprob_chunk_size must be None or an integer >= 1, got {n!r}")


def check_epochs(n: int) -> None:
    """Raise ``ValueError`` unless ``n`` (``epochs_per_batch``) is an integer >= 1."""
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"epochs_per_batch must be an integer >= 1, got {n!r}")


# ---------------------------------------------------------------------------------------------
# Log-probs of a batch.


def token_logprobs_from_hidden(
    lm: Any,
    hidden_btd: jax.Array,
    labels_bt: jax.Array,
    *,
    entropy_grad: bool = False,
    chunk_size: int | None = None,
    mask_bt: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """log pi(labels) [B, T] and the token entropy [B, T], float32, from final hidden states
    (float32 logits from ``lm.lm_logits``, then ``logprobs_and_entropy``), in chunks of
    ``chunk_size`` positions under remat (``model.logprobs.logprobs_from_hidden``) unless None;
    chunked on a mesh with batch shards, the head splits the vocabulary over them
    (``model.logprobs.vocab_parallel_head``). With ``mask_bt`` both are 0 outside the mask and
    chunks outside it in every row skip the head."""
    head = lm.lm_logits
    if chunk_size is not None:
        tied = lm.lm_head is None
        head = (
            logprobs_lib.vocab_parallel_head(
                lm.config.vocab_size,
                lm.mesh,
                lm.config.head_dtype,
                (lambda w: w) if tied else (lambda w: w.T),
            )
            or head
        )
    # The weight goes in explicitly: inside a grad_sink its gradient accumulates in place.
    return logprobs_lib.logprobs_from_hidden(
        hidden_btd,
        head,
        labels_bt,
        chunk_size=chunk_size,
        entropy_grad=entropy_grad,
        mask_bt=mask_bt,
        weight=lm.lm_head_weight(),
    )


def replay_kwargs(routes_btlk, config) -> dict:
    """``backbone``'s routing-replay argument for ``Batch.routes`` (``algos.routing``), checked
    and laid out against the model's ``config`` (``routing.to_model``): none when the batch
    carries no routes, so a dense model's call is unchanged."""
    return {} if routes_btlk is None else {"routes": routing.to_model(routes_btlk, config)}


def token_logprobs(
    lm: Any, batch: batch_lib.Batch, *, entropy_grad: bool = False, chunk_size: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-probs [B, T], entropy [B, T], final hidden states [B, T, D]) of ``batch.labels``.

    Chunked (``chunk_size``), only loss-mask positions are computed (0 elsewhere): chunks of
    prompt or padding in every row skip the lm_head. Unchunked, every position is."""
    hidden, _ = batch_lib.run_backbone(lm, batch, **replay_kwargs(batch.routes, lm.config))
    logp, ent = token_logprobs_from_hidden(
        lm,
        hidden,
        batch.labels,
        entropy_grad=entropy_grad,
        chunk_size=chunk_size,
        mask_bt=None if chunk_size is None else batch.loss_mask,
    )
    return logp, ent, hidden


def make_logprob_fn(
    graphdef: nnx.GraphDef,
    *,
    num_microbatches: int = 1,
    chunk_size: int | None = None,
    mesh: Any = None,
) -> Callable:
    """``(params, batch) -> (logp [B, T], entropy [B, T])``, float32, un-jitted (jit it).

    For old and reference log-probs: any params with the policy's graph definition (a frozen
    reference model's params need no optimiser state). ``num_microbatches`` > 1 runs the rows in
    ``lax.map`` chunks (same strided split as the updates) and ``chunk_size`` computes the logits
    in chunks of that many positions (``token_logprobs_from_hidden``), both to bound the
    [B, T, V] logits memory; chunked, only ``loss_mask`` positions are computed (0 elsewhere).
    Uses ``input_ids``, ``attention_mask`` and ``labels`` (and the packing fields, shared
    prompts' included, ``loss_mask`` and MoE ``routes``, replayed, when present); other fields
    are ignored.
    """
    check_microbatches(num_microbatches)
    check_chunk_size(chunk_size)

    def logprob_fn(params: nnx.State, batch: batch_lib.Batch) -> tuple[jax.Array, jax.Array]:
        lm = nnx.merge(graphdef, params)
        if batch.input_ids.shape[0] % num_microbatches:
            raise batch_lib.BatchError(
                f"batch size B={batch.input_ids.shape[0]} is not divisible by "
                f"num_microbatches={num_microbatches}"
            )
        inputs = (
            batch.input_ids,
            batch.attention_mask,
            batch.labels,
            batch.positions,
            batch.segment_ids,
            batch.prompt_group_ids,
            batch.loss_mask,
            batch.routes,
        )

        def one(x):
            ids, mask, labels, positions, segment_ids, prompt_group_ids, loss_mask, routes = x
            hidden, _ = lm.backbone(
                ids,
                mask,
                positions,
                segment_ids=segment_ids,
                prompt_group_ids=prompt_group_ids,
                **replay_kwargs(routes, lm.config),
            )
            return token_logprobs_from_hidden(
                lm,
                hidden,
                labels,
                chunk_size=chunk_size,
                mask_bt=None if chunk_size is None else loss_mask,
            )

        if num_microbatches == 1:
            return one(inputs)
        out = jax.lax.map(one, split_microbatches(inputs, num_microbatches, mesh))
        return merge_microbatches(out)

    return logprob_fn


# ---------------------------------------------------------------------------------------------
# Microbatching, accumulation and the update skeleton.


def split_microbatches(tree: Any, n: int, mesh: Any = None) -> Any:
    """[B, ...] leaves -> [n, B/n, ...]; microbatch j holds rows j, j+n, j+2n, ... (strided).

    With a mesh, each microbatch's batch axis is constrained to ('data', 'fsdp') so that every
    microbatch stays spread over the data shards.
    """

    def split(x):
        b = x.shape[0]
        y = x.reshape(b // n, n, *x.shape[1:]).swapaxes(0, 1)
        return sharding.constrain(y, (None, "batch") + (None,) * (y.ndim - 2), mesh)

    return jax.tree.map(split, tree)


def merge_microbatches(tree: Any) -> Any:
    """Inverse of ``split_microbatches``: [n, B/n, ...] -> [B, ...] in the original row order."""

    def merge(y):
        x = y.swapaxes(0, 1)
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])

    return jax.tree.map(merge, tree)


def metric_identity(metrics_shape: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
    """The starting value of each accumulated metric: -inf for ``_max`` keys, +inf for ``_min``
    keys, 0 for sums."""
    out = {}
    for key, s in metrics_shape.items():
        fill = -jnp.inf if key.endswith("_max") else (jnp.inf if key.endswith("_min") else 0.0)
        out[key] = jnp.full(s.shape, fill, s.dtype)
    return out


def accumulate_gradients(
    loss_fn: Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]],
    diff_params: Any,
    microbatches: Any,
) -> tuple[Any, dict[str, jax.Array]]:
    """Sum of ``grad(loss_fn)`` and of its metrics over the leading microbatch axis (lax.scan).

    ``loss_fn(diff_params, microbatch) -> (loss share, metrics)`` must already divide by the
    full-batch denominator; metrics combine by ``policy_loss.accumulate_metrics`` (sum, or
    max/min for ``_max``/``_min`` keys). A MoE model's router terms join each microbatch's
    loss and metrics (``model.moe.add_router_terms``: ``router/*`` metrics, the optional
    load-balancing loss); a dense model's loss is untouched. The loss runs inside a
    ``grad_sink.sink``: leaves the model claims come back from ``jax.grad`` already added to
    the accumulator, the rest are added here.
    """
    first = jax.tree.map(lambda x: x[0], microbatches)
    num_microbatches = jax.tree.leaves(microbatches)[0].shape[0]

    def routed_loss(p, mb):
        # A MoE policy's router signals: the optional aux loss and the router metrics.
        with moe.collect_routers() as routers:
            out = loss_fn(p, mb)
        out = moe.add_router_terms(out, routers, num_microbatches)
        return routing.add_disagreement(out, routers, mb)

    metrics_shape = jax.eval_shape(lambda p, mb: routed_loss(p, mb)[1], diff_params, first)

    def body(carry, mb):
        g_acc, m_acc = carry
        claimed: set = set()

        def sunk_loss(p, mb):
            # The scanned layers and the chunked head add into g_acc in place (grad_sink).
            with grad_sink.sink(p, g_acc) as c:
                out = routed_loss(p, mb)
            claimed.update(c)
            return out

        g, m = jax.grad(sunk_loss, has_aux=True)(diff_params, mb)
        g_acc = jax.tree_util.tree_map_with_path(
            lambda path, a, b: (
                b if jax.tree_util.keystr(path) in claimed else a + b.astype(a.dtype)
            ),
            g_acc,
            g,
        )
        return (g_acc, policy_loss.accumulate_metrics(m_acc, m)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), diff_params)
    (grads, metrics), _ = jax.lax.scan(body, (zeros, metric_identity(metrics_shape)), microbatches)
    return grads, metrics


def learning_rate(lr_schedule: LRSchedule, step: jax.Array) -> jax.Array | None:
    """The rate ``lr_schedule`` gives at ``step`` as float32 (a constant as is; None: none)."""
    if lr_schedule is None:
        return None
    if callable(lr_schedule):
        return jnp.asarray(lr_schedule(step), _f32)
    return jnp.asarray(lr_schedule, _f32)


def finish_update(
    state: state_lib.TrainState,
    grads: Any,
    metrics: dict[str, jax.Array],
    tx: optax.GradientTransformation,
    lr_schedule: LRSchedule,
    tokens: jax.Array,
    value_grads: Any = None,
    value_tx: optax.GradientTransformation | None = None,
) -> tuple[state_lib.TrainState, dict[str, jax.Array]]:
    """The end of every update: apply the optimiser(s) to the accumulated ``grads`` (and a
    critic's ``value_grads`` with ``value_tx``), guard against non-finite steps (the whole state
    is returned unchanged and ``metrics["nonfinite"] = 1``), and finalise the metric sums
    (``policy_loss.finalize_metrics``) with ``grad_norm``, ``learning_rate`` (the rate of
    ``lr_schedule`` at ``state.step``, when given), ``tokens`` and ``nonfinite``."""
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    out = policy_loss.finalize_metrics(metrics)
    if value_grads is not None:
        value_grad_norm = optax.tree.norm(value_grads)
        ok = ok & jnp.isfinite(value_grad_norm)
        out["value_grad_norm"] = value_grad_norm

    def step(state):
        # With LoRA adapters only they are optimised; the frozen base is joined back unchanged.
        trainable, join = lora.split_trainable(state.params)
        updates, opt_state = tx.update(grads, state.opt_state, trainable)
        new_rng, _ = jax.random.split(state.rng)
        new = state.replace(
            step=state.step + 1,
            params=join(optax.apply_updates(trainable, updates)),
            opt_state=opt_state,
            rng=new_rng,
        )
        if value_grads is not None:
            v_updates, v_opt = value_tx.update(
                value_grads, state.value_opt_state, state.value_params
            )
            new = new.replace(
                value_params=optax.apply_updates(state.value_params, v_updates),
                value_opt_state=v_opt,
            )
        return new

    # A non-finite step leaves every array of the state as it was. A branch, not a select per
    # leaf: the select reads the old optimiser moments after the donated buffers are rewritten,
    # so XLA keeps copies of them (one float32 copy of the parameters' size at the peak).
    # The frozen reference params never change and pass around the branch.
    frozen = state.ref_params
    new = jax.lax.cond(ok, step, lambda s: s, state.replace(ref_params=None))
    new = new.replace(ref_params=frozen)
    out["grad_norm"] = grad_norm
    lr = learning_rate(lr_schedule, state.step)
    if lr is not None:
        out["learning_rate"] = lr
    out["tokens"] = tokens
    out["nonfinite"] = (~ok).astype(_f32)
    return new, {k: jnp.asarray(v, _f32) for k, v in out.items()}


def make_update(
    *,
    spec: batch_lib.BatchSpec,
    tx: optax.GradientTransformation,
    lr_schedule: LRSchedule,
    mesh: Any,
    full_batch: Callable[[batch_lib.Batch], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any, Any], tuple[jax.Array, dict[str, jax.Array]]],
    value_tx: optax.GradientTransformation | None = None,
) -> Callable:
    """The one update skeleton every method's factory shares: ``update(state, batch) -> (state,
    metrics)`` with ``update.batch_spec = spec``.

    ``full_batch(batch) -> (rows, consts)``: what must be computed on the FULL batch before it is
    cut (loss denominators, PPO's GAE advantages) as ``consts``, and the per-row pytree ``rows``
    that is split into microbatches. ``loss_fn(diff_params, microbatch_rows, consts)`` returns
    this microbatch's share of the loss (already divided by the full-batch denominator) and its
    metric sums. With ``value_tx`` the differentiated params are ``(params, value_params)`` and
    the critic gets its own optimiser step. ``mesh`` (explicit; None on one device) keeps every
    microbatch spread over the batch shards.
    """

    def update(state: state_lib.TrainState, batch: batch_lib.Batch):
        batch_lib.validate_batch(batch, spec)  # trace time only: shapes and dtypes are static
        if value_tx is not None and state.value_params is None:
            raise ValueError("this update trains a critic but the state has no value_params")
        rows, consts = full_batch(batch)
        mbs = split_microbatches(rows, spec.num_microbatches, mesh)
        # With LoRA adapters (``model.lora``) only they are differentiated; the loss sees them
        # joined with the frozen base, under a per-microbatch dropout key.
        trainable, join = lora.split_trainable(state.params)
        diff = trainable if value_tx is None else (trainable, state.value_params)
        if lora.has_adapters(state.params):
            keys = jax.random.split(jax.random.fold_in(state.rng, 1), spec.num_microbatches)

            def lora_loss(p, mb_key):
                mb, key = mb_key
                full = join(p) if value_tx is None else (join(p[0]), p[1])
                with lora.dropout_rng(key):
                    return loss_fn(full, mb, consts)

            grads, metrics = accumulate_gradients(lora_loss, diff, (mbs, keys))
        else:
            grads, metrics = accumulate_gradients(lambda p, mb: loss_fn(p, mb, consts), diff, mbs)
        value_grads = None
        if value_tx is not None:
            grads, value_grads = grads
        tokens = jnp.sum(batch.attention_mask.astype(_f32))
        return finish_update(
            state,
            grads,
            metrics,
            tx,
            lr_schedule,
            tokens,
            value_grads=value_grads,
            value_tx=value_tx,
        )

    update.batch_spec = spec
    return update


def repeat_epochs(update: Callable, epochs: int) -> Callable:
    """``update`` applied ``epochs`` times to one batch, as one function (one compiled call).

    The epochs run in a ``lax.scan`` whose body is the one-epoch update, so the program holds the
    update once whatever the count and each epoch computes exactly what a separate call would.
    Metrics are the last epoch's, except ``nonfinite``: 1 when any epoch was skipped as
    non-finite (so ``on_nonfinite="raise"`` still sees it). ``epochs == 1`` returns ``update``
    itself. The result carries ``update.batch_spec``.
    """
    check_epochs(epochs)
    if epochs == 1:
        return update

    def repeated(state: state_lib.TrainState, batch: batch_lib.Batch):
        def epoch(state, _):
            return update(state, batch)

        state, per_epoch = jax.lax.scan(epoch, state, None, length=epochs)
        metrics = {k: v[-1] for k, v in per_epoch.items()}
        metrics["nonfinite"] = jnp.max(per_epoch["nonfinite"])
        return state, metrics

    repeated.batch_spec = update.batch_spec
    return repeated
