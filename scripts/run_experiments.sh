#!/usr/bin/env bash
# The scratchpad-task experiments of docs/experiments/README.md: the Dr. GRPO length-bias audit and
# the course's GRPO ablations (std normalisation, length normalisation, off-policy epochs with and
# without clipping, R1-Zero template vs question-only), then their plots and result table.
#
# Usage: scripts/run_experiments.sh [key=value ...]
#   Extra arguments override every RL run's config (e.g. rl.steps=30 optim.total_steps=30).
#   EXPERIMENTS="grpo no_std dr_grpo" runs a subset (default: all, in the order below);
#   SEEDS="0 1 2" repeats each RL run per seed (run.seed; output runs/experiments/NAME_sK for
#   seeds other than 0; the warm starts stay at seed 0).
# Outputs: runs/experiments/{sft,sft_hf,r1_zero_sft,r1_zero_sft_hf,NAME}, runs/experiments/plots/,
# runs/experiments/table.md. About 45 min on a 2-core CPU (each RL run 3-6 min).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(scripts/setup_env.sh | tail -n1)
JAXRLVR="$(dirname "$PY")/jaxrlvr"
R=runs/experiments
ALL="grpo no_std dr_grpo const_norm epochs4_clip epochs4_noclip r1_zero"
EXPERIMENTS="${EXPERIMENTS:-$ALL}"
SEEDS="${SEEDS:-0}"

train() { "$JAXRLVR" train "configs/experiments/$1.yaml" run.progress=false "${@:2}" --overwrite; }

# A warm start (SFT only) and its Hugging Face export, which the RL configs load (model.path).
warm_start() {
  if [ ! -f "$R/$1_hf/config.json" ]; then
    train "$2"
    "$JAXRLVR" export "$R/$1" "$R/$1_hf" --overwrite
  fi
}

for name in $EXPERIMENTS; do
  warm_start sft scratchpad_sft
  if [ "$name" = r1_zero ]; then
    # The R1-Zero prompt is ~330 tokens: the question-only warm start with its position limit
    # raised to 512 (RoPE: config.json only), then 60 SFT steps on the R1-Zero template.
    if [ ! -f "$R/sft_hf_512/config.json" ]; then
      rm -rf "$R/sft_hf_512" && cp -r "$R/sft_hf" "$R/sft_hf_512"
      "$PY" - "$R/sft_hf_512/config.json" <<'PYEOF'
import json, sys
cfg = json.load(open(sys.argv[1]))
cfg["max_position_embeddings"] = 512
json.dump(cfg, open(sys.argv[1], "w"), indent=2)
PYEOF
    fi
    warm_start r1_zero_sft r1_zero_sft
  fi
  for seed in $SEEDS; do
    out="$R/$name"; [ "$seed" = 0 ] || out="${out}_s$seed"
    train "$name" run.seed="$seed" run.out_dir="$out" "$@"
  done
done

plot() {  # plot GROUP RUN... : overlays of held-out accuracy, reward and the lengths
  local group=$1; shift
  local dirs=()
  for n in "$@"; do [ -f "$R/$n/metrics.jsonl" ] && dirs+=("$R/$n"); done
  [ "${#dirs[@]}" -ge 2 ] || return 0
  "$JAXRLVR" plot "${dirs[@]}" --out "$R/plots/$group" --keys \
eval/accuracy,reward_mean,eval/response_length_correct_mean,eval/response_length_incorrect_mean,\
response_length_correct_mean,response_length_incorrect_mean,response_length_mean,clip_frac
}
plot drgrpo_audit grpo no_std dr_grpo
plot std_norm grpo no_std
plot length_norm grpo const_norm
plot off_policy grpo epochs4_clip epochs4_noclip
plot template grpo r1_zero
"$PY" scripts/experiments_table.py "$R" > "$R/table.md"
cat "$R/table.md"
