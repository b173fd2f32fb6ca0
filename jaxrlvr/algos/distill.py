"""On-policy distillation: the per-token signal a teacher gives on the student's own samples.

Two signals, both on completions the student sampled itself (on-policy: Agarwal et al. 2024,
"On-Policy Distillation of Language Models", GKD):

1. Reverse KL as a per-token advantage (Thinking Machines' on-policy distillation, tinker-cookbook
   ``distillation/train_on_policy.py``; TRL's DistillationTrainer at beta 1 on sampled tokens)::

       A_t = -kl_coef * (log pi_student(y_t) - log pi_teacher(y_t)) + reward_coef * A_reward

   on the student's sampled token y_t, with discount 0 (each token's advantage is its own term,
   no return over later tokens), no value model and no group baseline. It enters the ordinary
   policy-gradient objective (``policy_loss.policy_loss``, every option of
   ``PolicyLossConfig``) as a per-token advantage. Its expected gradient at one position is the
   reverse KL's: with y ~ pi and q the teacher,

       E_y[-A(y) grad log pi(y)] = sum_y pi(y) (log pi(y) - log q(y)) grad log pi(y)
                                 = grad KL(pi || q)

   (the exact gradient's extra term sum_y pi(y) grad log pi(y) is 0). The student log-prob in
   A carries no gradient: the trainer's ``old_logp`` when the batch has it, otherwise the
   current log-prob behind a stop-gradient. ``A_reward`` is the verifiable reward's advantage
   (``advantages``), per sequence [B] or per token [B, T]; ``reward_coef`` 0 leaves it out.

2. The generalised Jensen-Shannon divergence of each position's next-token distributions
   (GKD eq. 1, TRL's ``GKDTrainer.generalized_jsd_loss`` convention), S the student, T the
   teacher, both softmax(logits / temperature)::

       M = beta * T + (1 - beta) * S
       JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)     0 < beta < 1
       beta = 0: KL(T || S) (forward KL)      beta = 1: KL(S || T) (reverse KL)

   The endpoints are defined directly, as TRL does (the mixture formula itself vanishes at 0
   and 1). Over the full vocabulary (``generalized_jsd``) or over the teacher's top-k tokens
   (``generalized_jsd_topk``), in one of two forms:

   - the tail bucket (the default; TRL's server distillation ``_add_tail_bucket``,
     ``loss_add_tail=True``): the student's full-vocabulary log-probs gathered at the teacher's
     top-k ids and the teacher's top-k log-probs each get a (K+1)-th bucket holding the rest
     of the mass, log(1 - sum_k p_k) (the log-sum clamped at <= -1e-7), and the divergence
     runs over the K+1 buckets. A student that puts its mass outside the teacher's top-k is
     punished for it: with the teacher 98.5 % inside its top 4 and the student 23 %, the
     reverse KL is 3.07 with the tail, 1.63 renormalised, 3.68 over the vocabulary (the
     test of this example). It needs normalised teacher log-probs at temperature 1 (what both
     teachers return), so another temperature is refused with it;
   - renormalised (``top_k_tail: false``; ms-swift, and TRL with ``loss_add_tail=False``):
     both distributions renormalised over the K tokens. It ignores the student's mass
     outside the teacher's top-k, and at K = 1 it is exactly 0 (refused).

   With K = V both equal the full one. It is a loss differentiated through the student's
   whole distribution, never an advantage: a divergence summed over the vocabulary does not
   depend on the sampled token, so as an advantage its expected gradient is 0 (miles issue 2362).

Both reduce with ``aggregation.aggregate`` over the FULL batch's denominator and report sums plus
``token_count`` (``policy_loss``'s metrics contract), so they are exact under microbatching and
packing (segment ids). Every function is pure over arrays, opens with chex contracts and runs
the same with or without jit.

The record (``distill_algorithm``, ``DistillUpdateConfig``) trains either signal with GRPO's
update skeleton: the reverse KL with ``teacher_logp`` as a rollout field, the JSD over the
teacher's top-k with ``teacher_topk_ids`` / ``teacher_topk_logp`` (the student's logits per
position in chunks, ``topk_jsd_from_hidden``).

Not here: the teachers' forward passes (``jaxrlvr.teachers``, ``teachers.vllm``) and the
choice of a teacher per problem (``jaxrlvr.teachers``).
"""

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrlvr.algos import (
    aggregation,
    engine,
    kl,
    loss_config,
    policy_gradient,
    policy_loss,
    registry,
    segments,
)
from jaxrlvr.algos import algorithm as algorithm_lib
from jaxrlvr.algos import batch as batch_lib

_f32 = jnp.float32
Signal = Literal["reverse_kl", "jsd"]

