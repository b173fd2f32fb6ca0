"""Configs (jaxrlvr.algos.loss_config) and the chex contracts of every public array function."""

import dataclasses

import numpy as np
import pytest

from jaxrlvr.algos import (
    advantages,
    aggregation,
    gae,
    importance,
    kl,
    loss_config,
    losses,
    policy_loss,
    shaping,
)

PLC = loss_config.PolicyLossConfig


@pytest.mark.parametrize(
    ("cls", "kwargs", "message"),
    [
        (loss_config.AdvantageConfig, {"baseline": "median"}, "baseline must be one of"),
        (loss_config.AdvantageConfig, {"scale": "max"}, "scale must be one of"),
        (loss_config.AdvantageConfig, {"eps": -1.0}, "eps"),
        (PLC, {"aggregation": "sum"}, "aggregation must be one of"),
        (PLC, {"aggregation": "seq_mean_token_sum_norm"}, "norm_constant"),
        (PLC, {"ratio_level": "batch"}, "ratio_level must be one of"),
        (PLC, {"kl_estimator": "k4"}, "kl_estimator must be one of"),
        (PLC, {"kl_in": "advantage"}, "kl_in must be one of"),
        (PLC, {"tis": "token"}, "replaced by loss.correction"),
        (loss_config.CorrectionConfig, {"mode": "clip"}, "correction.mode must be one of"),
        (loss_config.CorrectionConfig, {"level": "batch"}, "correction.level must be one of"),
        (loss_config.CorrectionConfig, {"source": "vllm"}, "correction.source must be one of"),
        (loss_config.CorrectionConfig, {"high": 0.0}, "correction.high"),
        (loss_config.CorrectionConfig, {"low": 3.0, "high": 2.0}, "correction.low"),
        (PLC, {"clip_eps_low": 1.0}, "clip_eps_low"),
        (PLC, {"clip_eps_high": -0.1}, "clip_eps_high"),
        (PLC, {"dual_clip": 1.0}, "dual_clip"),
        (PLC, {"kl_coef": -1.0}, "kl_coef"),
        (PLC, {"tis_cap": 2.0}, "correction.high=C"),
        (PLC, {"log_ratio_clamp": 0.0}, "log_ratio_clamp"),
        (loss_config.LengthRewardConfig, {"weight": -1.0}, "weight"),
        (loss_config.OverlongConfig, {"max_len": 10, "cache_len": 0}, "cache_len"),
        (loss_config.OverlongConfig, {"max_len": 0, "cache_len": 1}, "max_len"),
    ],
)
def test_invalid_config_names_key(cls, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cls(**kwargs)


def test_literal_error_lists_allowed_values():
    with pytest.raises(ValueError) as err:
        PLC(aggregation="sum")
    for option in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        assert option in str(err.value)


def test_configs_frozen_and_keyword_only():
    cfg = PLC()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.kl_coef = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        loss_config.AdvantageConfig("mean")  # type: ignore[misc]
    ok = PLC(aggregation="seq_mean_token_sum_norm", norm_constant=1024.0)
    assert ok.norm_constant == 1024.0


B, T = 4, 5
F = np.zeros((B, T), np.float32)
F3 = np.zeros((B, T, 7), np.float32)
M = np.ones((B, T), bool)
I = np.zeros((B, T), np.int32)  # noqa: E741
A1 = np.zeros((B, 1), np.float32)
AB = np.zeros((B,), np.float32)
W = F[:, :3]  # wrong shape (rank 2)
R3 = F[..., None]  # wrong rank
C16 = F.astype(np.complex64)  # not a real dtype for masks/rewards
CFG = PLC()
CORR = loss_config.CorrectionConfig(mode="icepop")
D = np.float32(1.0)


def _pl(lp=F, old=F, adv=AB, mask=M, den=D, **kw):
    return policy_loss.policy_loss(lp, old, adv, mask, CFG, denominator=den, **kw)


# (function call with one bad argument, name of that argument)
CASES = {
    "masked_mean/shape": (lambda: losses.masked_mean(F, M[:, :3]), "mask"),
    "masked_mean/dtype": (lambda: losses.masked_mean(I, M), "values"),
    "masked_mean/mask_dtype": (lambda: losses.masked_mean(F, C16), "mask"),
    "masked_normalize/shape": (lambda: losses.masked_normalize(F, M[:2], 1.0), "mask"),
    "masked_normalize/dtype": (lambda: losses.masked_normalize(I, M, 1.0), "values"),
    "entropy/rank": (lambda: losses.compute_entropy(np.float32(1.0)), "logits"),
    "entropy/dtype": (lambda: losses.compute_entropy(I), "logits"),
    "log_probs/rank": (lambda: losses.get_response_log_probs(F, I), "logits"),
    "log_probs/shape": (lambda: losses.get_response_log_probs(F3, I[:, :2]), "labels"),
    "log_probs/dtype": (lambda: losses.get_response_log_probs(F3, F), "labels"),
    "naive/rank": (lambda: losses.compute_naive_policy_gradient_loss(A1, R3), "policy_log_probs"),
    "naive/shape": (
        lambda: losses.compute_naive_policy_gradient_loss(AB, F),
        "raw_rewards_or_advantages",
    ),
    "naive/dtype": (lambda: losses.compute_naive_policy_gradient_loss(A1, I), "policy_log_probs"),
    "clip/shape": (lambda: losses.compute_grpo_clip_loss(A1, F, W, 0.2), "old_log_probs"),
    "clip/dtype": (lambda: losses.compute_grpo_clip_loss(A1, F, I, 0.2), "old_log_probs"),
    "clip/adv": (lambda: losses.compute_grpo_clip_loss(A1[:2], F, F, 0.2), "advantages"),
    "pg/rank": (
        lambda: losses.compute_policy_gradient_loss(R3, "no_baseline", raw_rewards=A1),
        "policy_log_probs",
    ),
    "sft/shape": (lambda: losses.sft_microbatch_loss(F, M[:, :2], 1), "response_mask"),
    "sft/dtype": (lambda: losses.sft_microbatch_loss(I, M, 1), "policy_log_probs"),
    "grpo/shape": (
        lambda: losses.grpo_microbatch_loss(F, W, 1, "no_baseline", raw_rewards=A1),
        "response_mask",
    ),
    "grpo/rank": (
        lambda: losses.grpo_microbatch_loss(R3, M, 1, "no_baseline", raw_rewards=A1),
        "policy_log_probs",
    ),
    "group_adv/rank": (
        lambda: advantages.group_advantages(F3, 2, loss_config.AdvantageConfig()),
        "rewards",
    ),
    "group_adv/dtype": (
        lambda: advantages.group_advantages(C16[0], 5, loss_config.AdvantageConfig()),
        "rewards",
    ),
    "denominator/rank": (lambda: aggregation.loss_denominator(AB, CFG), "mask_bt"),
    "aggregate/rank": (lambda: aggregation.aggregate(AB, M, CFG, D), "per_token_bt"),
    "aggregate/shape": (lambda: aggregation.aggregate(F, W, CFG, D), "mask_bt"),
    "aggregate/dtype": (lambda: aggregation.aggregate(I, M, CFG, D), "per_token_bt"),
    "aggregate/den": (lambda: aggregation.aggregate(F, M, CFG, AB), "denominator"),
    "kl/shape": (lambda: kl.kl_estimate(F, W), "ref_logp_bt"),
    "kl/dtype": (lambda: kl.kl_estimate(I, F), "logp_bt"),
    "corr/rank": (lambda: importance.correction_weights(AB, AB, CORR), "log_ratio_bt"),
    "corr/dtype": (lambda: importance.correction_weights(I, M, CORR), "log_ratio_bt"),
    "corr/mask": (lambda: importance.correction_weights(F, C16, CORR), "mask_bt"),
    "corr/segments": (
        lambda: importance.correction_weights(F, M, CORR, segment_ids_bt=F),
        "segment_ids_bt",
    ),
    "corr_level/shape": (lambda: importance.level_log_ratio(F, W, "token"), "mask_bt"),
    "corr_metrics/shape": (lambda: importance.correction_metrics("p/", F, W, CORR), "mask_bt"),
    "policy/behaviour": (lambda: _pl(behaviour_logp_bt=W), "behaviour_logp_bt"),
    "gae/rank": (lambda: gae.compute_gae(AB, AB, AB, 1.0, 1.0), "rewards_bt"),
    "gae/shape": (lambda: gae.compute_gae(F, W, M, 1.0, 1.0), "values_bt"),
    "gae/dtype": (lambda: gae.compute_gae(F, I, M, 1.0, 1.0), "values_bt"),
    "ppo_rewards/shape": (lambda: gae.ppo_token_rewards(AB[:2], F, M, 0.1), "task_reward_b"),
    "ppo_rewards/dtype": (lambda: gae.ppo_token_rewards(AB, I, M, 0.1), "kl_bt"),
    "value_loss/shape": (lambda: gae.value_loss(F, F, W, M, 0.2, denominator=D), "returns_bt"),
    "value_loss/dtype": (lambda: gae.value_loss(F, I, F, M, 0.2, denominator=D), "old_values_bt"),
    "value_loss/den": (lambda: gae.value_loss(F, F, F, M, 0.2, denominator=AB), "denominator"),
    "kimi/rank": (lambda: shaping.kimi_length_reward(I, M, 5), "lengths"),
    "kimi/shape": (lambda: shaping.kimi_length_reward(AB, AB[:2], 2), "correct"),
    "kimi/dtype": (lambda: shaping.kimi_length_reward(C16[0], AB[:5], 5), "lengths"),
    "overlong/dtype": (lambda: shaping.dapo_overlong_penalty(C16, 10, 2), "lengths"),
    "truncate/rank": (lambda: shaping.mask_truncated_completions(AB, AB), "mask_bt"),
    "truncate/shape": (lambda: shaping.mask_truncated_completions(M, AB[:2]), "truncated_b"),
    "policy/rank": (lambda: _pl(lp=R3), "logp_bt"),
    "policy/dtype": (lambda: _pl(lp=I), "logp_bt"),
    "policy/old": (lambda: _pl(old=W), "old_logp_bt"),
    "policy/adv_shape": (lambda: _pl(adv=AB[:2]), "adv_b"),
    "policy/adv_rank": (lambda: _pl(adv=F3), "adv_b"),
    "policy/mask": (lambda: _pl(mask=C16), "mask_bt"),
    "policy/den": (lambda: _pl(den=AB), "denominator"),
    "policy/ref": (lambda: _pl(ref_logp_bt=W), "ref_logp_bt"),
    "policy/sampler": (lambda: _pl(sampler_logp_bt=I), "sampler_logp_bt"),
    "policy/entropy": (lambda: _pl(entropy_bt=W), "entropy_bt"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_contract_violation_names_argument(case):
    call, name = CASES[case]
    with pytest.raises(AssertionError, match=rf"\[Chex\].*argument `{name}`"):
        call()


def test_every_public_array_function_has_a_contract_case():
    # Host-side functions on Python strings (tokenize_prompt_and_output,
    # compute_group_normalized_rewards) and the metric dict helpers have no array contract.
    covered = {
        losses.masked_mean: "masked_mean",
        losses.masked_normalize: "masked_normalize",
        losses.compute_entropy: "entropy",
        losses.get_response_log_probs: "log_probs",
        losses.compute_naive_policy_gradient_loss: "naive",
        losses.compute_grpo_clip_loss: "clip",
        losses.compute_policy_gradient_loss: "pg",
        losses.sft_microbatch_loss: "sft",
        losses.grpo_microbatch_loss: "grpo",
        advantages.group_advantages: "group_adv",
        aggregation.loss_denominator: "denominator",
        aggregation.aggregate: "aggregate",
        kl.kl_estimate: "kl",
        importance.correction_weights: "corr",
        importance.level_log_ratio: "corr_level",
        importance.correction_metrics: "corr_metrics",
        gae.compute_gae: "gae",
        gae.ppo_token_rewards: "ppo_rewards",
        gae.value_loss: "value_loss",
        shaping.kimi_length_reward: "kimi",
        shaping.dapo_overlong_penalty: "overlong",
        shaping.mask_truncated_completions: "truncate",
        policy_loss.policy_loss: "policy",
    }
    prefixes = {case.split("/")[0] for case in CASES}
    assert set(covered.values()) <= prefixes
