"""Offline preference optimisation: DPO (and conservative DPO), IPO, SimPO and ORPO.

Each loss is pure over per-pair sequence log-probs ``[P]`` (P preference pairs) and returns
``(loss, metrics)``, a sum of per-pair terms divided by ``denominator`` (default P), so that
microbatches divided by the full batch's pair count add up exactly. Sequence log-probs are
summed over the response tokens (DPO, IPO) or averaged over them (SimPO, ORPO), as each paper
defines; ``sequence_logps`` computes both from per-token log-probs.

Notation: y_w the chosen (preferred) response, y_l the rejected one, pi the policy, pi_ref the
frozen reference, sigma the logistic function, |y| the response length in tokens.

The batch of a preference update (``make_preference_update``; ``preference_algorithm``) is a
plain ``batch.Batch`` of 2P padded rows, stacked: rows 0..P-1 hold the chosen responses and rows
P..2P-1 the rejected ones, row i + P being the rejected response of the pair whose chosen
response is row i (same prompt). The pair index is the position, so no new batch field is
needed; ``ref_logp`` [2P, T] carries the reference's per-token log-probs (DPO, IPO). The update
splits the two halves, cuts each into microbatches of P / n pairs with the same strided split,
and runs one forward over a microbatch's 2P / n rows. Rows are one sequence each (unpacked):
a batch with ``segment_ids`` is refused.

The CS336 (spring 2025) assignment-5 function on one example, ``per_instance_dpo_loss``, is in
``losses`` with the rest of the course's set.

Not here: building pairs (``jaxrlvr.pairs``) and reading them (the driver).
"""

import dataclasses
import typing
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import engine, loss_config, registry

_f32 = jnp.float32
Kind = Literal["dpo", "ipo", "simpo", "orpo"]
Metrics = dict[str, jax.Array]

# Kinds that compare against a frozen reference policy (DPO, IPO); SimPO and ORPO need none.
REFERENCE_KINDS = ("dpo", "ipo")
# Kinds whose paper uses length-normalised (per-token mean) sequence log-probs.
LENGTH_NORMALISED_KINDS = ("simpo", "orpo")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceLossConfig:
    """Which preference objective, and its coefficients.

    kind: "dpo" (Rafailov et al. 2023), "ipo" (Azar et al. 2023), "simpo" (Meng et al. 2024) or
        "orpo" (Hong et al. 2024).
    beta: DPO/IPO/SimPO's beta (IPO's tau: the target margin is 1 / (2 beta)); ORPO's lambda,
        the weight of the odds-ratio term. The papers' usual values: DPO 0.1, IPO 0.1,
        SimPO 2.0-2.5, ORPO 0.1.
    label_smoothing: DPO only, the assumed probability that a label is flipped (conservative
        DPO, Mitchell 2023); 0 is plain DPO.
    gamma: SimPO's target reward margin (the paper's gamma, 0.5-1.5).
    nll_weight: DPO/IPO/SimPO: adds nll_weight times the chosen responses' length-normalised
        negative log-likelihood, -(1/|y_w|) log pi(y_w|x), to the loss (RPO: Pang et al. 2024,
        "Iterative Reasoning Preference Optimization", eq. 1, alpha = 1 there; also Liu et al.
        2024's "RPO"), which keeps the chosen log-probs from falling with the rejected ones.
        0 is the plain loss. ORPO has this term built in (weight 1).
    """

    kind: Kind = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    gamma: float = 1.0
    nll_weight: float = 0.0

    def __post_init__(self) -> None:
        loss_config.check_literal("kind", self.kind, Kind)
        if not self.beta > 0:
            raise ValueError(f"beta must be > 0, got {self.beta!r}")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"label_smoothing must be in [0, 0.5), got {self.label_smoothing!r}")
        if self.label_smoothing and self.kind != "dpo":
            raise ValueError(f"label_smoothing applies to kind='dpo' only, got kind={self.kind!r}")
        if not self.gamma >= 0:
            raise ValueError(f"gamma must be >= 0, got {self.gamma!r}")
        if not self.nll_weight >= 0:
            raise ValueError(f"nll_weight must be >= 0, got {self.nll_weight!r}")
        if self.nll_weight and self.kind == "orpo":
            raise ValueError("nll_weight: kind='orpo' has its own NLL term (weight 1); use beta")

    @property
    def needs_reference(self) -> bool:
        return self.kind in REFERENCE_KINDS

    @property
    def length_normalised(self) -> bool:
        return self.kind in LENGTH_NORMALISED_KINDS


