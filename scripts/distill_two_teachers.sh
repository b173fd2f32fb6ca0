#!/usr/bin/env bash
# Two teachers into one student (issue 41 item 6; docs/experiments/distillation.md), from the
# shipped configs, after scripts/distill_experiment.sh (whose runs/distill/teacher is the
# arithmetic teacher): the code demo's GRPO teacher (configs/distill_code_teacher.yaml), the
# mixture warm start (configs/distill_two_teachers_warmstart.yaml), the two-teacher on-policy
# distillation (configs/distill_two_teachers.yaml), each exported; then each task's held-out
# accuracy of the warm start and of the student, measured alone with the task's own demo config
# (runs/distill/two_eval/<model>_<task>.txt). Steps done before are skipped; every run takes
# /tmp/demo.lock. Usage: [SEEDS="0 1 2"] scripts/distill_two_teachers.sh
set -euo pipefail
cd "$(dirname "$0")/.."
J=.venv/bin/jaxrlvr
R=runs/distill
q=(run.progress=false)
lock() { flock /tmp/demo.lock "$@"; }
train() { lock "$J" train "$@" "${q[@]}" --overwrite; }
done_run() { [ -f "$1/summary.json" ]; }
export_run() { [ -f "$2/config.json" ] || lock "$J" export "$1" "$2" --overwrite; }
[ -f "$R/teacher/hf/config.json" ] || { echo "run scripts/distill_experiment.sh first"; exit 1; }
done_run "$R/code_teacher" || train configs/distill_code_teacher.yaml
export_run "$R/code_teacher" "$R/code_teacher/hf"
done_run "$R/two_sft" || train configs/distill_two_teachers_warmstart.yaml
export_run "$R/two_sft" "$R/two_sft/hf"
# Students per seed (SEEDS, default "0"; seed 0's run is runs/distill/two_teachers, seed s's
# two_teachers_s<s>): the same warm start and teachers, the seed sets sampling and data order.
students=()
for seed in ${SEEDS:-0}; do
  name=two_teachers; [ "$seed" = 0 ] || name="two_teachers_s$seed"
  done_run "$R/$name" || train configs/distill_two_teachers.yaml run.out_dir="$R/$name" run.seed="$seed"
  export_run "$R/$name" "$R/$name/hf"
  students+=("$name")
done
mkdir -p "$R/two_eval"
for model in two_sft "${students[@]}"; do
  for task in demo code_demo; do
    out="$R/two_eval/${model}_$task.txt"
    [ -s "$out" ] || lock "$J" eval "configs/$task.yaml" model.path="$R/$model/hf" \
      model.tokenizer=char run.progress=false > "$out"
  done
done
grep -H "eval/accuracy" "$R"/two_eval/*.txt
