"""Typed configuration for the RLVR loss math, and the shared argument contracts.

Every choice between estimators (advantage baseline and scale, loss aggregation, clipping, KL
estimator, off-policy correction, reward shaping) is made here, once, by a frozen
keyword-only dataclass whose ``Literal`` fields are validated at construction. The functions in
``jaxrlvr.algos`` take these configs instead of scattered strings.

``expect_array`` is the one place that turns chex shape/rank/dtype checks into errors naming the
offending argument; every public function in the package opens with it.

Not here: optimiser, schedule and update-loop settings (those belong to the update factories).
"""

import dataclasses
import typing
from typing import Literal

import chex
import jax.numpy as jnp
import numpy as np

Baseline = Literal["mean", "rloo", "none"]
AdvantageScale = Literal["group_std", "batch_std", "none"]
Aggregation = Literal[
    "token_mean",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "prompt_mean_token_mean",
]
RatioLevel = Literal["token", "sequence"]
KLEstimator = Literal["k1", "k2", "k3"]
KLIn = Literal["loss", "reward"]
CorrectionSource = Literal["engine", "staleness", "both"]
CorrectionLevel = Literal["token", "sequence", "geometric"]
CorrectionMode = Literal["none", "truncate", "mask", "icepop"]
ArrayKind = Literal["float", "int", "bool", "mask", "real"]


def check_literal(key: str, value: object, options: object) -> None:
    """Raise ``ValueError`` naming ``key`` and the allowed values unless ``value`` is one."""
    allowed = typing.get_args(options)
    if value not in allowed:
        raise ValueError(f"{key} must be one of {list(allowed)}, got {value!r}")


def expect_array(
    x: chex.Array,
    name: str,
    *,
    rank: int | set[int] | None = None,
    shape: typing.Sequence[int | None] | None = None,
    kind: ArrayKind | None = None,
) -> None:
    """chex contract on one argument; the AssertionError message ends with ``argument `name```.

    ``kind``: "float" (any floating dtype), "int" (any integer dtype), "bool", "mask" (bool,
    integer or floating: 0/1 weights), "real" (bool, integer or floating, e.g. rewards).
    Costs nothing under jit: shapes and dtypes are static.
    """
    msg = f"argument `{name}`"
    if rank is not None:
        chex.assert_rank(x, rank, custom_message=msg)
    if shape is not None:
        chex.assert_shape(x, tuple(shape), custom_message=msg)
    if kind is None:
        return
    dtype = jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype
    if kind == "float":
        chex.assert_type(x, jnp.floating, custom_message=msg)
    elif kind == "int":
        chex.assert_type(x, jnp.integer, custom_message=msg)
    elif kind == "bool":
        chex.assert_type(x, np.bool_, custom_message=msg)
    elif dtype != np.bool_ and not jnp.issubdtype(dtype, jnp.integer):
        # "mask" / "real": bool and integer pass above; anything else must be floating.
        chex.assert_type(x, jnp.floating, custom_message=msg)


