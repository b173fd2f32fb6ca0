"""From graded completions to a padded rollout batch: reward shaping, advantages, packing.

Host-side glue between the sampler, the verifiers and the update: it turns one step's prompts and
sampled completions into numpy arrays of fixed batch size and a bucketed length (so the jitted
update compiles once per bucket), aligned the way ``algos.batch.Batch`` expects: row =
``[prompt][completion][pad]`` shifted by one, ``loss_mask`` on completion labels, sampler
log-probs on the same positions.

Left out: sampling itself (``sampling/``), the loss math (``algos/``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax.numpy as jnp
import numpy as np

from jaxrlvr.algos import advantages as advantages_lib
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import loss_config, shaping
from jaxrlvr.model.buckets import length_bucket
from jaxrlvr.sampling.base import Completion


@dataclasses.dataclass
class PackedBatch:
    """Numpy arrays of one batch, B rows x T positions (see ``algos.batch.Batch``)."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    sampler_logp: np.ndarray
    num_tokens: int  # response tokens in the loss

    @property
    def shape(self) -> tuple[int, int]:
        return self.input_ids.shape


def pack(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int,
    batch_size: int | None = None,
    length: int | None = None,
    sampler_logps: Sequence[Sequence[float]] | None = None,
    loss_weights: Sequence[Sequence[float]] | None = None,
    max_length: int | None = None,
) -> PackedBatch:
    """Packs prompt + completion rows into shifted, right-padded arrays.

    Args:
      prompts, completions: token ids per row (same number of rows).
      pad_id: padding token id.
      batch_size: rows of the result (>= rows given); extra rows are all padding, masked out.
      length: T; default: the power-of-two bucket of the longest row minus one.
      sampler_logps: per completion token, the sampler's log-prob (stored at the label position).
      loss_weights: per completion token, 0/1 weights (e.g. 0 for forced tokens).
      max_length: cap for the default bucket.
    """
    rows = len(prompts)
    if len(completions) != rows:
        raise ValueError(f"pack: {rows} prompts but {len(completions)} completions")
    batch_size = rows if batch_size is None else batch_size
    if batch_size < rows:
        raise ValueError(f"pack: batch_size={batch_size} is smaller than the {rows} rows given")
    longest = max((len(p) + len(c) for p, c in zip(prompts, completions)), default=2)
    if length is None:
        length = length_bucket(longest, maximum=max_length) - 1
    if longest - 1 > length:
        raise ValueError(f"pack: a row of {longest} tokens does not fit length T={length} + 1")
    input_ids = np.full((batch_size, length), pad_id, np.int32)
    labels = np.full((batch_size, length), pad_id, np.int32)
    attention = np.zeros((batch_size, length), np.int32)
    loss_mask = np.zeros((batch_size, length), np.float32)
    sampler_logp = np.zeros((batch_size, length), np.float32)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        full = np.asarray(list(p) + list(c), np.int32)
        n = len(full) - 1
        if n <= 0:
            continue
        input_ids[i, :n] = full[:-1]
        labels[i, :n] = full[1:]
        attention[i, :n] = 1
        start = len(p) - 1  # label position of the first completion token
        if len(c):
            weights = np.ones(len(c), np.float32)
            if loss_weights is not None:
                weights = np.asarray(loss_weights[i], np.float32)
            loss_mask[i, start : start + len(c)] = weights
            if sampler_logps is not None:
                sampler_logp[i, start : start + len(c)] = np.asarray(sampler_logps[i], np.float32)
    return PackedBatch(
        input_ids=input_ids,
        attention_mask=attention,
        labels=labels,
        loss_mask=loss_mask,
        sampler_logp=sampler_logp,
        num_tokens=int(loss_mask.sum()),
    )


def completion_weights(c: Completion, *, mask_forced: bool, mask_truncated: bool) -> list[float]:
    """0/1 loss weight per completion token: forced (thinking-budget) tokens and, optionally,
    truncated completions (DAPO overlong filtering) are not trained on."""
    if mask_truncated and c.finish_reason == "length":
        return [0.0] * len(c.token_ids)
    forced = getattr(c, "forced", None)
    if mask_forced and forced:
        return [0.0 if f else 1.0 for f in forced]
    return [1.0] * len(c.token_ids)


