"""Update factories: pure ``update(state, batch) -> (state, metrics)`` functions for SFT, expert
iteration, GRPO-style policy gradient and PPO, plus the log-prob function for old/reference
log-probs.

Every factory closes over the static pieces (the model's ``nnx.GraphDef``, the optax
transformation, the loss config) and returns an un-jitted function; ``step.jit_update`` compiles
it with donation and explicit shardings. Inside one call:

1. the batch is checked against ``update.batch_spec`` (shapes and dtypes are static, so this
   happens at trace time, before compilation; ``step.jit_update`` also checks on the host);
2. the loss denominator is computed on the FULL batch (``aggregation.loss_denominator``), then
   the batch is cut into ``num_microbatches`` microbatches and ``lax.scan`` sums each one's
   gradient and metrics. Every loss is "sum of per-row terms / global denominator", so the sum
   equals the full-batch gradient exactly (up to float summation order). Microbatch j holds rows
   j, j + n, j + 2n, ...: with the batch sharded in contiguous blocks over ('data', 'fsdp'), every
   microbatch stays spread over all data shards without any data movement. The scanned
   (remat) layers and the chunked head add their gradient into the accumulator in place
   (``model.grad_sink``), so no microbatch's whole gradient exists beside it;
3. the optax chain (``optim.make_optimizer``: global-norm clipping, AdamW, schedule) is applied;
4. if the loss or the pre-clip gradient norm is not finite, the whole state (step, params,
   optimiser state, rng, critic) is returned unchanged (a ``lax.cond`` around the optimiser)
   and ``metrics["nonfinite"] = 1``;
   ``step.jit_update(on_nonfinite="raise")`` turns that into a host-side error.

Metrics are float32 scalars: ``loss``, ``policy_loss``, ``pg_loss``, ``kl_loss``, ``kl``,
``entropy``, ``clip_frac`` (and low/high/dual), ``ratio``/``ratio_max``/``ratio_min``, the
truncated-IS figures ``tis_weight``, ``tis_truncated``, ``logp_diff_abs``(``_max``),
``grad_norm`` (before clipping), ``learning_rate`` (the rate applied at this step),
``token_count`` (loss tokens), ``tokens`` (all non-pad tokens processed), ``nonfinite``;
PPO adds ``vf_loss``, ``vf_clip_frac``, ``vf_error_sq``, ``value_grad_norm``, ``advantage_mean``,
``return_mean``, ``value_mean``; SFT reports ``nll`` (mean per loss token) instead of the policy
figures.

Several epochs over one rollout batch (GRPO/PPO): the driver calls the update once per epoch with
the same batch, whose ``old_logp`` was computed once by ``make_logprob_fn`` before the first
epoch; the clipped ratio then measures the drift since the rollout. For a single on-policy epoch
``old_logp`` may be left None: the update then uses the current log-probs (ratio 1) and saves a
forward pass.

Not here: rollouts, rewards and advantages for GRPO (the driver computes them with
``advantages``/``shaping`` and passes ``batch.advantages``), and checkpointing.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrlvr.algos import aggregation, gae, kl, loss_config, policy_loss, segments, value
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import state as state_lib
from jaxrlvr.model import grad_sink, sharding
from jaxrlvr.model import logprobs as logprobs_lib

_f32 = jnp.float32
LRSchedule = optax.Schedule | float | None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTUpdateConfig:
    """Supervised fine-tuning (and expert iteration) loss.

    normalize_constant: None -> mean NLL over all loss tokens of the batch; a number C -> the
        CS336 ``sft_microbatch_train_step`` loss sum_bt(-logp * mask) / (B * C).
    num_microbatches: gradient-accumulation microbatches per optimiser step.
    logprob_chunk_size: positions per lm_head/log-softmax chunk (``token_logprobs_from_hidden``);
        None: the whole [B, T, V] logits at once.
    """

    normalize_constant: float | None = None
    num_microbatches: int = 1
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        if self.normalize_constant is not None and not self.normalize_constant > 0:
            raise ValueError(
                f"normalize_constant must be None or > 0, got {self.normalize_constant!r}"
            )
        _check_microbatches(self.num_microbatches)
        _check_chunk_size(self.logprob_chunk_size)


@dataclasses.dataclass(frozen=True, kw_only=True)
class GRPOUpdateConfig:
    """GRPO / policy-gradient update: the ``policy_loss`` objective with every option of
    ``PolicyLossConfig`` (aggregation, clip-higher, dual clip, GSPO, KL, entropy, TIS).
    ``logprob_chunk_size`` as ``SFTUpdateConfig`` (also used by the old/reference passes)."""

    loss: loss_config.PolicyLossConfig = dataclasses.field(
        default_factory=loss_config.PolicyLossConfig
    )
    num_microbatches: int = 1
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        _check_microbatches(self.num_microbatches)
        _check_chunk_size(self.logprob_chunk_size)


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
    logprob_chunk_size: as ``SFTUpdateConfig``.
    """

    loss: loss_config.PolicyLossConfig = dataclasses.field(
        default_factory=loss_config.PolicyLossConfig
    )
    num_microbatches: int = 1
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_microbatches(self.num_microbatches)
        _check_chunk_size(self.logprob_chunk_size)


