#!/usr/bin/env bash
# Routing replay where it should matter (issue 48 item 4; docs/experiments/replay_offpolicy.md):
# the MoE demo (configs/demo_moe.yaml) with a bfloat16 JaxSampler against the float32 trainer,
# 4 epochs per step (each a full-batch optimizer step, so epochs 2-4 are off-policy: the ratio
# pi / pi_old moves away from 1), 5 arms x 3 seeds from one exported SFT warm start:
#   grpo, grpo_tis (truncated IS against the sampler's log-probs: pi_old / pi_sampler capped at 2),
#   grpo_r3 (replay the sampler's routes), grpo_r3_tis, gspo (sequence ratio, clip 3e-4 / 4e-4).
# The arms and the warm start are scripts/routing_replay_experiment.sh's (one implementation);
# this script fixes the regime. The learning-rate schedule counts optimizer steps, so
# optim.total_steps = rl.steps x epochs (with total_steps = rl.steps the cosine reaches 0 after a
# quarter of the run: the first pilot's mistake). Runs go one after the other under
# /tmp/demo.lock and nice -n 15.
# Usage: [J=path/to/jaxrlvr] [STEPS=80] [SEEDS="0 1 2"] docs/experiments/replay_offpolicy_run.sh
#   then: python scripts/replay_offpolicy_report.py runs/replay_offpolicy docs/experiments/replay_offpolicy
# The larger learning rate (5x: more drift within a step), on the same warm start, 40 steps:
#   R=runs/replay_offpolicy_lr1e-3 WARM=runs/replay_offpolicy/sft_hf STEPS=40 \
#     docs/experiments/replay_offpolicy_run.sh optim.learning_rate=1.0e-3      (regime B)
# Pilots (1 seed, GRPO; what the write-up reports):
#   SEEDS=0 VARIANTS=grpo STEPS=20 TOTAL=20 PROMPTS=16 EVAL_PROBLEMS=50 ...  (pilot 1: schedule)
#   SEEDS=0 VARIANTS=grpo STEPS=60 EVAL_PROBLEMS=50 ...  (pilot 2: timing and drift)
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS=${STEPS:-80}
EPOCHS=${EPOCHS:-4}
TOTAL=${TOTAL:-$((STEPS * EPOCHS))}
export R=${R:-runs/replay_offpolicy}
export VARIANTS="${VARIANTS:-grpo grpo_tis grpo_r3 grpo_r3_tis gspo}"
if [ -n "${WARM:-}" ] && [ ! -e "$R/sft_hf" ]; then  # share another regime's warm start
  mkdir -p "$R" && ln -s "$(realpath "$WARM")" "$R/sft_hf"
fi
exec nice -n 15 scripts/routing_replay_experiment.sh rl.steps="$STEPS" optim.total_steps="$TOTAL" \
  rl.prompts_per_step="${PROMPTS:-32}" rl.epochs_per_step="$EPOCHS" \
  rl.routing_metrics=full rl.routing_metrics_every="${FULL_EVERY:-5}" \
  eval.every="${EVAL_EVERY:-10}" eval.max_problems="${EVAL_PROBLEMS:-100}" "$@"
