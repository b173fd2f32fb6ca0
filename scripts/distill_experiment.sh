#!/usr/bin/env bash
# The distillation experiment (issue 41 item 6; docs/experiments/distillation.md), from the shipped
# configs: the GRPO teacher (configs/distill_teacher.yaml) exported, the demo's SFT warm start
# (configs/distill_warmstart.yaml) exported, the teacher's correct samples on the training
# prompts (scripts/teacher_samples.py), then for each seed the three students at equal steps:
# on-policy distillation, GRPO, SFT on the teacher's samples (runs of 50 and 100 steps: the SFT
# phase evaluates after its last step). Steps done before are skipped. Every training run takes
# /tmp/demo.lock so two demo-sized runs never overlap. Then scripts/distill_report.py.
# Usage: scripts/distill_experiment.sh        (SEEDS="0 1 2", R=runs/distill)
set -euo pipefail
cd "$(dirname "$0")/.."
J=.venv/bin/jaxrlvr
PY=.venv/bin/python
R=${R:-runs/distill}
SEEDS="${SEEDS:-0 1 2}"
SFT_POINTS="${SFT_POINTS:-50 100}"
q=(run.progress=false)
train() { flock /tmp/demo.lock "$J" train "$@" "${q[@]}" --overwrite; }
done_run() { [ -f "$1/summary.json" ]; }
mkdir -p "$R"
done_run "$R/teacher" || train configs/distill_teacher.yaml run.out_dir="$R/teacher"
[ -f "$R/teacher/hf/config.json" ] || "$J" export "$R/teacher" "$R/teacher/hf" --overwrite
done_run "$R/sft" || train configs/distill_warmstart.yaml run.out_dir="$R/sft"
[ -f "$R/sft/hf/config.json" ] || "$J" export "$R/sft" "$R/sft/hf" --overwrite
ws=(model.path="$R/sft/hf")
# The students' problems: the demo's seed-0 split as files (the synthetic split follows run.seed).
[ -f "$R/data/eval.jsonl" ] || "$PY" - "$R/data" <<'PY'
import json, os, sys
from jaxrlvr import builders, config
splits = builders.load_splits(config.load_config("configs/demo.yaml", ["run.seed=0"]))
os.makedirs(sys.argv[1], exist_ok=True)
for name, problems in zip(("train", "eval"), splits):
    with open(os.path.join(sys.argv[1], name + ".jsonl"), "w") as f:
        for p in problems:
            f.write(json.dumps({"problem": p.question, "answer": p.answer}) + "\n")
PY
ws+=(data.train="$R/data/train.jsonl" data.eval="$R/data/eval.jsonl")
samples="$R/teacher_samples.jsonl"
[ -f "$samples" ] || flock /tmp/demo.lock "$PY" scripts/teacher_samples.py \
  configs/distill_teacher.yaml "$R/teacher" "$samples" --k 8 | tee "$R/teacher_samples.json"
for seed in $SEEDS; do
  out="$R/opd_s$seed"
  done_run "$out" || train configs/distill_student_opd.yaml run.out_dir="$out" run.seed="$seed" \
    "${ws[@]}" rl.distill.teacher="$R/teacher/hf"
  out="$R/grpo_s$seed"
  done_run "$out" || train configs/distill_student_grpo.yaml run.out_dir="$out" run.seed="$seed" \
    "${ws[@]}"
  for n in $SFT_POINTS; do
    out="$R/sft_teacher_s${seed}_n$n"
    done_run "$out" || train configs/distill_student_sft.yaml run.out_dir="$out" \
      run.seed="$seed" "${ws[@]}" sft.steps="$n" sft.data="$samples"
  done
done