def _check_microbatches(n: int) -> None:
    if not (isinstance(n, int) and n >= 1):
        raise ValueError(f"num_microbatches must be an integer >= 1, got {n!r}")


def _check_chunk_size(n: int | None) -> None:
    if n is not None and not (isinstance(n, int) and n >= 1):
        raise ValueError(f"logprob_chunk_size must be None or an integer >= 1, got {n!r}")


# ---------------------------------------------------------------------------------------------
# Module-level helpers (importable by tests and the benchmark).


def logprobs_and_entropy(
    logits_btv: jax.Array, labels_bt: jax.Array, *, entropy_grad: bool = False
) -> tuple[jax.Array, jax.Array]:
    """log softmax(z)[label] and the entropy of softmax(z), float32 [B, T], in one pass over V
    (``model.logprobs.logprobs_and_entropy``, shared with the sampler and ``losses``)."""
    return logprobs_lib.logprobs_and_entropy(logits_btv, labels_bt, entropy_grad=entropy_grad)


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
                lm.config.compute_dtype,
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


def token_logprobs(
    lm: Any, batch: batch_lib.Batch, *, entropy_grad: bool = False, chunk_size: int | None = None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(log-probs [B, T], entropy [B, T], final hidden states [B, T, D]) of ``batch.labels``.

    Chunked (``chunk_size``), only loss-mask positions are computed (0 elsewhere): chunks of
    prompt or padding in every row skip the lm_head. Unchunked, every position is."""
    hidden, _ = lm.backbone(
        batch.input_ids, batch.attention_mask, batch.positions, segment_ids=batch.segment_ids
    )
    logp, ent = token_logprobs_from_hidden(
        lm,
        hidden,
        batch.labels,
        entropy_grad=entropy_grad,
        chunk_size=chunk_size,
        mask_bt=None if chunk_size is None else batch.loss_mask,
    )
    return logp, ent, hidden


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


def _metric_identity(metrics_shape: dict[str, jax.ShapeDtypeStruct]) -> dict[str, jax.Array]:
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
    max/min for ``_max``/``_min`` keys). The loss runs inside a ``grad_sink.sink``: leaves the
    model claims come back from ``jax.grad`` already added to the accumulator, the rest are
    added here.
    """
    first = jax.tree.map(lambda x: x[0], microbatches)
    metrics_shape = jax.eval_shape(lambda p, mb: loss_fn(p, mb)[1], diff_params, first)

    def body(carry, mb):
        g_acc, m_acc = carry
        claimed: set = set()

        def sunk_loss(p, mb):
            # The scanned layers and the chunked head add into g_acc in place (grad_sink).
            with grad_sink.sink(p, g_acc) as c:
                out = loss_fn(p, mb)
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
    (grads, metrics), _ = jax.lax.scan(body, (zeros, _metric_identity(metrics_shape)), microbatches)
    return grads, metrics


def _learning_rate(lr_schedule: LRSchedule, step: jax.Array) -> jax.Array | None:
    if lr_schedule is None:
        return None
    if callable(lr_schedule):
        return jnp.asarray(lr_schedule(step), _f32)
    return jnp.asarray(lr_schedule, _f32)


def _finish(
    state: state_lib.TrainState,
    grads: Any,
    metrics: dict[str, jax.Array],
    tx: optax.GradientTransformation,
    lr_schedule: LRSchedule,
    tokens: jax.Array,
    value_grads: Any = None,
    value_tx: optax.GradientTransformation | None = None,
) -> tuple[state_lib.TrainState, dict[str, jax.Array]]:
    """Apply the optimiser(s), guard against non-finite steps, and finalise the metrics."""
    grad_norm = optax.tree.norm(grads)
    ok = jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
    out = policy_loss.finalize_metrics(metrics)
    if value_grads is not None:
        value_grad_norm = optax.tree.norm(value_grads)
        ok = ok & jnp.isfinite(value_grad_norm)
        out["value_grad_norm"] = value_grad_norm

    def step(state):
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        new_rng, _ = jax.random.split(state.rng)
        new = state.replace(
            step=state.step + 1,
            params=optax.apply_updates(state.params, updates),
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
    lr = _learning_rate(lr_schedule, state.step)
    if lr is not None:
        out["learning_rate"] = lr
    out["tokens"] = tokens
    out["nonfinite"] = (~ok).astype(_f32)
    return new, {k: jnp.asarray(v, _f32) for k, v in out.items()}


def _make_update(
    *,
    spec: batch_lib.BatchSpec,
    tx: optax.GradientTransformation,
    lr_schedule: LRSchedule,
    mesh: Any,
    full_batch: Callable[[batch_lib.Batch], tuple[Any, Any]],
    loss_fn: Callable[[Any, Any, Any], tuple[jax.Array, dict[str, jax.Array]]],
    value_tx: optax.GradientTransformation | None = None,
) -> Callable:
    """The one update skeleton every factory shares.

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
        diff = state.params if value_tx is None else (state.params, state.value_params)
        grads, metrics = accumulate_gradients(lambda p, mb: loss_fn(p, mb, consts), diff, mbs)
        value_grads = None
        if value_tx is not None:
            grads, value_grads = grads
        tokens = jnp.sum(batch.attention_mask.astype(_f32))
        return _finish(
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


# ---------------------------------------------------------------------------------------------
# Factories.


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
    Uses ``input_ids``, ``attention_mask`` and ``labels`` (and the packing fields and
    ``loss_mask`` when present); other fields are ignored.
    """
    _check_microbatches(num_microbatches)
    _check_chunk_size(chunk_size)

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
            batch.loss_mask,
        )

        def one(x):
            ids, mask, labels, positions, segment_ids, loss_mask = x
            hidden, _ = lm.backbone(ids, mask, positions, segment_ids=segment_ids)
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


def make_sft_update(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: SFTUpdateConfig | None = None,
    *,
    lr_schedule: LRSchedule = None,
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
        logp, ent, _ = token_logprobs(lm, mb, chunk_size=cfg.logprob_chunk_size)
        nll = aggregation.masked_rows(-logp, mb.loss_mask)
        loss = jnp.sum(nll) / denom
        return loss, {
            "loss": jax.lax.stop_gradient(loss),
            "nll_sum": jax.lax.stop_gradient(jnp.sum(nll)),
            "entropy_sum": jnp.sum(aggregation.masked_rows(ent, mb.loss_mask)),
            "token_count": jnp.sum(mb.loss_mask.astype(_f32)),
        }

    spec = batch_lib.BatchSpec(num_microbatches=cfg.num_microbatches)
    return _make_update(
        spec=spec, tx=tx, lr_schedule=lr_schedule, mesh=mesh, full_batch=full_batch, loss_fn=loss_fn
    )


def make_expert_iteration_update(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: SFTUpdateConfig | None = None,
    *,
    lr_schedule: LRSchedule = None,
    mesh: Any = None,
) -> Callable:
    """Expert iteration (Anthony et al. 2017; the CS336 EI experiment): the SFT update, applied to
    batches of the policy's own rollouts that the verifier marked correct.

    The filtering happens in the driver (keep completions with reward 1, tokenise them as SFT
    pairs); the update is exactly ``make_sft_update`` with the same arguments.
    """
    return make_sft_update(graphdef, tx, cfg, lr_schedule=lr_schedule, mesh=mesh)


def _policy_spec(loss: loss_config.PolicyLossConfig, required: tuple[str, ...], n: int):
    req = list(required)
    optional = ["ref_logp", "sampler_logp"]
    if loss.kl_coef > 0 and loss.kl_in == "loss":
        req.append("ref_logp")
    if loss.tis != "none":
        req.append("sampler_logp")
    optional = [f for f in optional if f not in req]
    return batch_lib.BatchSpec(
        required=tuple(req), optional=tuple(optional) + ("old_logp",), num_microbatches=n
    )


def _policy_terms(logp, ent, mb, adv, mask, loss_cfg, denom):
    old = mb.old_logp if mb.old_logp is not None else jax.lax.stop_gradient(logp)
    loss, metrics = policy_loss.policy_loss(
        logp,
        old,
        adv,
        mask,
        loss_cfg,
        denominator=denom,
        ref_logp_bt=mb.ref_logp,
        sampler_logp_bt=mb.sampler_logp,
        entropy_bt=ent,
        segment_ids_bt=mb.segment_ids,
    )
    metrics = dict(metrics)
    metrics["policy_loss"] = metrics["loss"]
    return loss, metrics


def make_grpo_update(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: GRPOUpdateConfig | None = None,
    *,
    lr_schedule: LRSchedule = None,
    mesh: Any = None,
) -> Callable:
    """GRPO / policy-gradient update on per-sequence advantages (``policy_loss.policy_loss``).

    The batch needs ``advantages`` [B]; ``old_logp`` (None: on-policy, ratio 1); ``ref_logp``
    when ``kl_coef > 0`` with ``kl_in="loss"``; ``sampler_logp`` when ``tis != "none"``.
    See the module docstring for epochs over one rollout batch. Other arguments as
    ``make_sft_update``.
    """
    cfg = cfg or GRPOUpdateConfig()
    entropy_grad = cfg.loss.entropy_coef != 0

    def full_batch(batch):
        return batch, aggregation.loss_denominator(batch.loss_mask, cfg.loss, batch.segment_ids)

    def loss_fn(params, mb, denom):
        lm = nnx.merge(graphdef, params)
        logp, ent, _ = token_logprobs(
            lm, mb, entropy_grad=entropy_grad, chunk_size=cfg.logprob_chunk_size
        )
        return _policy_terms(logp, ent, mb, mb.advantages, mb.loss_mask, cfg.loss, denom)

    return _make_update(
        spec=_policy_spec(cfg.loss, ("advantages",), cfg.num_microbatches),
        tx=tx,
        lr_schedule=lr_schedule,
        mesh=mesh,
        full_batch=full_batch,
        loss_fn=loss_fn,
    )


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
            batch.old_logp, batch.ref_logp, loss.kl_estimator, log_ratio_clamp=loss.log_ratio_clamp
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
    lr_schedule: LRSchedule = None,
    value_graphdef: nnx.GraphDef | None = None,
    mesh: Any = None,
) -> Callable:
    """PPO update: clipped policy loss on GAE advantages + vf_coef * clipped value loss.

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
    required = ("rewards", "old_values", "old_logp")
    if cfg.loss.kl_coef > 0:
        required += ("ref_logp",)
    spec = _policy_spec(cfg.loss, required, cfg.num_microbatches)
    spec = dataclasses.replace(spec, optional=tuple(f for f in spec.optional if f not in required))
    entropy_grad = cfg.loss.entropy_coef != 0
    token_mean = dataclasses.replace(cfg.loss, aggregation="token_mean", norm_constant=None)

    def full_batch(batch):
        adv_bt, returns_bt = ppo_advantages(batch, cfg)
        denom = aggregation.loss_denominator(batch.loss_mask, cfg.loss, batch.segment_ids)
        v_denom = aggregation.loss_denominator(batch.loss_mask, token_mean)
        return (batch, adv_bt, returns_bt), (denom, v_denom)

    def loss_fn(both, xs, consts):
        params, value_params = both
        mb, adv, returns = xs
        denom, v_denom = consts
        lm = nnx.merge(graphdef, params)
        logp, ent, hidden = token_logprobs(
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
            )
        else:
            if cfg.trunk == "detached":
                hidden = jax.lax.stop_gradient(hidden)
            values = value.values_from_hidden(value_params, hidden)
        p_loss, metrics = _policy_terms(logp, ent, mb, adv, mb.loss_mask, cfg.loss, denom)
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

    return _make_update(
        spec=spec,
        tx=tx,
        lr_schedule=lr_schedule,
        mesh=mesh,
        full_batch=full_batch,
        loss_fn=loss_fn,
        value_tx=value_tx,
    )
