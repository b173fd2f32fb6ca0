#!/usr/bin/env bash
# The ScaleRL experiment of docs/experiments/scalerl.md: the demo's GRPO (configs/demo.yaml)
# against the ScaleRL recipe (configs/scalerl_demo.yaml: CISPO, prompt-level averaging, batch
# std, FP32 head, zero-variance filtering, No-Positive-Resampling) and CISPO alone
# (configs/cispo_demo.yaml; CISPO=0 skips it), SEEDS each, held-out accuracy
# every 10 RL steps; then ScaleRL's sigmoid fitted to every run (`jaxrlvr plot --fit`) and the
# table / plot of scalerl_report.py. Runs that finished (summary.json) are not run again.
#   LONG_SEEDS=0 docs/experiments/scalerl_run.sh    # OUT=runs/experiments/scalerl SEEDS="0 1 2"
# LONG_SEEDS (e.g. "0"; default none): both recipes again for LONG_STEPS (500) RL steps at a
# constant learning rate (the demo's cosine schedule reaches 0 at its last step, which bends the
# curve by itself), in OUT/long/, to see whether the asymptote A becomes measurable.
# The GRPO runs keep every checkpoint (checkpoint.keep=10): docs/experiments/pass_at_k_run.sh
# evaluates their SFT warm start (step 300) and final policy (step 500).
set -euo pipefail
OUT=${OUT:-runs/experiments/scalerl}
SEEDS=${SEEDS:-"0 1 2"}
COMMON=(eval.every=10 run.progress=false run.tensorboard=false)
for s in $SEEDS; do
  if [ ! -f "$OUT/grpo_s$s/summary.json" ]; then
    jaxrlvr train configs/demo.yaml "run.out_dir=$OUT/grpo_s$s" "run.seed=$s" \
      checkpoint.keep=10 "${COMMON[@]}"
  fi
  if [ ! -f "$OUT/scalerl_s$s/summary.json" ]; then
    jaxrlvr train configs/scalerl_demo.yaml "run.out_dir=$OUT/scalerl_s$s" "run.seed=$s" \
      "${COMMON[@]}"
  fi
  # CISPO alone (configs/cispo_demo.yaml: the recipe's loss without its other switches).
  if [ "${CISPO:-1}" = 1 ] && [ ! -f "$OUT/cispo_s$s/summary.json" ]; then
    jaxrlvr train configs/cispo_demo.yaml "run.out_dir=$OUT/cispo_s$s" "run.seed=$s" \
      "${COMMON[@]}"
  fi
done
LONG=(optim.schedule=constant eval.every=20 "rl.steps=${LONG_STEPS:-500}")
for s in ${LONG_SEEDS:-}; do
  if [ ! -f "$OUT/long/grpo_s$s/summary.json" ]; then
    jaxrlvr train configs/demo.yaml "run.out_dir=$OUT/long/grpo_s$s" "run.seed=$s" \
      "${COMMON[@]}" "${LONG[@]}"
  fi
  if [ ! -f "$OUT/long/scalerl_s$s/summary.json" ]; then
    jaxrlvr train configs/scalerl_demo.yaml "run.out_dir=$OUT/long/scalerl_s$s" "run.seed=$s" \
      "${COMMON[@]}" "${LONG[@]}"
  fi
done
if [ "${REPORT:-1}" = 1 ]; then
  python docs/experiments/scalerl_report.py "$OUT" --png docs/experiments/scalerl.png
  if ls "$OUT"/long/*/summary.json > /dev/null 2>&1; then
    python docs/experiments/scalerl_report.py "$OUT/long" --png docs/experiments/scalerl_long.png
  fi
fi