# The rollout fields the teacher's scores arrive in (``batch.register_field``; the pass
# ``passes.teacher_scores`` fills them): the teacher's log-prob of each label [B, T] (reverse KL),
# or its K most likely next tokens and their log-probs [B, T, K] (the JSD over the top-k).
TEACHER_LOGP = batch_lib.register_field("teacher_logp", "bt", "float")
TEACHER_TOPK_IDS = batch_lib.register_field("teacher_topk_ids", "btk", "int")
TEACHER_TOPK_LOGP = batch_lib.register_field("teacher_topk_logp", "btk", "float")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillConfig:
    """On-policy distillation's one config record (``rl.distill`` in YAML): what the teacher's
    signal is, how it mixes with the verifiable reward, and where the teachers are.

    teacher: the default teacher, a checkpoint / Hugging Face folder (a local JAX teacher, loaded
        once on the run's mesh in ``teacher_dtype``) or a vLLM server URL (``http(s)://``).
    teachers: teachers by a problem's domain (domain -> folder or URL; problems without a domain
        of their own are domain "default"). A problem whose domain has no teacher is refused
        before any compute unless ``teacher`` is set.
    signal: "reverse_kl" (the per-token advantage, needs the teacher's log-prob of each sampled
        token) or "jsd" (the generalised JSD loss, needs the teacher's logits or top-k).
    kl_coef: the reverse-KL advantage's coefficient (>= 0); under "jsd" the JSD loss's (> 0).
    reward_coef: the verifiable reward's advantage coefficient (>= 0; 0: pure distillation);
        refused under "jsd" (no advantage to mix it into).
    beta: the JSD's interpolation in [0, 1] (0 forward KL, 1 reverse KL; TRL's convention).
    temperature: both distributions are softmax(logits / temperature) in the JSD (> 0); only
        1 with ``top_k_tail`` (the teacher's top-k log-probs are at temperature 1, and its tail
        at another temperature is unknown).
    top_k: the JSD over the teacher's top-k tokens; None: the full vocabulary (refused by the
        update: it would need the teacher's [B, T, V] logits in the batch). The reverse KL
        ignores it.
    top_k_tail: the JSD over the top-k plus a tail bucket for the rest of the mass (True, the
        default, TRL's ``loss_add_tail``) or renormalised over the top-k (False; module
        docstring). Under "jsd", ``top_k: 1`` needs the tail (renormalised it is exactly 0).
    """

    signal: Signal = "reverse_kl"
    kl_coef: float = 1.0
    reward_coef: float = 0.0
    beta: float = 1.0
    temperature: float = 1.0
    top_k: int | None = 32
    top_k_tail: bool = True
    teacher: str | None = None
    teachers: dict[str, str] = dataclasses.field(default_factory=dict)
    teacher_dtype: str = "float32"

    @property
    def sources(self) -> dict[str, str]:
        """Domain -> teacher source, the default teacher under "default"."""
        out = dict(self.teachers)
        if self.teacher is not None:
            out["default"] = self.teacher
        return out

    def __post_init__(self) -> None:
        loss_config.check_literal("distill.signal", self.signal, Signal)
        if not self.kl_coef >= 0:
            raise ValueError(f"distill.kl_coef must be >= 0, got {self.kl_coef!r}")
        if not self.reward_coef >= 0:
            raise ValueError(f"distill.reward_coef must be >= 0, got {self.reward_coef!r}")
        if not 0 <= self.beta <= 1:
            raise ValueError(f"distill.beta must be in [0, 1], got {self.beta!r}")
        if not self.temperature > 0:
            raise ValueError(f"distill.temperature must be > 0, got {self.temperature!r}")
        if self.top_k is not None and not (isinstance(self.top_k, int) and self.top_k >= 1):
            raise ValueError(f"distill.top_k must be None or an integer >= 1, got {self.top_k!r}")
        if not isinstance(self.top_k_tail, bool):
            raise ValueError(f"distill.top_k_tail must be true or false, got {self.top_k_tail!r}")
        if self.signal != "jsd":
            return
        if self.top_k == 1 and not self.top_k_tail:
            raise ValueError(
                "distill.top_k=1 with distill.top_k_tail=false renormalises the JSD over one "
                "token: its loss and gradient are exactly 0 (set top_k_tail: true or top_k >= 2)"
            )
        if self.top_k_tail and self.temperature != 1:
            raise ValueError(
                f"distill.temperature={self.temperature!r} with distill.top_k_tail=true: the "
                "teacher's top-k log-probs are at temperature 1 and its tail at another is "
                "unknown (set temperature: 1.0 or top_k_tail: false)"
            )
        if not self.kl_coef > 0:
            raise ValueError(
                "distill.kl_coef=0 under distill.signal='jsd' scales the JSD loss to 0: nothing "
                "is trained (set kl_coef > 0)"
            )


