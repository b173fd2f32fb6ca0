#!/usr/bin/env bash
# Routing replay on a tiny Qwen3-MoE (issue 40; docs/experiments/routing_replay.md): one SFT warm
# start of configs/demo_moe.yaml (exported), then GRPO without replay, GRPO with R3 and GSPO
# without replay, each with a bfloat16 JAX sampler against the float32 trainer (the mismatch
# source), SEEDS seeds each. Every run takes /tmp/demo.lock so two demos never overlap.
# VARIANTS picks the arms (default: the issue-40 three); grpo_tis and grpo_r3_tis add truncated
# importance sampling against the sampler's log-probs (rl.loss.correction: truncate, source both,
# cap 2), used by docs/experiments/replay_offpolicy_run.sh (issue 48).
# Usage: scripts/routing_replay_experiment.sh [key=value ...]   (overrides every RL run)
set -euo pipefail
cd "$(dirname "$0")/.."
J=${J:-.venv/bin/jaxrlvr}
R=${R:-runs/routing_replay}
SEEDS="${SEEDS:-0 1 2}"
VARIANTS="${VARIANTS:-grpo grpo_r3 gspo}"
SFT_STEPS=${SFT_STEPS:-150}
mkdir -p "$R"
if [ ! -f "$R/sft_hf/config.json" ]; then
  flock /tmp/demo.lock "$J" train configs/demo_moe.yaml run.out_dir="$R/sft" run.progress=false \
    rl.algo=none sft.steps="$SFT_STEPS" checkpoint.every=1000000 --overwrite
  "$J" export "$R/sft" "$R/sft_hf" --overwrite
fi
common=(model.path="$R/sft_hf" model.tokenizer=char sft.steps=0 run.progress=false
  sampler.jax_dtype=bfloat16 checkpoint.every=1000000)
for seed in $SEEDS; do
  for v in $VARIANTS; do
    tis=(rl.loss.correction.mode=truncate rl.loss.correction.source=both
      rl.loss.correction.level=token rl.loss.correction.high=2.0)
    case $v in
      grpo) extra=(rl.routing_replay=none) ;;
      grpo_tis) extra=(rl.routing_replay=none "${tis[@]}") ;;
      grpo_r3) extra=(rl.routing_replay=r3) ;;
      grpo_r3_tis) extra=(rl.routing_replay=r3 "${tis[@]}") ;;
      gspo) extra=(rl.routing_replay=none rl.loss.ratio_level=sequence
        rl.loss.clip_eps_low=3.0e-4 rl.loss.clip_eps_high=4.0e-4) ;;
      *) echo "unknown variant $v (grpo grpo_tis grpo_r3 grpo_r3_tis gspo)" >&2; exit 2 ;;
    esac
    flock /tmp/demo.lock "$J" train configs/demo_moe.yaml run.out_dir="$R/${v}_s$seed" \
      run.seed="$seed" "${common[@]}" "${extra[@]}" "$@" --overwrite
  done
done
