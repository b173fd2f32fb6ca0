"""RLVR loss math in pure JAX: the CS336 assignment-5 function set and the field's estimators.

Modules (import them, e.g. ``from jaxrlvr.algos import advantages``):
  losses       the course's functions (masked_mean ... grpo_microbatch_loss), re-exported here
  loss_config  AdvantageConfig, PolicyLossConfig, LengthRewardConfig, OverlongConfig, contracts
  advantages   group baselines (mean / RLOO / none) and scales (group / batch std / none)
  aggregation  token- and sequence-level loss aggregation, exact under microbatching
  policy_loss  the clipped / dual-clip / GSPO / KL / entropy / TIS policy objective and metrics
  kl           k1 / k2 / k3 KL estimators
  importance   truncated importance sampling weights and mismatch metrics
  gae          PPO per-token rewards, GAE and the clipped value loss
  shaping      Kimi k1.5 length reward, DAPO overlong penalty, truncated-completion masking

Every function is pure, jit-able (configs and sizes are static) and opens with chex contracts.
"""

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
    sft_microbatch_loss,
    tokenize_prompt_and_output,
)

__all__ = [
    "compute_entropy",
    "compute_grpo_clip_loss",
    "compute_group_normalized_rewards",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "get_response_log_probs",
    "grpo_microbatch_loss",
    "masked_mean",
    "masked_normalize",
    "sft_microbatch_loss",
    "tokenize_prompt_and_output",
]

# The update machinery (TrainState, optimiser, batches, update factories, value head, jit
# wrapper): ``from jaxrlvr.algos import updates`` etc.; the main names are re-exported here.
from jaxrlvr.algos.batch import Batch, BatchError, BatchSpec, validate_batch  # noqa: E402
from jaxrlvr.algos.optim import OptimizerConfig, make_optimizer, make_schedule  # noqa: E402
from jaxrlvr.algos.state import TrainState  # noqa: E402
from jaxrlvr.algos.step import (  # noqa: E402
    batch_shardings,
    jit_update,
    process_batch_rows,
    shard_batch,
    shard_local_batch,
    shard_state,
    state_shardings,
)
from jaxrlvr.algos.updates import (  # noqa: E402
    GRPOUpdateConfig,
    PPOUpdateConfig,
    SFTUpdateConfig,
    make_expert_iteration_update,
    make_grpo_update,
    make_logprob_fn,
    make_ppo_update,
    make_sft_update,
)

__all__ += [
    "Batch",
    "BatchError",
    "BatchSpec",
    "GRPOUpdateConfig",
    "OptimizerConfig",
    "PPOUpdateConfig",
    "SFTUpdateConfig",
    "TrainState",
    "batch_shardings",
    "jit_update",
    "make_expert_iteration_update",
    "make_grpo_update",
    "make_logprob_fn",
    "make_optimizer",
    "make_ppo_update",
    "make_schedule",
    "make_sft_update",
    "process_batch_rows",
    "shard_batch",
    "shard_local_batch",
    "shard_state",
    "state_shardings",
    "validate_batch",
]