# ---------------------------------------------------------------------------------------------
# 1. Reverse KL as a per-token advantage.


def reverse_kl_advantages(
    student_logp_bt: jax.Array,
    teacher_logp_bt: jax.Array,
    mask_bt: jax.Array,
    *,
    kl_coef: float = 1.0,
    reward_adv: jax.Array | None = None,
    reward_coef: float = 0.0,
) -> jax.Array:
    """Per-token advantages -kl_coef * (log pi_s - log pi_t) + reward_coef * A_reward, float32
    [B, T], 0 outside the mask, no gradient (module docstring, signal 1).

    Args:
      student_logp_bt: floating [B, T] log pi_student of the sampled tokens.
      teacher_logp_bt: floating [B, T] log pi_teacher of the same tokens.
      mask_bt: [B, T] 0/1 mask of the completion tokens.
      kl_coef: the reverse KL's coefficient.
      reward_adv: the verifiable reward's advantage, [B] per sequence or [B, T] per token
        (required when ``reward_coef`` != 0).
      reward_coef: its coefficient.
    """
    loss_config.expect_array(student_logp_bt, "student_logp_bt", rank=2, kind="float")
    shape = student_logp_bt.shape
    loss_config.expect_array(teacher_logp_bt, "teacher_logp_bt", shape=shape, kind="float")
    loss_config.expect_array(mask_bt, "mask_bt", shape=shape, kind="mask")
    if reward_coef != 0 and reward_adv is None:
        raise ValueError("reward_coef != 0 requires `reward_adv`")
    valid = jnp.asarray(mask_bt) != 0
    # where() before the subtraction: padded positions may hold -inf log-probs.
    diff = jnp.where(valid, student_logp_bt.astype(_f32) - teacher_logp_bt.astype(_f32), 0.0)
    adv = -kl_coef * diff
    if reward_adv is not None and reward_coef != 0:
        loss_config.expect_array(reward_adv, "reward_adv", rank={1, 2}, kind="real")
        loss_config.expect_array(reward_adv, "reward_adv", shape=shape[: reward_adv.ndim])
        r = jnp.asarray(reward_adv).astype(_f32)
        r = r[:, None] if r.ndim == 1 else r
        adv = adv + reward_coef * jnp.where(valid, r, 0.0)
    return jax.lax.stop_gradient(adv)


