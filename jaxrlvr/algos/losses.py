"""The Stanford CS336 (spring 2025) assignment-5 function set, in pure JAX.

Names, arguments and semantics follow the assignment so that its tests port directly: masked
reductions, entropy and response log-probs from logits, prompt/output tokenisation, group-normalised
rewards (GRPO, Shao et al. 2024 "DeepSeekMath"), the naive / baseline / GRPO-clip policy-gradient
losses, the SFT and GRPO microbatch losses, and the per-instance DPO loss (with the course's
Alpaca template, ``ALPACA_TEMPLATE``). Everything returns float32 and is differentiable in
``policy_log_probs`` (the DPO loss: in the model's parameters).

Deliberate differences from the PyTorch reference: nothing calls ``.backward()`` (the microbatch
losses return the scalar to differentiate with ``jax.grad``), and ``tokenize_prompt_and_output``
returns JAX arrays. The general estimators (RLOO, Dr. GRPO, DAPO, GSPO, TIS, KL) live in the
sibling modules and are chosen by ``loss_config`` (the batched preference losses behind the DPO
one: ``preference``); this module keeps only the course's API.
"""

from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlvr.algos import loss_config
from jaxrlvr.model import logprobs as logprobs_lib

LossType = Literal["no_baseline", "reinforce_with_baseline", "grpo_clip"]

_f32 = jnp.float32


def _mask_f32(mask: jax.Array) -> jax.Array:
    return jnp.asarray(mask).astype(_f32)


def masked_mean(values: jax.Array, mask: jax.Array, axis: int | None = None) -> jax.Array:
    """Mean of ``values`` over the entries where ``mask`` is set (CS336 assignment 5).

    masked_mean = sum(values * mask, axis) / sum(mask, axis). A slice with no valid entry gives
    NaN (0/0), exactly as the PyTorch reference; it is not hidden.

    Args:
      values: floating array, any shape.
      mask: bool/int/float array of the same shape.
      axis: axis to reduce, or None for all.
    """
    loss_config.expect_array(values, "values", kind="float")
    loss_config.expect_array(mask, "mask", shape=jnp.shape(values), kind="mask")
    m = _mask_f32(mask)
    return jnp.sum(values.astype(_f32) * m, axis=axis) / jnp.sum(m, axis=axis)


def masked_normalize(
    values: jax.Array,
    mask: jax.Array,
    normalize_constant: float,
    axis: int | None = None,
) -> jax.Array:
    """Masked sum divided by a constant (never the mask count).

    masked_normalize = sum(values * mask, axis) / normalize_constant; ``axis=None`` reduces all.
    Dividing by a fixed constant instead of the token count is what makes the SFT loss and the
    Dr. GRPO aggregation (Liu et al. 2025) free of length bias.
    """
    loss_config.expect_array(values, "values", kind="float")
    loss_config.expect_array(mask, "mask", shape=jnp.shape(values), kind="mask")
    m = _mask_f32(mask)
    return jnp.sum(values.astype(_f32) * m, axis=axis) / normalize_constant


def compute_entropy(logits: jax.Array) -> jax.Array:
    """Entropy in nats of softmax(logits) over the last axis, in float32.

    H = logsumexp(z) - sum_v softmax(z)_v * z_v, computed on z - max(z) so that large logits
    neither overflow nor cancel. (Shannon entropy; used as the entropy bonus/metric in PPO, Schulman
    et al. 2017.)

    Args:
      logits: floating [..., V]. Returns [...].
    """
    loss_config.expect_array(logits, "logits", rank={1, 2, 3, 4}, kind="float")
    # Shifted by the max first (``model.logprobs``): the two terms are then O(log V) and their
    # difference does not cancel catastrophically for large logits; -inf logits contribute 0.
    return logprobs_lib.entropy(logits)


def get_response_log_probs(
    logits: jax.Array,
    labels: jax.Array,
    return_token_entropy: bool = False,
) -> dict[str, jax.Array]:
    """Per-token log-probabilities of ``labels`` under ``logits`` (CS336 assignment 5).

    log_probs[b, t] = log_softmax(logits)[b, t, labels[b, t]] = z[labels] - logsumexp(z);
    labels are already shifted (label t is the token after input t). Computed by
    ``model.logprobs`` (shared with the trainer and the sampler): no [B, T, V] log-softmax array.

    Args:
      logits: floating [B, T, V] (the model output; the course calls the model itself).
      labels: integer [B, T].
      return_token_entropy: also return ``token_entropy`` [B, T] (``compute_entropy``).
    Returns:
      {"log_probs": float32 [B, T]} plus {"token_entropy": float32 [B, T]} when asked.
    """
    loss_config.expect_array(logits, "logits", rank=3, kind="float")
    loss_config.expect_array(labels, "labels", shape=logits.shape[:2], kind="int")
    labels = labels.astype(jnp.int32)
    if not return_token_entropy:
        return {"log_probs": logprobs_lib.label_logprobs(logits, labels)}
    logp, ent = logprobs_lib.logprobs_and_entropy(logits, labels, entropy_grad=True)
    return {"log_probs": logp, "token_entropy": ent}


