"""The held-out reverse KL of a student to a teacher (docs/experiments/distill_long_run.sh).

Usage: python docs/experiments/distill_long_rkl.py CONFIG RUN_DIR TEACHER_HF [--k K] [key=value ...]

Samples ``k`` completions per held-out problem of CONFIG from RUN_DIR's newest checkpoint with
the evaluation sampler (temperature 1: the student's own distribution), scores every sampled
token with the teacher (``teachers.LocalTeacher``) and prints one json line: the k1 estimate of
the per-token reverse KL, mean over tokens of log p_student(y_t) - log p_teacher(y_t) (the
sampler's log-probs; the quantity on-policy distillation minimises, ``distill/reverse_kl``), its
per-sequence sum averaged over sequences, the held-out accuracy of these samples and the mean
response length. The same number for every student, whatever it was trained with.
"""

import argparse
import json
import sys

import numpy as np

from jaxrlvr import assembly, teachers
from jaxrlvr import config as config_lib


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("run_dir")
    p.add_argument("teacher")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--k", type=int, default=4, help="completions per held-out problem")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = config_lib.load_config(args.config, args.overrides)
    with assembly.open_run(cfg, mode="pairs", checkpoint=args.run_dir) as run:
        ctx = run.ctx
        problems = ctx.eval_problems
        prompt_ids, completions, scores, _ = ctx.sample_and_grade(
            problems, args.k, run.cfg.sampler, seed=args.seed, eval_mode=True
        )
    teacher = teachers.LocalTeacher.load(args.teacher)
    prompts = [list(prompt_ids[c.prompt_index]) for c in completions]
    keep = [i for i, c in enumerate(completions) if c.token_ids]
    t_logp = teacher.completion_logprobs(
        [prompts[i] for i in keep], [completions[i].token_ids for i in keep]
    )
    s_logp = [np.asarray(completions[i].logprobs, np.float64) for i in keep]
    diff = [s - t for s, t in zip(s_logp, t_logp, strict=True)]
    tokens = np.concatenate(diff)
    out = {
        "reverse_kl_per_token": float(tokens.mean()),
        "reverse_kl_per_sequence": float(np.mean([d.sum() for d in diff])),
        "accuracy": float(np.mean([s["answer_reward"] >= 1.0 for s in scores])),
        "response_length": float(np.mean([len(c.token_ids) for c in completions])),
        "sequences": len(keep),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