def reverse_kl_policy_loss(
    logp_bt: jax.Array,
    teacher_logp_bt: jax.Array,
    mask_bt: jax.Array,
    loss_cfg: loss_config.PolicyLossConfig,
    cfg: DistillConfig,
    *,
    denominator: jax.Array | float,
    old_logp_bt: jax.Array | None = None,
    reward_adv: jax.Array | None = None,
    segment_ids_bt: jax.Array | None = None,
    **policy_kwargs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This microbatch's share of the policy-gradient loss on the reverse-KL advantages.

    The advantages (``reverse_kl_advantages``) use ``old_logp_bt`` as the student's log-prob
    when given, else ``logp_bt`` behind a stop-gradient (one on-policy epoch: ratio 1); then
    ``policy_loss.policy_loss`` with per-token advantages, so clipping, KL to a reference,
    entropy and the off-policy correction (``policy_kwargs``: ``ref_logp_bt``,
    ``sampler_logp_bt``, ``behaviour_logp_bt``, ``entropy_bt``) apply unchanged.

    Args:
      logp_bt: floating [B, T] log pi_theta of the sampled tokens (differentiated).
      teacher_logp_bt: floating [B, T] the teacher's log-probs of the same tokens.
      mask_bt: [B, T] 0/1 loss mask.
      loss_cfg: the policy objective and its aggregation.
      cfg: ``kl_coef`` and ``reward_coef`` are read.
      denominator: ``aggregation.loss_denominator`` of the FULL batch's mask.
      old_logp_bt: floating [B, T] log pi_old (no gradient), or None.
      reward_adv: [B] or [B, T] verifiable-reward advantages (with ``cfg.reward_coef`` > 0).
      segment_ids_bt: int [B, T] of packed rows, or None.
    Returns:
      (loss, metrics): ``policy_loss``'s metrics plus ``distill/reverse_kl_sum`` (sum over loss
      tokens of log pi_s - log pi_t, each clamped to [-c, c] with c = ``loss_cfg``'s
      ``log_ratio_clamp``, 20 by default: the k1 estimate of the per-token reverse KL),
      ``distill/reverse_kl_k3_sum`` (the k3 estimate of the same clamped log-ratios) and
      ``distill/teacher_logp_sum`` (unclamped). The student's log-prob is ``old_logp_bt``'s when
      given, else ``logp_bt``'s.
    """
    loss_config.expect_array(logp_bt, "logp_bt", rank=2, kind="float")
    shape = logp_bt.shape
    loss_config.expect_array(teacher_logp_bt, "teacher_logp_bt", shape=shape, kind="float")
    if old_logp_bt is not None:
        loss_config.expect_array(old_logp_bt, "old_logp_bt", shape=shape, kind="float")
    old = jax.lax.stop_gradient(logp_bt if old_logp_bt is None else old_logp_bt)
    adv_bt = reverse_kl_advantages(
        old,
        teacher_logp_bt,
        mask_bt,
        kl_coef=cfg.kl_coef,
        reward_adv=reward_adv,
        reward_coef=cfg.reward_coef,
    )
    loss, metrics = policy_loss.policy_loss(
        logp_bt,
        old,
        adv_bt,
        mask_bt,
        loss_cfg,
        denominator=denominator,
        segment_ids_bt=segment_ids_bt,
        **policy_kwargs,
    )
    valid = jnp.asarray(mask_bt) != 0
    teacher = jnp.where(valid, teacher_logp_bt.astype(_f32), 0.0)
    log_r = jnp.where(valid, teacher - old.astype(_f32), 0.0)  # log q / pi per token
    log_r = jnp.clip(log_r, -loss_cfg.log_ratio_clamp, loss_cfg.log_ratio_clamp)

    def tsum(x: jax.Array) -> jax.Array:
        return jax.lax.stop_gradient(jnp.sum(aggregation.masked_rows(x, mask_bt)))

    metrics = dict(metrics)
    metrics["distill/reverse_kl_sum"] = tsum(-log_r)
    metrics["distill/reverse_kl_k3_sum"] = tsum(kl.k3(log_r))
    metrics["distill/teacher_logp_sum"] = tsum(teacher)
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# 2. The generalised Jensen-Shannon divergence.


def _kl_from_logp(logp: jax.Array, logq: jax.Array) -> jax.Array:
    """KL(p || q) over the last axis from log-probs; a 0-probability entry of p contributes 0."""
    p = jnp.exp(logp)
    return jnp.sum(jnp.where(p > 0, p * (logp - logq), 0.0), axis=-1)


def jsd_from_logprobs(student_logp: jax.Array, teacher_logp: jax.Array, beta: float) -> jax.Array:
    """The generalised JSD (module docstring) over the last axis of two normalised float32
    log-prob arrays [..., V] -> [...]. ``beta`` is static."""
    if beta == 0:
        return _kl_from_logp(teacher_logp, student_logp)
    if beta == 1:
        return _kl_from_logp(student_logp, teacher_logp)
    # log M in log space (no exp of either distribution before the mix).
    log_m = jnp.logaddexp(teacher_logp + jnp.log(beta), student_logp + jnp.log1p(-beta))
    return beta * _kl_from_logp(teacher_logp, log_m) + (1.0 - beta) * _kl_from_logp(
        student_logp, log_m
    )


def _check_beta_temperature(beta: float, temperature: float) -> None:
    if not 0 <= beta <= 1:
        raise ValueError(f"beta must be in [0, 1], got {beta!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")


def generalized_jsd(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
) -> jax.Array:
    """Per-position generalised JSD over the full vocabulary, float32 [...].

    Args:
      student_logits: floating [..., V] (differentiated).
      teacher_logits: floating [..., V], logits or log-probs (both give the same softmax); no
        gradient.
      beta: 0 forward KL(T || S), 1 reverse KL(S || T), between: the mixture JSD.
      temperature: both are softmax(x / temperature).
    """
    loss_config.expect_array(student_logits, "student_logits", kind="float")
    loss_config.expect_array(
        teacher_logits, "teacher_logits", shape=student_logits.shape, kind="float"
    )
    _check_beta_temperature(beta, temperature)
    s = jax.nn.log_softmax(student_logits.astype(_f32) / temperature, axis=-1)
    t = jax.nn.log_softmax(jax.lax.stop_gradient(teacher_logits.astype(_f32)) / temperature, -1)
    return jsd_from_logprobs(s, t, beta)


def add_tail_bucket(topk_logp: jax.Array) -> jax.Array:
    """The top-k log-probs [..., K] with a (K+1)-th bucket for the rest of the mass,
    log(1 - sum_k exp(logp_k)), float32 [..., K+1] (TRL's server distillation
    ``_add_tail_bucket``: the log-sum clamped at <= -1e-7, so a top-k holding all the mass
    gives a tail of about 1e-7 rather than log 0). ``topk_logp`` must be normalised log-probs
    (over the whole vocabulary), not logits."""
    lp = topk_logp.astype(_f32)
    log_s = jnp.minimum(jax.nn.logsumexp(lp, axis=-1, keepdims=True), -1e-7)
    return jnp.concatenate([lp, jnp.log(-jnp.expm1(log_s))], axis=-1)


def generalized_jsd_topk(
    student_logits: jax.Array,
    teacher_topk_ids: jax.Array,
    teacher_topk_logp: jax.Array,
    *,
    beta: float = 1.0,
    temperature: float = 1.0,
    tail: bool = True,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Per-position generalised JSD over the teacher's top-k tokens, float32 [...].

    ``tail`` True (the default, module docstring): the student's full-vocabulary log-probs
    gathered at ``teacher_topk_ids`` and ``teacher_topk_logp`` each with ``add_tail_bucket``,
    then ``jsd_from_logprobs`` over the K+1 buckets; ``temperature`` must be 1. ``tail`` False:
    the student's logits there and the teacher's log-probs each renormalised over the K tokens
    (after dividing by ``temperature``; the teacher's normaliser cancels). With K = V
    (every token) both equal ``generalized_jsd``.

    ``mask`` (optional, [...]): positions outside it get a uniform stand-in for the teacher's
    entries (ids 0..K-1, log-probs -log(K+1)) BEFORE the divergence and 0 after, so NaN or
    out-of-range teacher values on padding reach neither the value nor the gradient (a mask
    applied only after would give 0 * NaN = NaN gradients).

    Args:
      student_logits: floating [..., V] (differentiated).
      teacher_topk_ids: int [..., K] the teacher's top-k token ids (distinct per position).
      teacher_topk_logp: floating [..., K] the teacher's log-probs of those tokens (with
        ``tail`` normalised over the vocabulary; renormalised, logits do as well).
      beta, temperature: as ``generalized_jsd``.
      tail: the tail bucket (True) or renormalised (False).
      mask: [...] 0/1 positions to compute, or None (all).
    """
    loss_config.expect_array(student_logits, "student_logits", kind="float")
    lead = student_logits.shape[:-1]
    loss_config.expect_array(teacher_topk_ids, "teacher_topk_ids", rank=len(lead) + 1, kind="int")
    k = teacher_topk_ids.shape[-1]
    loss_config.expect_array(teacher_topk_ids, "teacher_topk_ids", shape=(*lead, k))
    loss_config.expect_array(teacher_topk_logp, "teacher_topk_logp", shape=(*lead, k), kind="float")
    _check_beta_temperature(beta, temperature)
    if tail and temperature != 1:
        raise ValueError(
            f"temperature={temperature!r} with the tail bucket: the teacher's top-k log-probs "
            "are at temperature 1 (use tail=False to renormalise at another temperature)"
        )
    if not tail and k == 1:
        raise ValueError("renormalised over K=1 token the JSD is exactly 0: use tail=True")
    teacher = jax.lax.stop_gradient(teacher_topk_logp.astype(_f32))
    if mask is not None:
        loss_config.expect_array(mask, "mask", shape=lead, kind="mask")
        keep = (jnp.asarray(mask) != 0)[..., None]
        teacher_topk_ids = jnp.where(
            keep, teacher_topk_ids, jnp.arange(k, dtype=teacher_topk_ids.dtype)
        )
        teacher = jnp.where(keep, teacher, -jnp.log(k + 1.0))
    if tail:
        s_full = jax.nn.log_softmax(student_logits.astype(_f32), axis=-1)
        s = add_tail_bucket(jnp.take_along_axis(s_full, teacher_topk_ids, axis=-1))
        t = add_tail_bucket(teacher)
    else:
        picked = jnp.take_along_axis(student_logits.astype(_f32), teacher_topk_ids, axis=-1)
        s = jax.nn.log_softmax(picked / temperature, axis=-1)
        t = jax.nn.log_softmax(teacher / temperature, axis=-1)
    out = jsd_from_logprobs(s, t, beta)
    return out if mask is None else jnp.where(jnp.asarray(mask) != 0, out, 0.0)