@dataclasses.dataclass(frozen=True, kw_only=True)
class AdvantageConfig:
    """How group rewards become advantages.

    baseline: "mean" (GRPO, DeepSeekMath), "rloo" (leave-one-out mean, Ahmadian et al. 2024) or
        "none" (raw reward).
    scale: "group_std" (divide by the group's unbiased std + eps, GRPO), "batch_std" (by the
        whole batch's unbiased reward std + eps, Liu et al. 2025 "Tricks or Traps"), or "none"
        (Dr. GRPO).
    eps: added to the std before dividing.
    """

    baseline: Baseline = "mean"
    scale: AdvantageScale = "group_std"
    eps: float = 1e-6

    def __post_init__(self) -> None:
        check_literal("baseline", self.baseline, Baseline)
        check_literal("scale", self.scale, AdvantageScale)
        if not self.eps >= 0:
            raise ValueError(f"eps must be >= 0, got {self.eps!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorrectionConfig:
    """Off-policy correction of the policy-gradient term (``importance``; docs/corrections.md).

    Three policies meet in one update: the sampler's own log-probs (``sampler_logp``, vLLM or
    the JAX sampler in another precision), the trainer's log-probs under the parameter version
    that sampled (``behaviour_logp``) and the trainer's log-probs under the parameters the step
    starts from (``old_logp``, the ratio's denominator). ``source`` picks the ratio r:

        engine     pi_behaviour / pi_sampler   the engine mismatch alone (same weights)
        staleness  pi_old / pi_behaviour       the policy lag alone (asynchronous rollouts)
        both       pi_old / pi_sampler         the two composed (= engine x staleness)

    ``level`` aggregates the per-token log-ratios d_t = log r_t over each sequence: "token"
    (r_t), "sequence" (exp(sum_t d_t), the product of the token ratios) or "geometric"
    (exp(mean_t d_t), the length-normalised ratio). ``mode`` turns r into the weight w that
    multiplies each token's policy-gradient term (no gradient through w):

        none      w = 1 (the diagnostics are still reported)
        truncate  w = clip(r, low, high)                 truncated IS (Yao et al. 2025)
        mask      w = 1 if low <= r <= high else 0       rejection (verl's rollout_rs)
        icepop    w = r if low <= r <= high else 0       masked IS (IcePop, Ling Team 2025)

    high: the cap / the band's upper edge (> 0).
    low: the band's lower edge; None means 0 for truncate (a one-sided cap) and 1 / high for
        mask and icepop (verl's default lower threshold). ``band`` gives the resolved pair.
    """

    mode: CorrectionMode = "none"
    level: CorrectionLevel = "token"
    source: CorrectionSource = "both"
    high: float = 2.0
    low: float | None = None

    def __post_init__(self) -> None:
        check_literal("correction.mode", self.mode, CorrectionMode)
        check_literal("correction.level", self.level, CorrectionLevel)
        check_literal("correction.source", self.source, CorrectionSource)
        if not self.high > 0:
            raise ValueError(f"correction.high must be > 0, got {self.high!r}")
        if self.low is not None and not 0 <= self.low <= self.high:
            raise ValueError(
                f"correction.low must be None or in [0, high={self.high}], got {self.low!r}"
            )

    @property
    def band(self) -> tuple[float, float]:
        """(low, high) with ``low`` resolved: 0 for truncate / none, 1 / high otherwise."""
        if self.low is not None:
            return float(self.low), float(self.high)
        return (0.0 if self.mode in ("none", "truncate") else 1.0 / self.high), float(self.high)

    @property
    def uses_sampler(self) -> bool:
        """Whether the applied weight reads the sampler's log-probs."""
        return self.mode != "none" and self.source in ("engine", "both")


# The knobs ``correction`` replaced, and how to write them now (raised by PolicyLossConfig).
_TIS_MOVED = (
    "loss.tis / loss.tis_cap were replaced by loss.correction (docs/corrections.md): "
    "tis=token|sequence with tis_cap=C is correction.mode=truncate, correction.level="
    "token|sequence, correction.source=both, correction.high=C"
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """The per-token policy objective and its aggregation (see ``policy_loss.policy_loss``).

    aggregation: "token_mean" (DAPO: mean over every valid token of the batch),
        "seq_mean_token_mean" (GRPO: mean over sequences of each sequence's token mean),
        "seq_mean_token_sum" (mean over sequences of token sums),
        "seq_mean_token_sum_norm" (Dr. GRPO: token sums / (B * norm_constant)),
        "prompt_mean_token_mean" (ScaleRL: mean over prompts of the token mean over all of a
        prompt's G completions; needs packed rows with shared prompts, ``aggregation``).
    norm_constant: the Dr. GRPO constant (e.g. max new tokens); required by, and only used by,
        "seq_mean_token_sum_norm".
    clip_eps_low, clip_eps_high: ratio clipped to [1 - low, 1 + high] (DAPO clip-higher).
    clip: False drops the clipped branch: pg = -rho * A, the unclipped importance-weighted
        objective (CS336 assignment 5's "GRPO-No-Clip" off-policy ablation); it only differs
        from clipping when rho != 1, i.e. from the second update on the same rollouts.
    dual_clip: constant c > 1; for negative advantages the loss is capped at -c * A
        (Ye et al. 2020).
    ratio_level: "token" (PPO/GRPO) or "sequence" (GSPO: length-normalised sequence ratio).
    kl_coef, kl_estimator, kl_in: KL(pi || pi_ref) penalty coefficient, estimator (Schulman's
        k1/k2/k3) and whether it enters the loss or is subtracted from the reward by the caller.
    entropy_coef: entropy bonus coefficient (loss -= coef * entropy).
    correction: the off-policy correction (``CorrectionConfig``): engine mismatch, staleness or
        both; token, sequence or geometric ratios; truncate, mask or IcePop.
    tis, tis_cap: removed (replaced by ``correction``); setting either raises with the mapping.
    mask_truncated: the caller drops truncated completions from the mask (DAPO overlong filtering).
    log_ratio_clamp: |log ratio| bound before every exp, to keep ratios finite.
    """

    aggregation: Aggregation = "seq_mean_token_mean"
    norm_constant: float | None = None
    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    clip: bool = True
    dual_clip: float | None = None
    ratio_level: RatioLevel = "token"
    kl_coef: float = 0.0
    kl_estimator: KLEstimator = "k3"
    kl_in: KLIn = "loss"
    entropy_coef: float = 0.0
    correction: CorrectionConfig = dataclasses.field(default_factory=CorrectionConfig)
    tis: str | None = dataclasses.field(default=None, repr=False)
    tis_cap: float | None = dataclasses.field(default=None, repr=False)
    mask_truncated: bool = False
    log_ratio_clamp: float = 20.0

    def __post_init__(self) -> None:
        check_literal("aggregation", self.aggregation, Aggregation)
        check_literal("ratio_level", self.ratio_level, RatioLevel)
        check_literal("kl_estimator", self.kl_estimator, KLEstimator)
        check_literal("kl_in", self.kl_in, KLIn)
        if self.tis is not None or self.tis_cap is not None:
            raise ValueError(_TIS_MOVED)
        if self.aggregation == "seq_mean_token_sum_norm" and not (
            self.norm_constant is not None and self.norm_constant > 0
        ):
            raise ValueError(
                "norm_constant must be a positive number when aggregation is "
                f"'seq_mean_token_sum_norm', got {self.norm_constant!r}"
            )
        if not 0 <= self.clip_eps_low < 1:
            raise ValueError(f"clip_eps_low must be in [0, 1), got {self.clip_eps_low!r}")
        if not self.clip_eps_high >= 0:
            raise ValueError(f"clip_eps_high must be >= 0, got {self.clip_eps_high!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"dual_clip must be None or > 1, got {self.dual_clip!r}")
        if not self.kl_coef >= 0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef!r}")
        if not self.log_ratio_clamp > 0:
            raise ValueError(f"log_ratio_clamp must be > 0, got {self.log_ratio_clamp!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LengthRewardConfig:
    """Kimi k1.5 length reward (Kimi Team 2025, section 2.3.3), added with weight ``weight``."""

    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.weight >= 0:
            raise ValueError(f"weight must be >= 0, got {self.weight!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OverlongConfig:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13).

    max_len: L_max, the generation budget; cache_len: L_cache, the soft band before it;
    weight: multiplier of the penalty in [-1, 0].
    """

    max_len: int
    cache_len: int
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not self.max_len > 0:
            raise ValueError(f"max_len must be > 0, got {self.max_len!r}")
        if not 0 < self.cache_len <= self.max_len:
            raise ValueError(
                f"cache_len must be in (0, max_len={self.max_len}], got {self.cache_len!r}"
            )
        if not self.weight >= 0:
            raise ValueError(f"weight must be >= 0, got {self.weight!r}")
