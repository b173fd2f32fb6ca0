#!/usr/bin/env bash
# Runs the Dr. GRPO audit (three variants) and the Kimi length-reward comparison on the demo task,
# then overlays their curves. Extra arguments are passed to every `jaxrlvr train` run
# (e.g. rl.steps=100). Outputs: runs/audit_*, runs/kimi_*, runs/audit_plots, runs/kimi_plots.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/setup_env.sh | tail -n1)
JAXRLVR="$(dirname "$PY")/jaxrlvr"
for cfg in drgrpo_audit_grpo drgrpo_audit_no_std drgrpo_audit_no_length_norm \
           kimi_length_from_start kimi_length_delayed; do
  "$JAXRLVR" train "configs/$cfg.yaml" run.progress=false "$@"
done
"$JAXRLVR" plot runs/audit_grpo runs/audit_no_std runs/audit_no_length_norm --out runs/audit_plots \
  --keys reward_mean,eval/accuracy,response_length_mean,entropy
"$JAXRLVR" plot runs/kimi_from_start runs/kimi_delayed --out runs/kimi_plots \
  --keys reward_mean,eval/accuracy,response_length_mean,length_reward_mean
