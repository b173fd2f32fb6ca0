"""SFT data from a teacher's samples (docs/experiments/distillation.md).

Usage: python scripts/teacher_samples.py CONFIG RUN_DIR OUT.jsonl [--k K] [--all] [key=value ...]

Samples ``k`` completions per training problem of CONFIG from RUN_DIR's newest checkpoint with
the config's sampler (temperature, stop strings, max tokens), grades them with the run's verifier
and writes jsonl rows ``{"prompt", "response", "id", "correct"}``: the rendered prompt the policy
sees and the completion's text, the layout ``sft.data`` reads (the SFT phase appends EOS). By
default only the correct completions are kept (rejection sampling: SFT on the teacher's correct
answers); ``--all`` keeps every completion. ``jaxrlvr pairs`` is the same sampling for preference
pairs; this writes single completions instead. Prints the counts as one json line.
"""

import argparse
import json
import os
import sys

import numpy as np

from jaxrlvr import assembly
from jaxrlvr import config as config_lib


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("run_dir", help="run directory whose newest checkpoint samples")
    p.add_argument("out")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--k", type=int, default=8, help="completions per training problem")
    p.add_argument("--all", action="store_true", help="keep incorrect completions too")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    args = p.parse_args(argv)
    if args.k < 1:
        raise SystemExit(f"--k {args.k}: at least one completion per problem")
    cfg = config_lib.load_config(args.config, args.overrides)
    with assembly.open_run(cfg, mode="pairs", checkpoint=args.run_dir) as run:
        ctx = run.ctx
        problems = ctx.train_problems
        texts = [ctx.render(prob) for prob in problems]
        _, completions, scores, _ = ctx.sample_and_grade(
            problems, args.k, run.cfg.sampler, seed=args.seed
        )
    correct = np.asarray([s["answer_reward"] >= 1.0 for s in scores])
    rows = []
    for i, (comp, ok) in enumerate(zip(completions, correct, strict=True)):
        if ok or args.all:
            j = i // args.k
            row = {"prompt": texts[j], "response": comp.text, "id": str(problems[j].id)}
            rows.append(row | {"correct": bool(ok)})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    solved = correct.reshape(len(problems), args.k).any(axis=1)
    counts = {
        "problems": len(problems),
        "completions": len(completions),
        "sample_accuracy": float(correct.mean()),
        "problems_solved": float(solved.mean()),
        "rows": len(rows),
    }
    print(json.dumps(counts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
