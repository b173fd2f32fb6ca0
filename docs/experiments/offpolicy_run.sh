#!/usr/bin/env bash
# The off-policy correction experiment of docs/corrections.md: the demo task with asynchronous
# rollouts four versions old at 10x the demo's learning rate (configs/offpolicy_k4.yaml), four
# arms (no correction, token truncation, sequence mask, IcePop) x SEEDS, every run from one
# shared SFT warm start (the demo's SFT phase, built first), then the table and the plot.
#   docs/experiments/offpolicy_run.sh                  # OUT=runs/offpolicy SEEDS="0 1 2" STEPS=60
# STOP_AT=HH:MM (optional): start no seed after that time and cut a running one off there (a
# shared machine's time box); the report then covers the seeds that finished.
set -euo pipefail
OUT=${OUT:-runs/offpolicy}
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-60}
C=rl.loss.correction
ROWS=(
  --row "token_truncate:$C.mode=truncate,$C.level=token,$C.high=2"
  --row "sequence_mask:$C.mode=mask,$C.level=sequence,$C.high=2"
  --row "icepop:$C.mode=icepop,$C.level=token,$C.low=0.5,$C.high=5"
)
warm=$OUT/warm_start_hf
if [ ! -d "$warm" ]; then
  jaxrlvr sft configs/demo.yaml "run.out_dir=$OUT/warm_start" run.progress=false \
    run.tensorboard=false --overwrite
  jaxrlvr export "$OUT/warm_start" "$warm" --overwrite
fi
left() { echo $(($(date -d "${STOP_AT:-23:59}" +%s) - $(date +%s))); }
for s in $SEEDS; do
  if [ "$(left)" -le 60 ]; then
    echo "STOP_AT=$STOP_AT: seed $s not started" >&2
    break
  fi
  # --systems jaxrlvr: the config itself, the "none" arm (rl.off_policy_correction: false).
  timeout "$(left)" jaxrlvr bench loop --config configs/offpolicy_k4.yaml --systems jaxrlvr "${ROWS[@]}" \
    --steps "$STEPS" --eval-every 20 --set "run.seed=$s" --out "$OUT/seed$s" --warm-start "$warm" \
    || echo "seed $s: bench loop stopped ($?)" >&2
done
python docs/experiments/offpolicy_report.py "$OUT" --png docs/experiments/offpolicy.png