def shaped_rewards(
    rewards: np.ndarray,
    correct: np.ndarray,
    lengths: np.ndarray,
    group_size: int,
    *,
    length_reward_weight: float = 0.0,
    overlong: loss_config.OverlongConfig | None = None,
) -> tuple[np.ndarray, dict[str, float]]:
    """Task rewards plus the Kimi k1.5 length reward and the DAPO soft overlong penalty."""
    out = rewards.astype(np.float32)
    metrics = {}
    if length_reward_weight > 0:
        bonus = np.asarray(
            shaping.kimi_length_reward(jnp.asarray(lengths), jnp.asarray(correct), group_size)
        )
        out = out + length_reward_weight * bonus
        metrics["length_reward_mean"] = float(bonus.mean())
    if overlong is not None:
        penalty = np.asarray(shaping.overlong_reward(jnp.asarray(lengths), overlong))
        out = out + penalty
        metrics["overlong_penalty_mean"] = float(penalty.mean())
    return out, metrics


def group_advantages(
    rewards: np.ndarray, group_size: int, cfg: loss_config.AdvantageConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages [N] and a per-group "all rewards equal" flag [N / G]."""
    adv = np.asarray(advantages_lib.group_advantages(jnp.asarray(rewards), group_size, cfg))
    grouped = rewards.reshape(-1, group_size)
    zero_var = np.all(grouped == grouped[:, :1], axis=1)
    return adv.astype(np.float32), zero_var


def to_batch(packed: PackedBatch, **fields: np.ndarray | None) -> batch_lib.Batch:
    """A host ``Batch`` (NumPy) from packed rows plus per-row/per-token ``fields``."""
    arrays = dict(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        labels=packed.labels,
        loss_mask=packed.loss_mask,
    )
    arrays.update({k: v for k, v in fields.items() if v is not None})
    return batch_lib.Batch(**{k: np.asarray(v) for k, v in arrays.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapingConfig:
    """The host-side choices of turning graded completions into a rollout batch (the driver
    fills it from ``rl.*``): advantage estimator, Kimi length reward, DAPO overlong penalty,
    forced-token and truncation masking, zero-variance group dropping."""

    group_size: int
    advantage: loss_config.AdvantageConfig = dataclasses.field(
        default_factory=loss_config.AdvantageConfig
    )
    length_reward_weight: float = 0.0
    overlong: loss_config.OverlongConfig | None = None
    mask_forced_tokens: bool = True
    mask_truncated: bool = False
    drop_zero_variance_groups: bool = False


def shape(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    scores: Sequence[dict[str, float]],
    cfg: ShapingConfig,
    *,
    pad_id: int,
    max_length: int | None = None,
) -> tuple[batch_lib.Batch, dict[str, float]]:
    """One step's rollouts as a host ``Batch`` with every rollout field an algorithm may read
    (``advantages``, ``rewards`` (shaped), ``correct``, ``sampler_logp``), and their metrics.

    Args:
      prompts: P prompts' token ids; completions: P x G completions, prompt-major;
      scores: the verifier's dict per completion (``reward``, ``answer_reward``,
        ``format_reward``).
    """
    g = cfg.group_size
    raw = np.asarray([s["reward"] for s in scores], np.float32)
    correct = np.asarray([s["answer_reward"] for s in scores], np.float32)
    lengths = np.asarray([len(c.token_ids) for c in completions], np.float32)
    rewards, metrics = shaped_rewards(
        raw,
        correct,
        lengths,
        g,
        length_reward_weight=cfg.length_reward_weight,
        overlong=cfg.overlong,
    )
    adv, zero_var = group_advantages(rewards, g, cfg.advantage)
    weights = [
        completion_weights(c, mask_forced=cfg.mask_forced_tokens, mask_truncated=cfg.mask_truncated)
        for c in completions
    ]
    if cfg.drop_zero_variance_groups:
        keep_rows = np.repeat(~zero_var, g)
        weights = [w if k else [0.0] * len(w) for w, k in zip(weights, keep_rows)]
    packed = pack(
        [prompts[i // g] for i in range(len(completions))],
        [c.token_ids for c in completions],
        pad_id=pad_id,
        sampler_logps=[c.logprobs for c in completions],
        loss_weights=weights,
        max_length=max_length,
    )
    batch = to_batch(
        packed, advantages=adv, rewards=rewards, correct=correct, sampler_logp=packed.sampler_logp
    )
    metrics.update(
        {
            "reward_mean": float(raw.mean()),
            "reward_std": float(raw.std()),
            "shaped_reward_mean": float(rewards.mean()),
            "accuracy": float(correct.mean()),
            "format_rate": float(np.mean([s["format_reward"] for s in scores])),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
            "zero_variance_group_fraction": float(zero_var.mean()),
            "truncated_fraction": float(
                np.mean([c.finish_reason == "length" for c in completions])
            ),
            "tokens/response": int(lengths.sum()),
            "tokens/batch_shape_T": int(packed.shape[1]),
            "tokens/attended": int(packed.attention_mask.sum()),
        }
    )
    return batch, metrics