def jsd_loss(
    jsd_bt: jax.Array,
    mask_bt: jax.Array,
    loss_cfg: loss_config.PolicyLossConfig,
    *,
    denominator: jax.Array | float,
    segment_ids_bt: jax.Array | None = None,
    group_ids_bt: jax.Array | None = None,
    coef: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """This microbatch's share of ``coef`` times the aggregated JSD loss, and its metric sums.

    Args:
      jsd_bt: floating [B, T] per-position divergence (``generalized_jsd(_topk)``).
      mask_bt: [B, T] 0/1 loss mask (completion tokens).
      loss_cfg: its ``aggregation`` (and ``norm_constant``) reduce the per-token values.
      denominator: ``aggregation.loss_denominator`` of the FULL batch's mask.
      segment_ids_bt: int [B, T] of packed rows, or None.
      group_ids_bt: int [B, T] shared-prompt group ids (prompt_mean_token_mean), or None.
      coef: the loss's coefficient (``distill.kl_coef``); the metrics are of the unscaled JSD.
    Returns:
      (loss, metrics): ``loss`` (add over microbatches), ``distill/jsd_sum``, ``jsd_max``,
      ``token_count`` and ``seq_count`` (``policy_loss``'s contract).
    """
    loss_config.expect_array(jsd_bt, "jsd_bt", rank=2, kind="float")
    loss_config.expect_array(mask_bt, "mask_bt", shape=jsd_bt.shape, kind="mask")
    loss_config.expect_array(denominator, "denominator", rank=0)
    loss = coef * aggregation.aggregate(
        jsd_bt, mask_bt, loss_cfg, denominator, segment_ids_bt, group_ids_bt
    )
    masked = jax.lax.stop_gradient(aggregation.masked_rows(jsd_bt, mask_bt))
    metrics = {
        "loss": jax.lax.stop_gradient(loss),
        "distill/jsd_sum": jnp.sum(masked),
        "distill/jsd_max": jnp.max(masked, initial=0.0),
        "token_count": jnp.sum(jnp.asarray(mask_bt).astype(_f32)),
        "seq_count": jnp.sum(segments.last_valid(mask_bt, segment_ids_bt).astype(_f32)),
    }
    return loss, metrics


# ---------------------------------------------------------------------------------------------
# The method record (either signal).


@dataclasses.dataclass(frozen=True, kw_only=True)
class DistillUpdateConfig:
    """On-policy distillation update. ``distill.signal``:

    - "reverse_kl": ``reverse_kl_policy_loss`` with every option of ``PolicyLossConfig``
      (aggregation, clipping, KL to a reference, entropy, off-policy correction) and
      ``DistillConfig``'s coefficients; the rollouts carry ``teacher_logp`` (and
      ``advantages`` when ``reward_coef`` > 0).
    - "jsd": ``distill.kl_coef`` times ``jsd_loss`` of ``generalized_jsd_topk`` (``beta``,
      ``temperature``, ``top_k_tail``) over the teacher's top ``distill.top_k`` tokens, which
      the rollouts carry as ``teacher_topk_ids`` / ``teacher_topk_logp`` [B, T, K]; only
      ``loss.aggregation`` (and ``norm_constant``) of ``PolicyLossConfig`` applies, so a
      reference KL, an entropy bonus, an off-policy correction and the reward mix are refused
      (the full-vocabulary JSD would need the teacher's [B, T, V] logits in the batch: refused
      too).

    ``num_microbatches`` and ``logprob_chunk_size`` as ``grpo.GRPOUpdateConfig`` (the chunk size
    also bounds the JSD's [B, chunk, V] student logits).
    """

    loss: loss_config.PolicyLossConfig = dataclasses.field(
        default_factory=lambda: loss_config.PolicyLossConfig(aggregation="token_mean")
    )
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    num_microbatches: int = 1
    logprob_chunk_size: int | None = None

    def __post_init__(self) -> None:
        engine.check_microbatches(self.num_microbatches)
        engine.check_chunk_size(self.logprob_chunk_size)
        if self.distill.signal != "jsd":
            return
        if self.distill.top_k is None:
            raise ValueError(
                "distill.signal='jsd' trains over the teacher's top-k: set distill.top_k (the "
                "full-vocabulary JSD would need the teacher's [B, T, V] logits in the batch)"
            )
        loss = self.loss
        unused = {
            "distill.reward_coef": self.distill.reward_coef != 0,
            "loss.kl_coef": loss.kl_coef != 0,
            "loss.entropy_coef": loss.entropy_coef != 0,
            "loss.correction": loss.correction.mode != "none",
        }
        for key, set_ in unused.items():
            if set_:
                raise ValueError(f"{key} does not apply to distill.signal='jsd'; leave it unset")

    @property
    def rollout_fields(self) -> tuple[str, ...]:
        """What the host (or a teacher pass before ``prepare``) supplies for every rollout."""
        if self.distill.signal == "jsd":
            return ("teacher_topk_ids", "teacher_topk_logp")
        mixed = ("advantages",) if self.distill.reward_coef > 0 else ()
        return ("teacher_logp", *mixed)


def topk_jsd_from_hidden(
    lm: Any,
    hidden_btd: jax.Array,
    teacher_topk_ids: jax.Array,
    teacher_topk_logp: jax.Array,
    mask_bt: jax.Array,
    *,
    beta: float,
    temperature: float = 1.0,
    tail: bool = True,
    chunk_size: int | None = None,
) -> jax.Array:
    """Per-position ``generalized_jsd_topk`` of the student's logits (``lm.lm_logits`` of its
    final hidden states) against the teacher's top-k, float32 [B, T], 0 outside ``mask_bt``.

    With ``chunk_size`` the positions run in chunks, each under ``jax.checkpoint`` in a
    ``lax.map``, so one chunk's [B, chunk, V] logits exist at a time (forward and backward);
    chunks masked out in every row skip the head. The same per-position arithmetic, so values
    and gradients equal the unchunked ones up to summation order. (``model.logprobs`` chunks
    the log-prob head the same way; this loop computes a different per-chunk quantity.)

    Args:
      lm: the student (``model.CausalLM``); hidden_btd: [B, T, D] its final hidden states.
      teacher_topk_ids: int [B, T, K]; teacher_topk_logp: floating [B, T, K].
      mask_bt: [B, T] loss mask (applied before the divergence: ``generalized_jsd_topk``).
      beta, temperature, tail: as ``generalized_jsd_topk``.
    """
    b, t = mask_bt.shape
    keep = jnp.asarray(mask_bt) != 0

    def compute(h, ids, lp, k):
        return generalized_jsd_topk(
            lm.lm_logits(h), ids, lp, beta=beta, temperature=temperature, tail=tail, mask=k
        )

    if chunk_size is None or chunk_size >= t:
        return compute(hidden_btd, teacher_topk_ids, teacher_topk_logp, keep)
    n = -(-t // chunk_size)
    pad = n * chunk_size - t

    def chunks(x):  # [B, T, ...] -> [n, B, C, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))
        return x.reshape(b, n, chunk_size, *x.shape[2:]).swapaxes(0, 1)

    @functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
    def one(xs):
        h, ids, lp, k = xs
        zero = lambda *_: jnp.zeros(k.shape, _f32)  # noqa: E731
        return jax.lax.cond(jnp.any(k), compute, zero, h, ids, lp, k)

    out = jax.lax.map(
        one,
        (chunks(hidden_btd), chunks(teacher_topk_ids), chunks(teacher_topk_logp), chunks(keep)),
    )
    return out.swapaxes(0, 1).reshape(b, n * chunk_size)[:, :t]


def jsd_spec(cfg: DistillUpdateConfig) -> batch_lib.BatchSpec:
    """The JSD's batch (rollouts and update alike): the teacher's top-k, nothing else."""
    return batch_lib.BatchSpec(required=cfg.rollout_fields, num_microbatches=cfg.num_microbatches)


def make_distill_update(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    cfg: DistillUpdateConfig | None = None,
    *,
    lr_schedule: engine.LRSchedule = None,
    mesh: Any = None,
) -> Callable:
    """The distillation update (one epoch; ``DistillUpdateConfig``). Reverse KL: the batch
    needs ``teacher_logp`` [B, T] (the teacher's log-probs of the labels) and, with
    ``distill.reward_coef`` > 0, ``advantages``; ``old_logp``, ``ref_logp``, ``sampler_logp`` and
    ``behaviour_logp`` as GRPO's update. Metrics: GRPO's plus ``distill/reverse_kl`` (k1, mean
    over loss tokens), ``distill/reverse_kl_k3`` and ``distill/teacher_logp``. JSD: the batch
    needs ``teacher_topk_ids`` / ``teacher_topk_logp`` [B, T, K]; metrics ``loss``,
    ``policy_loss`` (both ``distill.kl_coef`` times the JSD), ``distill/jsd`` (the unscaled JSD,
    mean over loss tokens), ``distill/jsd_max``."""
    cfg = cfg or DistillUpdateConfig()
    entropy_grad = cfg.loss.entropy_coef != 0
    if cfg.distill.signal == "jsd":
        spec = jsd_spec(cfg)
    else:
        _, spec = policy_gradient.policy_specs(
            cfg.loss, cfg.rollout_fields, (), cfg.num_microbatches
        )

    def full_batch(batch):
        return batch, aggregation.loss_denominator(
            batch.loss_mask, cfg.loss, batch.segment_ids, batch.prompt_group_ids
        )

    def jsd_loss_fn(params, mb, denom):
        lm = nnx.merge(graphdef, params)
        hidden, _ = batch_lib.run_backbone(lm, mb)
        loss_config.expect_array(
            mb.teacher_topk_ids, "teacher_topk_ids", shape=(*mb.loss_mask.shape, cfg.distill.top_k)
        )
        jsd_bt = topk_jsd_from_hidden(
            lm,
            hidden,
            mb.teacher_topk_ids,
            mb.teacher_topk_logp,
            mb.loss_mask,
            beta=cfg.distill.beta,
            temperature=cfg.distill.temperature,
            tail=cfg.distill.top_k_tail,
            chunk_size=cfg.logprob_chunk_size,
        )
        loss, metrics = jsd_loss(
            jsd_bt,
            mb.loss_mask,
            cfg.loss,
            denominator=denom,
            segment_ids_bt=mb.segment_ids,
            group_ids_bt=mb.prompt_group_ids,
            coef=cfg.distill.kl_coef,
        )
        metrics["policy_loss"] = metrics["loss"]
        return loss, metrics

    def loss_fn(params, mb, denom):
        lm = nnx.merge(graphdef, params)
        logp, ent, _ = engine.token_logprobs(
            lm, mb, entropy_grad=entropy_grad, chunk_size=cfg.logprob_chunk_size
        )
        loss, metrics = reverse_kl_policy_loss(
            logp,
            mb.teacher_logp,
            mb.loss_mask,
            cfg.loss,
            cfg.distill,
            denominator=denom,
            old_logp_bt=mb.old_logp,
            reward_adv=mb.advantages,
            segment_ids_bt=mb.segment_ids,
            group_ids_bt=mb.prompt_group_ids,
            ref_logp_bt=mb.ref_logp,
            sampler_logp_bt=mb.sampler_logp,
            behaviour_logp_bt=mb.behaviour_logp,
            entropy_bt=ent,
        )
        metrics["policy_loss"] = metrics["loss"]
        return loss, metrics

    return engine.make_update(
        spec=spec,
        tx=tx,
        lr_schedule=lr_schedule,
        mesh=mesh,
        full_batch=full_batch,
        loss_fn=jsd_loss_fn if cfg.distill.signal == "jsd" else loss_fn,
    )


def distill_algorithm(
    graphdef: nnx.GraphDef,
    optimizer: algorithm_lib.Optimizer,
    cfg: DistillUpdateConfig | None = None,
    *,
    mesh: Any = None,
    epochs_per_batch: int = 1,
    rollouts_may_be_stale: bool = False,
    logprob_microbatches: int | None = None,
    reference_routes: str = "auto",
) -> algorithm_lib.Algorithm:
    """On-policy distillation (``make_distill_update``) as a record: GRPO's ``init`` / ``prepare``
    (the frozen KL reference when ``loss.kl_coef`` > 0; the old pass with several epochs or
    stale rollouts) with the teacher's log-probs as a rollout field.

    ``teacher_logp`` comes with the rollouts, from whichever teacher scored them: a vLLM
    teacher on the host (``teachers.vllm``, laid out at the label positions as the
    sampler's log-probs are), or a local JAX teacher's pass on the placed batch
    (``jaxrlvr.teachers.LocalTeacher.batch_logprobs``, its parameters passed as arguments: a
    ``prepare`` that closed over them would compile them into the program as constants).
    """
    cfg = cfg or DistillUpdateConfig()
    jsd = cfg.distill.signal == "jsd"
    return policy_gradient.policy_gradient_algorithm(
        "distill",
        graphdef,
        optimizer,
        cfg,
        lambda tx, schedule: make_distill_update(
            graphdef, tx, cfg, lr_schedule=schedule, mesh=mesh
        ),
        rollout_fields=cfg.rollout_fields,
        rollout_spec=jsd_spec(cfg) if jsd else None,
        # The JSD has no importance ratio: no old pass, whatever the epochs or staleness.
        old=not jsd and (epochs_per_batch > 1 or bool(rollouts_may_be_stale)),
        mesh=mesh,
        epochs_per_batch=epochs_per_batch,
        logprob_microbatches=logprob_microbatches,
        reference_routes=reference_routes,
    )


def build(cfg, graphdef, params_shape, mesh, microbatches) -> algorithm_lib.Algorithm:
    """``rl.algo: distill`` from the run config: ``rl.distill`` (``DistillConfig``, the record
    YAML builds) with the shared RL fields."""
    del params_shape
    return distill_algorithm(
        graphdef,
        cfg.optim,
        DistillUpdateConfig(
            distill=cfg.rl.distill, **policy_gradient.run_fields(cfg, microbatches)
        ),
        mesh=mesh,
        epochs_per_batch=cfg.rl.epochs_per_step,
        reference_routes=cfg.rl.reference_routes,
        rollouts_may_be_stale=cfg.rl.max_staleness > 0,
    )


def check_run(rl) -> None:
    if not rl.distill.sources:
        raise ValueError(
            "rl.algo=distill needs a teacher: rl.distill.teacher (a folder or a vLLM URL) "
            "or rl.distill.teachers (domain -> folder or URL)"
        )


registry.register(
    registry.Method(
        name="distill",
        build=build,
        section=DistillConfig,
        asynchronous=True,
        state_keys=policy_gradient.STATE_KEYS,
        check=check_run,
    )
)
