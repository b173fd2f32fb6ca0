"""RLVR training in pure JAX: the CS336 assignment-5 function set, the field's estimators, and one
``Algorithm`` record per training method.

Modules (import them, e.g. ``from jaxrlvr.algos import advantages``):

The loss math, pure over arrays:
  losses          the course's functions (masked_mean ... grpo_microbatch_loss,
                  per_instance_dpo_loss), re-exported here
  loss_config     AdvantageConfig, PolicyLossConfig, LengthRewardConfig, OverlongConfig, contracts
  advantages      group baselines (mean / RLOO / none) and scales (group / batch std / none)
  aggregation     token- and sequence-level loss aggregation, exact under microbatching
  policy_loss     the clipped / dual-clip / GSPO / KL / entropy / TIS policy objective and metrics
  kl              k1 / k2 / k3 KL estimators
  importance      truncated importance sampling weights and mismatch metrics
  gae             PPO per-token rewards, GAE and the clipped value loss
  shaping         Kimi k1.5 length reward, DAPO overlong penalty, truncated-completion masking
  segments        packed rows: per-sequence sums and counts over segment ids
  distill         on-policy distillation: the reverse-KL per-token advantage and the
                  generalised JSD (full vocabulary or the teacher's top-k)

The training machinery:
  batch           Batch (the update's input), BatchSpec, validate_batch, register_field (a
                  feature's own batch fields, declared in its module: distill's teacher
                  scores, routing's MoE routes)
  state           TrainState (the pytree an update consumes and returns)
  optim           OptimizerConfig, make_optimizer, make_schedule
  engine          microbatching, gradient accumulation, the one update skeleton, epochs,
                  the log-prob passes
  algorithm       the Algorithm record (init / prepare / update / rollout_spec) and what its
                  factories share
  sft             SFTUpdateConfig, sft_algorithm, expert_iteration_algorithm
  grpo            GRPOUpdateConfig, grpo_algorithm
  policy_gradient what GRPO and PPO share: batch specs, the policy terms, the old/ref passes
  ppo             PPOConfig, PPOUpdateConfig, ppo_algorithm (value: the critic)
  preference      DPO / IPO / SimPO / ORPO losses, PreferenceUpdateConfig, preference_algorithm
  step            CompiledAlgorithm (the one compiled path), shardings, multi-host batches

Every loss is pure, jit-able (configs and sizes are static) and opens with chex contracts.
"""

from jaxrlvr.algos.algorithm import Algorithm, select_fields
from jaxrlvr.algos.batch import Batch, BatchError, BatchSpec, validate_batch
from jaxrlvr.algos.distill import DistillConfig, DistillUpdateConfig, distill_algorithm
from jaxrlvr.algos.grpo import GRPOUpdateConfig, grpo_algorithm
from jaxrlvr.algos.losses import (
    compute_entropy,
    compute_group_normalized_rewards,
    compute_grpo_clip_loss,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    get_response_log_probs,
    grpo_microbatch_loss,
    masked_mean,
    masked_normalize,
    per_instance_dpo_loss,
    sft_microbatch_loss,
    tokenize_prompt_and_output,
)
from jaxrlvr.algos.optim import OptimizerConfig, make_optimizer, make_schedule
from jaxrlvr.algos.ppo import PPOConfig, PPOUpdateConfig, ppo_algorithm
from jaxrlvr.algos.preference import (
    PreferenceLossConfig,
    PreferenceUpdateConfig,
    preference_algorithm,
)
from jaxrlvr.algos.sft import SFTUpdateConfig, expert_iteration_algorithm, sft_algorithm
from jaxrlvr.algos.state import TrainState
from jaxrlvr.algos.step import (
    CompiledAlgorithm,
    NonFiniteUpdateError,
    batch_shardings,
    process_batch_rows,
    shard_batch,
    shard_local_batch,
    shard_state,
    state_shardings,
)

__all__ = [
    # The CS336 assignment-5 function set.
    "compute_entropy",
    "compute_group_normalized_rewards",
    "compute_grpo_clip_loss",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "get_response_log_probs",
    "grpo_microbatch_loss",
    "masked_mean",
    "masked_normalize",
    "per_instance_dpo_loss",
    "sft_microbatch_loss",
    "tokenize_prompt_and_output",
    # The records, their factories and configs, and the compiled path.
    "Algorithm",
    "CompiledAlgorithm",
    "DistillConfig",
    "DistillUpdateConfig",
    "GRPOUpdateConfig",
    "NonFiniteUpdateError",
    "PPOConfig",
    "PPOUpdateConfig",
    "PreferenceLossConfig",
    "PreferenceUpdateConfig",
    "SFTUpdateConfig",
    "distill_algorithm",
    "expert_iteration_algorithm",
    "grpo_algorithm",
    "ppo_algorithm",
    "preference_algorithm",
    "select_fields",
    "sft_algorithm",
    # State, batches, optimiser, placement on a mesh.
    "Batch",
    "BatchError",
    "BatchSpec",
    "OptimizerConfig",
    "TrainState",
    "batch_shardings",
    "make_optimizer",
    "make_schedule",
    "process_batch_rows",
    "shard_batch",
    "shard_local_batch",
    "shard_state",
    "state_shardings",
    "validate_batch",
]
