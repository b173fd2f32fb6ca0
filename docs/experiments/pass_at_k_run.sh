#!/usr/bin/env bash
# The pass@k experiment of docs/experiments/pass_at_k.md: pass@k for k = 1..256 (256 samples per
# problem, the demo's 100 held-out problems, temperature 1.0) of three policies per seed:
#   sft      the demo's SFT warm start (step 300 of the GRPO run: the same weights GRPO starts from)
#   grpo     the demo's GRPO policy (step 500; docs/experiments/scalerl_run.sh trains it)
#   distill  the on-policy distillation student (configs/distill_demo.yaml: the same SFT warm
#            start, then 200 steps of reverse KL to that seed's GRPO policy as the teacher)
# then the table and plot of pass_at_k_report.py.
#   docs/experiments/pass_at_k_run.sh     # OUT=runs/experiments/scalerl SEEDS="0 1 2"
set -euo pipefail
OUT=${OUT:-runs/experiments/scalerl}
SEEDS=${SEEDS:-"0 1 2"}
KS=1,2,4,8,16,32,64,128,256
EVAL=(--samples 256 --k "$KS" --maj 8,64 --max-problems 100 --no-progress)
for s in $SEEDS; do
  grpo=$OUT/grpo_s$s
  if [ ! -f "$grpo/summary.json" ]; then
    SEEDS=$s REPORT=0 docs/experiments/scalerl_run.sh
  fi
  dir=$OUT/passk_s$s
  mkdir -p "$dir"
  [ -d "$dir/sft_hf" ] || jaxrlvr export "$grpo" "$dir/sft_hf" --step 300
  [ -d "$dir/grpo_hf" ] || jaxrlvr export "$grpo" "$dir/grpo_hf" --step 500
  [ -f "$dir/sft.json" ] || jaxrlvr eval configs/demo.yaml --model "$dir/sft_hf" "${EVAL[@]}" \
    --report "$dir/sft.json" --plot "$dir/sft.png"
  [ -f "$dir/grpo.json" ] || jaxrlvr eval configs/demo.yaml --checkpoint "$grpo" "${EVAL[@]}" \
    --report "$dir/grpo.json" --plot "$dir/grpo.png"
  if [ ! -f "$OUT/distill_s$s/summary.json" ]; then
    jaxrlvr train configs/distill_demo.yaml "run.out_dir=$OUT/distill_s$s" "run.seed=$s" \
      "rl.distill.teacher=$dir/grpo_hf" run.progress=false run.tensorboard=false
  fi
  [ -f "$dir/distill.json" ] || jaxrlvr eval configs/distill_demo.yaml \
    "rl.distill.teacher=$dir/grpo_hf" --checkpoint "$OUT/distill_s$s" "${EVAL[@]}" \
    --report "$dir/distill.json" --plot "$dir/distill.png"
done
if [ "${REPORT:-1}" = 1 ]; then
  python docs/experiments/pass_at_k_report.py "$OUT" --png docs/experiments/pass_at_k.png
fi
