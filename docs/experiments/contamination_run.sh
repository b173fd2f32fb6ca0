#!/usr/bin/env bash
# The contamination experiment of docs/experiments/contamination.md: the demo task
# (configs/demo.yaml) with the first 50 of its 100 held-out problems copied into the 500-problem
# training split (COPIES times each), trained as the demo trains (SFT warm start + 200 GRPO
# steps); then the same after `jaxrlvr curate` removed the copies. Each run is evaluated on the
# whole held-out split (the run's own number) and on its two halves (copied / never copied).
#   docs/experiments/contamination_run.sh        # OUT=runs/contamination SEEDS="0 1 2" COPIES=1
set -euo pipefail
OUT=${OUT:-runs/contamination}
SEEDS=${SEEDS:-"0 1 2"}
COPIES=${COPIES:-1}
mkdir -p "$OUT"
# The demo's own splits as files (no step on: curate only writes them out).
cat > "$OUT/splits.yaml" <<EOF
base: $(pwd)/configs/demo.yaml
curate: {decontam: {enabled: false}}
EOF
jaxrlvr curate "$OUT/splits.yaml" --out "$OUT/splits" > /dev/null
python - "$OUT" "$COPIES" <<'EOF'
import json, random, sys
out, copies = sys.argv[1], int(sys.argv[2])
read = lambda p: [json.loads(line) for line in open(p)]
train, held = read(f"{out}/splits/synthetic.jsonl"), read(f"{out}/splits/synthetic_held_out.jsonl")
rows = train + [dict(r, id=f"copy{k}-{r['id']}") for r in held[:50] for k in range(copies)]
random.Random(0).shuffle(rows)
write = lambda p, rs: open(p, "w").write("".join(json.dumps(r) + "\n" for r in rs))
write(f"{out}/contaminated.jsonl", rows)
write(f"{out}/held_copied.jsonl", held[:50])
write(f"{out}/held_clean.jsonl", held[50:])
EOF
cat > "$OUT/curate.yaml" <<EOF
base: $(pwd)/configs/demo.yaml
data: {train: $OUT/contaminated.jsonl, eval: $OUT/splits/synthetic_held_out.jsonl}
EOF
jaxrlvr curate "$OUT/curate.yaml" --out "$OUT/decontaminated"
for s in $SEEDS; do
  for arm in contaminated decontaminated; do
    train=$OUT/contaminated.jsonl
    [ "$arm" = decontaminated ] && train=$OUT/decontaminated/contaminated.jsonl
    run=$OUT/runs/${arm}_s$s
    jaxrlvr train configs/demo.yaml "run.out_dir=$run" "run.seed=$s" "data.train=$train" \
      "data.eval=$OUT/splits/synthetic_held_out.jsonl" run.tensorboard=false run.progress=false \
      --overwrite > "$run.log" 2>&1
    for half in copied clean; do
      jaxrlvr eval "$run/config.yaml" "data.eval=$OUT/held_$half.jsonl" --checkpoint "$run" \
        | grep eval/accuracy | sed "s|^|$arm s$s $half |"
    done
    grep "held-out accuracy after GRPO" "$run.log" | sed "s|^|$arm s$s |"
  done
done
