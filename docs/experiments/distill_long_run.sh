#!/usr/bin/env bash
# Distillation on long outputs (issue 48 item 3): the long scratchpad task
# (configs/distill_long_base.yaml: 44-124 tokens of work per answer), its SFT warm start
# exported, a GRPO teacher (150 steps) exported, the teacher's verified samples on the training
# prompts, then per seed five students from the one warm start, 40 steps each:
#   opd         on-policy distillation, reverse KL, no reward   (distill_long_student_opd.yaml)
#   opd_reward  the same plus GRPO's group advantage (coef 1)   (..._opd_reward.yaml)
#   grpo        GRPO, no teacher                                (..._grpo.yaml)
#   sft_teacher SFT on the teacher's correct samples, runs of SFT_POINTS steps (..._sft.yaml)
# Runs already done (summary.json) are skipped; every run takes /tmp/demo.lock. Then
# docs/experiments/distill_long_report.py (accuracy at equal steps and at equal FLOPs, the
# reverse KL to the teacher).
# Usage: docs/experiments/distill_long_run.sh     (SEEDS="0 1 2", R=runs/distill_long,
#        SMOKE=1 for a few steps of everything, to check the pipeline, into R=runs/distill_long_smoke)
set -euo pipefail
cd "$(dirname "$0")/../.."
J=${J:-.venv/bin/jaxrlvr}
PY=${PY:-.venv/bin/python}
SEEDS="${SEEDS:-0 1 2}"
SFT_POINTS="${SFT_POINTS:-20 40}"
q=(run.progress=false)
if [ "${SMOKE:-0}" = 1 ]; then
  R=${R:-runs/distill_long_smoke}
  SEEDS=0; SFT_POINTS="2"
  small=(rl.prompts_per_step=4 rl.group_size=2 eval.max_problems=4 eval.samples_per_problem=1
         data.synthetic_train_size=16 optim.total_steps=null sft.batch_size=4)
  ws_steps=(sft.steps=2); rl_steps=(rl.steps=2 eval.every=1); k=1
  keep=(--all)  # a 2-step teacher is rarely right: keep its samples to exercise the SFT student
else
  R=${R:-runs/distill_long}
  small=(); ws_steps=(); rl_steps=(); k=8; keep=()
fi
train() { flock /tmp/demo.lock "$J" train "$@" "${q[@]}" "${small[@]}" --overwrite; }
done_run() { [ -f "$1/summary.json" ]; }
mkdir -p "$R"
done_run "$R/sft" || train configs/distill_long_warmstart.yaml run.out_dir="$R/sft" "${ws_steps[@]}"
[ -f "$R/sft/hf/config.json" ] || "$J" export "$R/sft" "$R/sft/hf" --overwrite
done_run "$R/teacher" || train configs/distill_long_teacher.yaml run.out_dir="$R/teacher" \
  model.path="$R/sft/hf" "${rl_steps[@]}"
[ -f "$R/teacher/hf/config.json" ] || "$J" export "$R/teacher" "$R/teacher/hf" --overwrite
# The students' problems: the seed-0 split as files (the synthetic split follows run.seed).
[ -f "$R/data/eval.jsonl" ] || "$PY" - "$R/data" "${small[@]}" <<'PY'
import json, os, sys
from jaxrlvr import builders, config
over = [a for a in sys.argv[2:] if a.startswith("data.")]
cfg = config.load_config("configs/distill_long_base.yaml", ["run.seed=0", *over])
splits = builders.load_splits(cfg)
os.makedirs(sys.argv[1], exist_ok=True)
for name, problems in zip(("train", "eval"), splits):
    with open(os.path.join(sys.argv[1], name + ".jsonl"), "w") as f:
        for p in problems:
            f.write(json.dumps({"problem": p.question, "answer": p.answer}) + "\n")
PY
ws=(model.path="$R/sft/hf" data.train="$R/data/train.jsonl" data.eval="$R/data/eval.jsonl")
samples="$R/teacher_samples.jsonl"
[ -f "$samples" ] || flock /tmp/demo.lock "$PY" scripts/teacher_samples.py \
  configs/distill_long_teacher.yaml "$R/teacher" "$samples" model.path="$R/sft/hf" \
  "${small[@]}" --k "$k" "${keep[@]}" \
  | tee "$R/teacher_samples.json"
for seed in $SEEDS; do
  for m in opd opd_reward; do
    out="$R/${m}_s$seed"
    done_run "$out" || train "configs/distill_long_student_$m.yaml" run.out_dir="$out" \
      run.seed="$seed" "${ws[@]}" rl.distill.teacher="$R/teacher/hf" "${rl_steps[@]}"
  done
  out="$R/grpo_s$seed"
  done_run "$out" || train configs/distill_long_student_grpo.yaml run.out_dir="$out" \
    run.seed="$seed" "${ws[@]}" "${rl_steps[@]}"
  for n in $SFT_POINTS; do
    out="$R/sft_teacher_s${seed}_n$n"
    done_run "$out" || train configs/distill_long_student_sft.yaml run.out_dir="$out" \
      run.seed="$seed" "${ws[@]}" sft.steps="$n" sft.data="$samples"
  done
done
# Each final student's (and the warm start's) held-out reverse KL to the teacher.
mkdir -p "$R/rkl"
for run in "$R/sft" "$R"/opd_s* "$R"/opd_reward_s* "$R"/grpo_s* "$R"/sft_teacher_s*_n*; do
  name=$(basename "$run")
  [ -s "$R/rkl/$name.json" ] || flock /tmp/demo.lock "$PY" docs/experiments/distill_long_rkl.py \
    configs/distill_long_student_grpo.yaml "$run" "$R/teacher/hf" "${ws[@]}" "${small[@]}" \
    | tail -1 > "$R/rkl/$name.json"
done
"$PY" docs/experiments/distill_long_report.py "$R" "${OUT:-docs/experiments/distill_long}"