def tokenize_prompt_and_output(
    prompt_strs: Sequence[str],
    output_strs: Sequence[str],
    tokenizer: Any,
) -> dict[str, jax.Array]:
    """Tokenise prompt/output pairs for next-token training (CS336 assignment 5; host-side).

    Prompt and output are tokenised separately without special tokens, concatenated and
    right-padded with ``tokenizer.pad_token_id`` to the longest pair. With full [B, L]:
    ``input_ids = full[:, :-1]``, ``labels = full[:, 1:]``, and ``response_mask[b, t]`` is true
    exactly when ``labels[b, t]`` is an output token (not prompt, not padding).

    Returns: int32 ``input_ids`` [B, L-1], int32 ``labels`` [B, L-1], bool ``response_mask``.
    """
    if len(prompt_strs) != len(output_strs):
        raise ValueError(
            f"prompt_strs and output_strs must have the same length, got "
            f"{len(prompt_strs)} and {len(output_strs)}"
        )
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer.pad_token_id must be set to right-pad the batch")
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompt_strs]
    outputs = [tokenizer.encode(o, add_special_tokens=False) for o in output_strs]
    length = max(len(p) + len(o) for p, o in zip(prompts, outputs, strict=True))
    full = np.full((len(prompts), length), tokenizer.pad_token_id, dtype=np.int32)
    mask = np.zeros((len(prompts), length), dtype=bool)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        full[i, : len(p) + len(o)] = p + o
        mask[i, len(p) : len(p) + len(o)] = True
    return {
        "input_ids": jnp.asarray(full[:, :-1]),
        "labels": jnp.asarray(full[:, 1:]),
        # mask is indexed by the label position: label t is full[t + 1].
        "response_mask": jnp.asarray(mask[:, 1:]),
    }


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: Sequence[str],
    repeated_ground_truths: Sequence[str],
    group_size: int,
    advantage_eps: float,
    normalize_by_std: bool,
) -> tuple[jax.Array, jax.Array, dict[str, float]]:
    """Rewards and GRPO group-normalised advantages (Shao et al. 2024, DeepSeekMath, sec. 4.1.2).

    Groups are contiguous blocks of ``group_size`` responses to one question. raw reward
    r_i = reward_fn(response_i, truth_i)["reward"]; advantage A_i = r_i - mean_group(r), divided
    by (std_group(r) + advantage_eps) when ``normalize_by_std``, with the unbiased (n - 1) std as
    PyTorch's default (so ``group_size`` 1 gives NaN there, as in the reference).

    Returns:
      (advantages float32 [N], raw_rewards float32 [N], metadata) where metadata holds
      reward_mean / reward_std / reward_min / reward_max (over all N) and frac_groups_all_equal.
    """
    n = len(rollout_responses)
    if n != len(repeated_ground_truths):
        raise ValueError(
            f"rollout_responses and repeated_ground_truths must have the same length, got "
            f"{n} and {len(repeated_ground_truths)}"
        )
    if group_size < 1 or n % group_size:
        raise ValueError(f"group_size must divide the number of responses {n}, got {group_size}")
    raw = np.asarray(
        [
            float(reward_fn(r, t)["reward"])
            for r, t in zip(rollout_responses, repeated_ground_truths, strict=True)
        ],
        dtype=np.float32,
    )
    raw_rewards = jnp.asarray(raw)
    grouped = raw_rewards.reshape(-1, group_size)
    adv = grouped - jnp.mean(grouped, axis=-1, keepdims=True)
    if normalize_by_std:
        adv = adv / (jnp.std(grouped, axis=-1, ddof=1, keepdims=True) + advantage_eps)
    metadata = {
        "reward_mean": float(raw.mean()),
        "reward_std": float(raw.std(ddof=1)) if n > 1 else float("nan"),
        "reward_min": float(raw.min()),
        "reward_max": float(raw.max()),
        "frac_groups_all_equal": float(
            np.mean(np.all(raw.reshape(-1, group_size) == raw.reshape(-1, group_size)[:, :1], 1))
        ),
    }
    return adv.reshape(-1), raw_rewards, metadata


