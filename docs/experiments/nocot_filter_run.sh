#!/usr/bin/env bash
# The no-CoT filter experiment of docs/experiments/nocot_filter.md: on the scratchpad task
# (configs/experiments/scratchpad_base.yaml), the shared SFT warm start
# (configs/experiments/scratchpad_sft.yaml, exported to runs/experiments/sft_hf as
# scripts/run_experiments.sh does) is the policy the no-CoT filter of `jaxrlvr curate` queries:
# K samples of each of the 2000 training problems with " <answer>" appended to the prompt (the
# question_only template's forced text: no written work), dropped when at least THRESHOLD of
# them are right. Then vanilla GRPO (configs/experiments/grpo.yaml, STEPS steps) from the same
# warm start on (a) the whole pool, (b) what the filter keeps and (c) as many problems drawn at
# random from the pool (the control: a smaller pool, not the filter's choice), per seed (ARMS
# picks some); each run's final
# checkpoint is evaluated on the held-out split (EVAL_SIZE problems) with a per-problem report,
# which nocot_filter_report.py splits into dropped-like / kept-like problems (the same filter run
# over the held-out split) and writes into the tables and plot.
#   docs/experiments/nocot_filter_run.sh  # OUT=runs/nocot SEEDS="0 1 2" STEPS=40 K=4 ARMS=... PLOT_DIR=...
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-runs/nocot}
SEEDS=${SEEDS:-"0 1 2"}
STEPS=${STEPS:-40}
K=${K:-4}
THRESHOLD=${THRESHOLD:-0.5}
EVAL_SIZE=${EVAL_SIZE:-200}
ARMS=${ARMS:-"unfiltered filtered random"}
PLOT_DIR=${PLOT_DIR:-docs/experiments}
WARM=runs/experiments
mkdir -p "$OUT/runs"

# The warm start (the one every scratchpad experiment starts from), unless it is there.
if [ ! -f "$WARM/sft_hf/config.json" ]; then
  jaxrlvr train configs/experiments/scratchpad_sft.yaml run.progress=false --overwrite
  jaxrlvr export "$WARM/sft" "$WARM/sft_hf" --overwrite
fi

# The task's pools as files: the 2000 training problems and EVAL_SIZE held-out ones (the
# first 100 are the task's usual held-out split), no step on.
SPLIT="data.synthetic_eval_size=$EVAL_SIZE"
cat > "$OUT/pool.yaml" <<EOF
base: $(pwd)/configs/experiments/grpo.yaml
curate: {decontam: {enabled: false}}
EOF
jaxrlvr curate "$OUT/pool.yaml" "$SPLIT" --out "$OUT/pool" > /dev/null
# The no-CoT filter over the training pool, queried from the warm start; short samples (the
# answer is at most two digits and "</answer>").
cat > "$OUT/filter.yaml" <<EOF
base: $(pwd)/configs/experiments/grpo.yaml
curate:
  decontam: {enabled: false}
  no_cot: {enabled: true, k: $K, threshold: $THRESHOLD, max_tokens: 12}
EOF
jaxrlvr curate "$OUT/filter.yaml" "$SPLIT" "model.path=$WARM/sft_hf" --out "$OUT/filtered"
# The same filter over the held-out split, to label held-out problems dropped-like / kept-like
# (nothing trains on these labels).
jaxrlvr curate "$OUT/filter.yaml" "model.path=$WARM/sft_hf" \
  "data.train=$OUT/pool/scratchpad_held_out.jsonl" "data.eval=$OUT/pool/scratchpad_held_out.jsonl" \
  --out "$OUT/held_filter" > /dev/null

# What the policy writes with its thinking cut off, answer by answer (the filter keeps only rates).
python docs/experiments/nocot_filter_answers.py "$OUT/filter.yaml" "$SPLIT" \
  "model.path=$WARM/sft_hf" 2> /dev/null > "$OUT/answers.md"
# The control: as many problems as the filter keeps, drawn at random from the pool.
python - "$OUT" <<'PYEOF'
import os, random, sys
out = sys.argv[1]
pool = open(f"{out}/pool/scratchpad.jsonl").readlines()
n = len(open(f"{out}/filtered/scratchpad.jsonl").readlines())
os.makedirs(f"{out}/random", exist_ok=True)
open(f"{out}/random/scratchpad.jsonl", "w").writelines(random.Random(0).sample(pool, n))
PYEOF

HELD=$OUT/pool/scratchpad_held_out.jsonl
# The warm start on the held-out split, per problem (the start of every curve). data.train is
# the pool file: with a generated data.train the task's own split is evaluated, not data.eval.
jaxrlvr eval configs/experiments/grpo.yaml "data.train=$OUT/pool/scratchpad.jsonl" \
  "data.eval=$HELD" "model.path=$WARM/sft_hf" \
  --max-problems "$EVAL_SIZE" --report "$OUT/runs/warm_start_eval.json" --no-progress \
  | grep eval/accuracy | sed "s|^|warm start |"
for s in $SEEDS; do
  for arm in $ARMS; do
    train=$OUT/pool/scratchpad.jsonl
    [ "$arm" = unfiltered ] || train=$OUT/$arm/scratchpad.jsonl
    run=$OUT/runs/${arm}_s$s
    nice -n 15 jaxrlvr train configs/experiments/grpo.yaml "run.out_dir=$run" "run.seed=$s" \
      "model.path=$WARM/sft_hf" "data.train=$train" "data.eval=$HELD" \
      "rl.steps=$STEPS" "optim.total_steps=$STEPS" run.tensorboard=false run.progress=false \
      --overwrite > "$run.log" 2>&1
    jaxrlvr eval "$run/config.yaml" --checkpoint "$run" --max-problems "$EVAL_SIZE" \
      --report "$run/eval_held_out.json" --no-progress | grep eval/accuracy | sed "s|^|$arm s$s |"
  done
done
python docs/experiments/nocot_filter_report.py "$OUT" --out "$PLOT_DIR" | tee "$OUT/report.md"