@dataclasses.dataclass(frozen=True, kw_only=True)
class PreferenceUpdateConfig:
    """The preference update: the loss, microbatching (``num_microbatches`` must divide the
    number of pairs P) and ``logprob_chunk_size`` as ``sft.SFTUpdateConfig``."""

    loss: PreferenceLossConfig = dataclasses.field(default_factory=PreferenceLossConfig)
    num_microbatches: int = 1
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        engine.check_microbatches(self.num_microbatches)
        engine.check_chunk_size(self.logprob_chunk_size)


# ---------------------------------------------------------------------------------------------
# Sequence log-probs and the losses.


def sequence_logps(logp_bt: jax.Array, mask_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(sum over response tokens of log pi [B], response length [B]), float32.

    Args:
      logp_bt: float [B, T] per-token log-probs of the labels.
      mask_bt: [B, T] 1 where the label is a response token.
    """
    loss_config.expect_array(logp_bt, "logp_bt", rank=2, kind="float")
    loss_config.expect_array(mask_bt, "mask_bt", shape=logp_bt.shape, kind="mask")
    m = jnp.asarray(mask_bt).astype(_f32)
    # where, not multiply: a -inf/NaN log-prob on padding must not leak into the sum.
    return jnp.sum(jnp.where(m != 0, logp_bt.astype(_f32) * m, 0.0), axis=1), jnp.sum(m, axis=1)


def _check_pairs(**arrays: jax.Array | None) -> int:
    """chex contract: every given array is a float [P] vector of one P; returns P."""
    p = None
    for name, x in arrays.items():
        if x is None:
            continue
        if p is None:
            loss_config.expect_array(x, name, rank=1, kind="real")
            p = x.shape[0]
        loss_config.expect_array(x, name, shape=(p,), kind="real")
    return p


def _reduce(
    loss_p: jax.Array,
    chosen_reward_p: jax.Array,
    rejected_reward_p: jax.Array,
    chosen_logp_p: jax.Array,
    rejected_logp_p: jax.Array,
    denominator: jax.Array | float | None,
    extra: dict[str, jax.Array] | None = None,
) -> tuple[jax.Array, Metrics]:
    """Per-pair terms -> (sum(loss) / denominator, metric sums / denominator)."""
    denom = jnp.asarray(loss_p.shape[0] if denominator is None else denominator, _f32)
    sg = jax.lax.stop_gradient
    terms = {
        "reward_margin": chosen_reward_p - rejected_reward_p,
        "reward_accuracy": (chosen_reward_p > rejected_reward_p).astype(_f32),
        "chosen_reward": chosen_reward_p,
        "rejected_reward": rejected_reward_p,
        "chosen_logp": chosen_logp_p,
        "rejected_logp": rejected_logp_p,
        **(extra or {}),
    }
    loss = jnp.sum(loss_p) / denom
    metrics = {"loss": sg(loss)}
    metrics.update({k: sg(jnp.sum(v.astype(_f32)) / denom) for k, v in terms.items()})
    return loss, metrics


def _f(x: jax.Array) -> jax.Array:
    return jnp.asarray(x).astype(_f32)


def dpo_loss(
    chosen_logp_p: jax.Array,
    rejected_logp_p: jax.Array,
    ref_chosen_logp_p: jax.Array,
    ref_rejected_logp_p: jax.Array,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, Metrics]:
    """Direct Preference Optimization (Rafailov et al. 2023, eq. 7), optionally conservative.

    With the implicit rewards r_w = beta (log pi(y_w|x) - log pi_ref(y_w|x)) and r_l likewise
    (log-probs summed over the response tokens), h = r_w - r_l and label smoothing eps:

        loss = -(1 - eps) log sigma(h) - eps log sigma(-h)

    (eps = 0: DPO; eps > 0: conservative DPO, Mitchell 2023, the labels flipped with
    probability eps.) Equal policy and reference give h = 0 and loss log 2.

    Args:
      chosen_logp_p, rejected_logp_p: float [P], the policy's summed log-probs.
      ref_chosen_logp_p, ref_rejected_logp_p: float [P], the reference's.
      beta: > 0. label_smoothing: in [0, 0.5).
      denominator: the loss is sum / denominator (None: P), for exact microbatching.
    Returns:
      (loss, metrics): loss, reward_margin (mean r_w - r_l), reward_accuracy (fraction with
      r_w > r_l), chosen_reward, rejected_reward, chosen_logp, rejected_logp (means).
    """
    _check_pairs(
        chosen_logp_p=chosen_logp_p,
        rejected_logp_p=rejected_logp_p,
        ref_chosen_logp_p=ref_chosen_logp_p,
        ref_rejected_logp_p=ref_rejected_logp_p,
    )
    cw, cl = _f(chosen_logp_p), _f(rejected_logp_p)
    rw = beta * (cw - jax.lax.stop_gradient(_f(ref_chosen_logp_p)))
    rl = beta * (cl - jax.lax.stop_gradient(_f(ref_rejected_logp_p)))
    h = rw - rl
    loss_p = -(1.0 - label_smoothing) * jax.nn.log_sigmoid(h) - label_smoothing * (
        jax.nn.log_sigmoid(-h)
    )
    return _reduce(loss_p, rw, rl, cw, cl, denominator)


def ipo_loss(
    chosen_logp_p: jax.Array,
    rejected_logp_p: jax.Array,
    ref_chosen_logp_p: jax.Array,
    ref_rejected_logp_p: jax.Array,
    *,
    beta: float,
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, Metrics]:
    """Identity Preference Optimisation (Azar et al. 2023, "A General Theoretical Paradigm to
    Understand Learning from Human Preferences", eq. 17), with tau = ``beta``:

        h = (log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))
        loss = (h - 1 / (2 tau))^2

    on summed sequence log-probs, as the paper defines h (TRL's "ipo" averages over tokens
    instead). Rewards reported as DPO's: beta times the log-ratio. Arguments and metrics as
    ``dpo_loss``.
    """
    _check_pairs(
        chosen_logp_p=chosen_logp_p,
        rejected_logp_p=rejected_logp_p,
        ref_chosen_logp_p=ref_chosen_logp_p,
        ref_rejected_logp_p=ref_rejected_logp_p,
    )
    cw, cl = _f(chosen_logp_p), _f(rejected_logp_p)
    lw = cw - jax.lax.stop_gradient(_f(ref_chosen_logp_p))
    ll = cl - jax.lax.stop_gradient(_f(ref_rejected_logp_p))
    loss_p = jnp.square(lw - ll - 1.0 / (2.0 * beta))
    return _reduce(loss_p, beta * lw, beta * ll, cw, cl, denominator)


def simpo_loss(
    chosen_logp_p: jax.Array,
    rejected_logp_p: jax.Array,
    chosen_len_p: jax.Array,
    rejected_len_p: jax.Array,
    *,
    beta: float,
    gamma: float,
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, Metrics]:
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
    Reward", eq. 6): the length-normalised reward r = beta / |y| log pi(y|x), no reference,
    and a target margin gamma:

        loss = -log sigma(r_w - r_l - gamma)

    Args:
      chosen_logp_p, rejected_logp_p: float [P], SUMMED response log-probs (normalised here).
      chosen_len_p, rejected_len_p: [P] response lengths in tokens (a zero length counts as 1).
      beta: > 0. gamma: >= 0. denominator: as ``dpo_loss``.
    Returns:
      as ``dpo_loss``; chosen_logp / rejected_logp are the per-token means.
    """
    _check_pairs(
        chosen_logp_p=chosen_logp_p,
        rejected_logp_p=rejected_logp_p,
        chosen_len_p=chosen_len_p,
        rejected_len_p=rejected_len_p,
    )
    aw = _f(chosen_logp_p) / jnp.maximum(_f(chosen_len_p), 1.0)
    al = _f(rejected_logp_p) / jnp.maximum(_f(rejected_len_p), 1.0)
    rw, rl = beta * aw, beta * al
    loss_p = -jax.nn.log_sigmoid(rw - rl - gamma)
    return _reduce(loss_p, rw, rl, aw, al, denominator)


def orpo_loss(
    chosen_logp_p: jax.Array,
    rejected_logp_p: jax.Array,
    chosen_len_p: jax.Array,
    rejected_len_p: jax.Array,
    *,
    beta: float,
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, Metrics]:
    """ORPO (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference
    Model", eqs. 2-7), with lambda = ``beta``. With the per-token mean log-likelihood
    a = (1 / |y|) log pi(y|x) and odds(y) = P / (1 - P) for P = exp(a):

        log odds(y) = a - log(1 - exp(a))
        L_OR  = -log sigma(log odds(y_w) - log odds(y_l))
        L_SFT = -a_w                                  (the chosen response's mean NLL)
        loss  = L_SFT + lambda L_OR

    averaged over pairs. ``log1p(-exp(a))`` is evaluated stably (``_log1mexp``). Rewards are
    reported as TRL does, beta times the mean log-probs; also ``nll`` (mean L_SFT) and
    ``log_odds_ratio`` (mean of the log odds difference).
    Arguments as ``simpo_loss`` (summed log-probs and lengths).
    """
    _check_pairs(
        chosen_logp_p=chosen_logp_p,
        rejected_logp_p=rejected_logp_p,
        chosen_len_p=chosen_len_p,
        rejected_len_p=rejected_len_p,
    )
    aw = _f(chosen_logp_p) / jnp.maximum(_f(chosen_len_p), 1.0)
    al = _f(rejected_logp_p) / jnp.maximum(_f(rejected_len_p), 1.0)
    log_odds = (aw - _log1mexp(aw)) - (al - _log1mexp(al))
    nll = -aw
    loss_p = nll - beta * jax.nn.log_sigmoid(log_odds)
    extra = {"nll": nll, "log_odds_ratio": log_odds}
    return _reduce(loss_p, beta * aw, beta * al, aw, al, denominator, extra)


def _log1mexp(a: jax.Array) -> jax.Array:
    """log(1 - exp(a)) for a < 0 (Maechler 2012): log(-expm1(a)) near 0, log1p(-exp(a)) below
    -log 2. A mean log-prob of exactly 0 (probability 1) is clipped to -1e-6 so the odds stay
    finite."""
    a = jnp.minimum(a, -1e-6)
    return jnp.where(a > -np.log(2.0), jnp.log(-jnp.expm1(a)), jnp.log1p(-jnp.exp(a)))


def preference_loss(
    chosen_logp_p: jax.Array,
    rejected_logp_p: jax.Array,
    chosen_len_p: jax.Array,
    rejected_len_p: jax.Array,
    cfg: PreferenceLossConfig,
    *,
    ref_chosen_logp_p: jax.Array | None = None,
    ref_rejected_logp_p: jax.Array | None = None,
    denominator: jax.Array | float | None = None,
) -> tuple[jax.Array, Metrics]:
    """The loss ``cfg.kind`` on summed sequence log-probs and lengths (the update's entry point),
    plus ``cfg.nll_weight`` times the chosen responses' mean per-token NLL (RPO; then the
    metrics add ``nll``, sum over pairs of -log pi(y_w)/|y_w| divided by ``denominator``).

    The reference log-probs are required by DPO and IPO and ignored by SimPO and ORPO.
    """
    loss, metrics = _kind_loss(
        chosen_logp_p,
        rejected_logp_p,
        chosen_len_p,
        rejected_len_p,
        cfg,
        ref_chosen_logp_p=ref_chosen_logp_p,
        ref_rejected_logp_p=ref_rejected_logp_p,
        denominator=denominator,
    )
    if cfg.nll_weight:
        nll_p = -_f(chosen_logp_p) / jnp.maximum(_f(chosen_len_p), 1.0)
        denom = jnp.asarray(nll_p.shape[0] if denominator is None else denominator, _f32)
        nll = jnp.sum(nll_p) / denom
        loss = loss + cfg.nll_weight * nll
        metrics = {**metrics, "loss": jax.lax.stop_gradient(loss)}
        metrics["nll"] = jax.lax.stop_gradient(nll)
    return loss, metrics


def _kind_loss(
    chosen_logp_p: jax.Array,
    rejected_logp_p: jax.Array,
    chosen_len_p: jax.Array,
    rejected_len_p: jax.Array,
    cfg: PreferenceLossConfig,
    *,
    ref_chosen_logp_p: jax.Array | None,
    ref_rejected_logp_p: jax.Array | None,
    denominator: jax.Array | float | None,
) -> tuple[jax.Array, Metrics]:
    """``preference_loss`` without the NLL term: dispatch on ``cfg.kind``."""
    if cfg.needs_reference and (ref_chosen_logp_p is None or ref_rejected_logp_p is None):
        raise ValueError(f"kind={cfg.kind!r} needs ref_chosen_logp_p and ref_rejected_logp_p")
    if cfg.kind == "dpo":
        return dpo_loss(
            chosen_logp_p,
            rejected_logp_p,
            ref_chosen_logp_p,
            ref_rejected_logp_p,
            beta=cfg.beta,
            label_smoothing=cfg.label_smoothing,
            denominator=denominator,
        )
    if cfg.kind == "ipo":
        return ipo_loss(
            chosen_logp_p,
            rejected_logp_p,
            ref_chosen_logp_p,
            ref_rejected_logp_p,
            beta=cfg.beta,
            denominator=denominator,
        )
    lengths = (chosen_logp_p, rejected_logp_p, chosen_len_p, rejected_len_p)
    if cfg.kind == "simpo":
        return simpo_loss(*lengths, beta=cfg.beta, gamma=cfg.gamma, denominator=denominator)
    return orpo_loss(*lengths, beta=cfg.beta, denominator=denominator)


# ---------------------------------------------------------------------------------------------
# The update.


def split_pairs(batch: batch_lib.Batch) -> tuple[batch_lib.Batch, batch_lib.Batch]:
    """(chosen rows, rejected rows) of a stacked pair batch: rows [0, P) and [P, 2P)."""
    b = batch.input_ids.shape[0]
    if b % 2:
        raise batch_lib.BatchError(
            f"a preference batch stacks P chosen then P rejected rows; got B={b} (odd)"
        )
    p = b // 2
    return jax.tree.map(lambda x: x[:p], batch), jax.tree.map(lambda x: x[p:], batch)


def stack_pairs(chosen: batch_lib.Batch, rejected: batch_lib.Batch) -> batch_lib.Batch:
    """Inverse of ``split_pairs``."""
    return jax.tree.map(lambda a, b: jnp.concatenate([a, b], axis=0), chosen, rejected)


def preference_batch_spec(cfg: PreferenceUpdateConfig) -> batch_lib.BatchSpec:
    """The fields the update reads: the base fields, and ``ref_logp`` for DPO/IPO. The pair
    count P = B / 2 must be divisible by ``num_microbatches`` (each microbatch holds whole pairs;
    checked by the update at trace time)."""
    return batch_lib.BatchSpec(
        required=("ref_logp",) if cfg.loss.needs_reference else (),
        num_microbatches=cfg.num_microbatches,
    )


def make_preference_update(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: PreferenceUpdateConfig | None = None,
    *,
    lr_schedule: engine.LRSchedule = None,
    mesh: Any = None,
) -> Callable:
    """Preference update on a stacked pair batch (module docstring): loss = sum over pairs of
    the per-pair loss / P, microbatched over pairs by ``engine.make_update`` (one epoch).

    Metrics: ``loss``, ``reward_margin``, ``reward_accuracy`` (preference accuracy),
    ``chosen_reward``, ``rejected_reward``, ``chosen_logp``, ``rejected_logp`` (means over
    pairs; for SimPO/ORPO the log-probs are per-token means), ORPO's ``nll`` and
    ``log_odds_ratio``, ``token_count`` (response tokens of both sides), plus the skeleton's
    ``grad_norm``, ``learning_rate``, ``tokens``, ``nonfinite``.
    """
    cfg = cfg or PreferenceUpdateConfig()
    spec = preference_batch_spec(cfg)

    def full_batch(batch):
        if batch.segment_ids is not None:
            raise batch_lib.BatchError(
                "batch.segment_ids: preference batches are unpacked (one sequence per row)"
            )
        chosen, rejected = split_pairs(batch)
        p = chosen.input_ids.shape[0]
        if p % cfg.num_microbatches:
            raise batch_lib.BatchError(
                f"{p} pairs (B={2 * p} rows) do not divide into "
                f"num_microbatches={cfg.num_microbatches}"
            )
        return (chosen, rejected), jnp.asarray(chosen.input_ids.shape[0], _f32)

    def loss_fn(params, mb, num_pairs):
        chosen, rejected = mb
        both = stack_pairs(chosen, rejected)
        lm = nnx.merge(graphdef, params)
        logp, _, _ = engine.token_logprobs(lm, both, chunk_size=cfg.logprob_chunk_size)
        seq, length = sequence_logps(logp, both.loss_mask)
        p = chosen.input_ids.shape[0]
        ref = (None, None)
        if cfg.loss.needs_reference:
            ref_seq, _ = sequence_logps(both.ref_logp, both.loss_mask)
            ref = (ref_seq[:p], ref_seq[p:])
        loss, metrics = preference_loss(
            seq[:p],
            seq[p:],
            length[:p],
            length[p:],
            cfg.loss,
            ref_chosen_logp_p=ref[0],
            ref_rejected_logp_p=ref[1],
            denominator=num_pairs,
        )
        metrics["token_count"] = jnp.sum(length)
        return loss, metrics

    return engine.make_update(
        spec=spec, tx=tx, lr_schedule=lr_schedule, mesh=mesh, full_batch=full_batch, loss_fn=loss_fn
    )


def preference_algorithm(
    graphdef: nnx.GraphDef,
    optimizer: algorithm_lib.Optimizer,
    cfg: PreferenceUpdateConfig | None = None,
    *,
    mesh: Any = None,
    logprob_microbatches: int | None = None,
    epochs_per_batch: int = 1,
) -> algorithm_lib.Algorithm:
    """Offline preference optimisation: DPO, IPO, SimPO or ORPO (``cfg.loss.kind``, also the
    record's name) on stacked pair batches (module docstring: P chosen rows, then the P
    rejected rows in the same order; unpacked), each batch trained ``epochs_per_batch`` times per
    ``update`` call (``algorithm.with_epochs``).

    ``init`` copies the policy as the frozen reference for DPO and IPO (SimPO and ORPO are
    reference-free). ``prepare`` computes the reference's ``ref_logp`` for the batch, in
    ``logprob_microbatches`` chunks (default: the update's microbatches), unless the batch
    already carries ``ref_logp``: a reference computed once for the whole data set and cached
    (the driver's ``pref.cache_reference``; the reference is frozen, so the values are the
    same) passes through, and no reference forward runs.
    """
    cfg = cfg or PreferenceUpdateConfig()
    tx, schedule = algorithm_lib.resolve_optimizer(optimizer)
    engine.check_epochs(epochs_per_batch)
    update = make_preference_update(graphdef, tx, cfg, lr_schedule=schedule, mesh=mesh)
    needs_ref = cfg.loss.needs_reference
    logprob_fn = engine.make_logprob_fn(
        graphdef,
        num_microbatches=logprob_microbatches or cfg.num_microbatches,
        chunk_size=cfg.logprob_chunk_size,
        mesh=mesh,
    )

    def prepare(state, rollouts):
        if needs_ref and rollouts.ref_logp is None:
            ref_logp = logprob_fn(state.reference_params(), rollouts)[0]
            rollouts = rollouts.replace(ref_logp=ref_logp)
        return algorithm_lib.select_fields(rollouts, update.batch_spec), {}

    record = algorithm_lib.Algorithm(
        name=cfg.loss.kind,
        init=algorithm_lib.make_init(graphdef, tx, reference=needs_ref),
        prepare=prepare,
        update=update,
        rollout_spec=batch_lib.BatchSpec(
            optional=("ref_logp",) if needs_ref else (), num_microbatches=cfg.num_microbatches
        ),
    )
    return algorithm_lib.with_epochs(record, epochs_per_batch)


def build(cfg, graphdef, params_shape, mesh, microbatches) -> algorithm_lib.Algorithm:
    """``rl.algo``: dpo, ipo, simpo or orpo from the run config: the loss from ``pref`` (the
    preference phase's section: its data and coefficients), the rest from ``rl``."""
    del params_shape
    pref = cfg.pref
    loss = PreferenceLossConfig(
        kind=cfg.rl.algo,
        beta=pref.beta,
        label_smoothing=pref.label_smoothing,
        gamma=pref.gamma,
        nll_weight=pref.nll_weight,
    )
    pref_cfg = PreferenceUpdateConfig(
        loss=loss, num_microbatches=microbatches, logprob_chunk_size=cfg.rl.logprob_chunk_size
    )
    return preference_algorithm(
        graphdef, cfg.optim, pref_cfg, mesh=mesh, epochs_per_batch=cfg.rl.epochs_per_step
    )


for _kind in typing.get_args(Kind):
    registry.register(registry.Method(name=_kind, build=build, data="pairs"))