def _check_adv_and_logp(adv: jax.Array, name: str, policy_log_probs: jax.Array) -> None:
    loss_config.expect_array(policy_log_probs, "policy_log_probs", rank=2, kind="float")
    loss_config.expect_array(adv, name, shape=(policy_log_probs.shape[0], 1), kind="real")


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: jax.Array,
    policy_log_probs: jax.Array,
) -> jax.Array:
    """Per-token REINFORCE loss -A * log pi(o_t) (Williams 1992), float32 [B, T].

    Args:
      raw_rewards_or_advantages: [B, 1], broadcast over tokens.
      policy_log_probs: floating [B, T].
    """
    _check_adv_and_logp(raw_rewards_or_advantages, "raw_rewards_or_advantages", policy_log_probs)
    return -raw_rewards_or_advantages.astype(_f32) * policy_log_probs.astype(_f32)


def compute_grpo_clip_loss(
    advantages: jax.Array,
    policy_log_probs: jax.Array,
    old_log_probs: jax.Array,
    cliprange: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Per-token GRPO-Clip loss (PPO's clipped surrogate, Schulman et al. 2017; GRPO, Shao 2024).

    ratio = exp(lp - old_lp); loss = -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A).

    Args:
      advantages: [B, 1]; policy_log_probs, old_log_probs: floating [B, T]; cliprange: eps.
    Returns:
      (loss float32 [B, T], {"clipped": bool [B, T] where the clipped term was strictly the
      smaller (the token's gradient is zero), "ratio": float32 [B, T]}).
    """
    _check_adv_and_logp(advantages, "advantages", policy_log_probs)
    loss_config.expect_array(old_log_probs, "old_log_probs", shape=policy_log_probs.shape)
    loss_config.expect_array(old_log_probs, "old_log_probs", kind="float")
    a = advantages.astype(_f32)
    ratio = jnp.exp(policy_log_probs.astype(_f32) - old_log_probs.astype(_f32))
    unclipped = ratio * a
    clipped = jnp.clip(ratio, 1.0 - cliprange, 1.0 + cliprange) * a
    return -jnp.minimum(unclipped, clipped), {"clipped": clipped < unclipped, "ratio": ratio}


def compute_policy_gradient_loss(
    policy_log_probs: jax.Array,
    loss_type: LossType,
    raw_rewards: jax.Array | None = None,
    advantages: jax.Array | None = None,
    old_log_probs: jax.Array | None = None,
    cliprange: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Dispatch to the per-token policy-gradient loss named by ``loss_type``.

    "no_baseline": -r * lp (REINFORCE on raw rewards); "reinforce_with_baseline": -A * lp on
    group-normalised advantages (GRPO without clipping); "grpo_clip": ``compute_grpo_clip_loss``.
    A missing argument for the chosen type raises ``ValueError`` naming it.
    """
    loss_config.check_literal("loss_type", loss_type, LossType)

    def need(**kwargs: Any) -> None:
        for key, value in kwargs.items():
            if value is None:
                raise ValueError(f"loss_type={loss_type!r} requires `{key}`")

    if loss_type == "no_baseline":
        need(raw_rewards=raw_rewards)
        return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}
    if loss_type == "reinforce_with_baseline":
        need(advantages=advantages)
        return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}
    need(advantages=advantages, old_log_probs=old_log_probs, cliprange=cliprange)
    return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange)


def sft_microbatch_loss(
    policy_log_probs: jax.Array,
    response_mask: jax.Array,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """SFT negative log-likelihood of one microbatch, scaled for gradient accumulation.

    loss = mean_b( sum_t(-lp[b, t] * mask[b, t]) / normalize_constant )
           / gradient_accumulation_steps

    (the course's ``sft_microbatch_train_step`` without ``.backward()``; differentiate it with
    ``jax.grad``). Metadata: ``nll_sum`` (summed NLL over response tokens) and
    ``num_response_tokens``.
    """
    loss_config.expect_array(policy_log_probs, "policy_log_probs", rank=2, kind="float")
    loss_config.expect_array(
        response_mask, "response_mask", shape=policy_log_probs.shape, kind="mask"
    )
    per_seq = masked_normalize(-policy_log_probs, response_mask, normalize_constant, axis=-1)
    loss = jnp.mean(per_seq) / gradient_accumulation_steps
    m = _mask_f32(response_mask)
    meta = {
        "nll_sum": jax.lax.stop_gradient(-jnp.sum(policy_log_probs.astype(_f32) * m)),
        "num_response_tokens": jnp.sum(m),
    }
    return loss, meta


def grpo_microbatch_loss(
    policy_log_probs: jax.Array,
    response_mask: jax.Array,
    gradient_accumulation_steps: int,
    loss_type: LossType,
    raw_rewards: jax.Array | None = None,
    advantages: jax.Array | None = None,
    old_log_probs: jax.Array | None = None,
    cliprange: float | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """GRPO loss of one microbatch (the course's ``grpo_microbatch_train_step``, minus backward).

    loss = mean_b( masked_mean(per_token_loss[b], mask[b]) ) / gradient_accumulation_steps, with
    per_token_loss from ``compute_policy_gradient_loss``. This is GRPO's sequence-mean of token
    means (Shao et al. 2024); a row with no response token gives NaN as in the reference (see
    ``aggregation`` for the guarded, microbatch-exact training aggregations).
    Metadata: that of ``compute_policy_gradient_loss`` plus ``clip_fraction`` for grpo_clip.
    """
    loss_config.expect_array(policy_log_probs, "policy_log_probs", rank=2, kind="float")
    loss_config.expect_array(
        response_mask, "response_mask", shape=policy_log_probs.shape, kind="mask"
    )
    per_token, meta = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange
    )
    loss = jnp.mean(masked_mean(per_token, response_mask, axis=-1)) / gradient_accumulation_steps
    meta = dict(meta)
    if "clipped" in meta:
        meta["clip_fraction"] = masked_mean(meta["clipped"].astype(_f32), response_mask)
    return loss, meta


# The Alpaca prompt template that CS336 assignment 5 uses for its SFT data and per-instance DPO
# loss (``cs336_alignment/prompts/alpaca_sft.prompt``).
ALPACA_TEMPLATE = (
    "Below is an instruction that describes a task. Write a response that appropriately "
    "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n{response}"
)


# ---------------------------------------------------------------------------------------------
# The per-instance DPO loss (spring 2025).


def _response_logp(model: Any, ids: list[int], prompt_len: int) -> jax.Array:
    """Summed log pi of ``ids[prompt_len:]`` given the tokens before each."""
    x = jnp.asarray([ids[:-1]], jnp.int32)
    labels = jnp.asarray([ids[1:]], jnp.int32)
    logits = model(x, jnp.ones_like(x))
    logp = logprobs_lib.logprobs_and_entropy(logits, labels)[0][0]
    mask = jnp.arange(len(ids) - 1) >= prompt_len - 1  # label t is ids[t + 1]
    return jnp.sum(jnp.where(mask, logp, 0.0))


def per_instance_dpo_loss(
    model: Any,
    ref_model: Any,
    tokenizer: Any,
    beta: float,
    prompt: str,
    response_chosen: str,
    response_rejected: str,
) -> jax.Array:
    """The DPO loss of one preference example (CS336 assignment 5's per-instance DPO loss).

    The prompt and each response are formatted with the course's Alpaca template
    (``ALPACA_TEMPLATE``)::

        Below is an instruction that describes a task. Write a response that appropriately
        completes the request.

        ### Instruction:
        {prompt}

        ### Response:
        {response}

    (the first paragraph is one line), then tokenised without special tokens, and the
    tokenizer's EOS token is appended after each response. With log pi(y|x) the sum of the
    log-probs of the response tokens and the EOS (the prompt's own tokens would cancel in the
    difference below), the loss is

        -log sigma(beta [(log pi(y_w) - log pi_ref(y_w)) - (log pi(y_l) - log pi_ref(y_l))]).

    The prompt prefix is tokenised once (the template up to ``{response}``) and the response
    tokens are those of the full text after it, so a token that straddles the boundary counts
    to the response.

    Args:
      model, ref_model: jaxrlvr Qwen2 causal LMs (called as ``model(input_ids, mask)``).
      tokenizer: a Hugging Face tokenizer with ``eos_token_id``.
      beta: DPO's beta. prompt, response_chosen, response_rejected: strings.
    Returns:
      the scalar float32 loss (differentiable in ``model``'s parameters under ``nnx.grad``).
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer.eos_token_id must be set: EOS is appended to each response")
    prefix = ALPACA_TEMPLATE.split("{response}")[0].format(instruction=prompt)
    prompt_len = len(tokenizer.encode(prefix, add_special_tokens=False))

    def ids(response: str) -> list[int]:
        text = ALPACA_TEMPLATE.format(instruction=prompt, response=response)
        return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]

    w, lo = ids(response_chosen), ids(response_rejected)
    ref_w = jax.lax.stop_gradient(_response_logp(ref_model, w, prompt_len))
    ref_l = jax.lax.stop_gradient(_response_logp(ref_model, lo, prompt_len))
    h = (_response_logp(model, w, prompt_len) - ref_w) - (
        _response_logp(model, lo, prompt_len) - ref_l
    )
    return -jax.nn.log_sigmoid(beta * h)
