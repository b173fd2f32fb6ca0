"""Plot and table of the distillation experiment (scripts/distill_experiment.sh).

Usage: python scripts/distill_report.py [RUNS_DIR] [OUT_PREFIX]
Reads RUNS_DIR/{opd,grpo}_s*/ and RUNS_DIR/sft_teacher_s*_n*/ (summary.json, metrics.jsonl),
the teacher's and the warm start's summaries; writes OUT_PREFIX.png (held-out accuracy against
student steps and against the students' cumulative step time, mean over seeds, the band one
standard deviation) and prints a markdown table (mean +- std over seeds, ddof 1); then, when
scripts/distill_two_teachers.sh has run, the two-teacher table.
Training time is the sum of the runs' ``time/step_s`` (sampling, teacher pass, grading, update;
not the evaluations or start-up) over steps 2..n: step 1 carries the compilation (teacher
loading included), reported in its own column.
"""

import glob
import json
import os
import re
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

METHODS = {
    "opd": "on-policy distillation (reverse KL)",
    "grpo": "GRPO (verifiable reward)",
    "sft_teacher": "SFT on the teacher's correct samples",
}


def read_json(path):
    with open(path) as f:
        return json.load(f)


def step_times(run):
    """Per-step ``time/step_s`` of the run's training steps, in order."""
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return np.asarray([r["time/step_s"] for r in rows if "time/step_s" in r], float)


def rl_curve(run):
    """[(step, seconds, accuracy)] from an RL student's evaluations (step 0 included); seconds:
    the summed step times of steps 2..step."""
    times = np.concatenate([[0.0, 0.0], np.cumsum(step_times(run)[1:])])
    summary = read_json(os.path.join(run, "summary.json"))
    hist = [h for h in summary["eval_history"] if h["phase"] != "sft"]
    start = [(0, 0.0, summary["eval_accuracy_after_sft"])]
    return start + [(h["step"], times[h["step"]], h["eval/accuracy"]) for h in hist]


def sft_curve(runs, start_acc):
    """[(steps, seconds, accuracy)] from one seed's SFT runs of increasing length."""
    points = [(0, 0.0, start_acc)]
    for run in runs:
        n = int(re.search(r"_n(\d+)$", run).group(1))
        acc = read_json(os.path.join(run, "summary.json"))["eval_accuracy_final"]
        points.append((n, float(step_times(run)[1:].sum()), acc))
    return sorted(points)


def curves(root, start_acc):
    out = {}
    for m in ("opd", "grpo"):
        runs = sorted(glob.glob(os.path.join(root, f"{m}_s*")))
        out[m] = [rl_curve(r) for r in runs if os.path.exists(os.path.join(r, "summary.json"))]
    seeds = sorted(
        {re.search(r"_s(\d+)_n", p).group(1) for p in glob.glob(f"{root}/sft_teacher_s*")}
    )
    out["sft_teacher"] = []
    for s in seeds:
        runs = [
            r
            for r in glob.glob(os.path.join(root, f"sft_teacher_s{s}_n*"))
            if os.path.exists(os.path.join(r, "summary.json"))
        ]
        # step 0: the warm start evaluated with this seed's sampling (its GRPO run's first
        # evaluation), else the warm start run's own evaluation
        grpo = os.path.join(root, f"grpo_s{s}", "summary.json")
        start_s = read_json(grpo)["eval_accuracy_after_sft"] if os.path.exists(grpo) else start_acc
        out["sft_teacher"].append(sft_curve(runs, start_s))
    return out


def stack(curve_list):
    """[seeds, points, 3] over the steps every seed has."""
    common = sorted(set.intersection(*[{p[0] for p in c} for c in curve_list]))
    return np.asarray([[next(p for p in c if p[0] == s) for s in common] for c in curve_list])


def fmt(x, digits=3):
    mean, sd = float(np.mean(x)), float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")
    return f"{mean:.{digits}f} +- {sd:.{digits}f}"


def main(root="runs/distill", out="docs/experiments/distillation"):
    teacher = read_json(os.path.join(root, "teacher", "summary.json"))["eval_accuracy_final"]
    start = read_json(os.path.join(root, "sft", "summary.json"))["eval_accuracy_final"]
    data = {m: stack(c) for m, c in curves(root, start).items() if c}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for m, arr in data.items():
        steps, secs, acc = arr[..., 0].mean(0), arr[..., 1].mean(0), arr[..., 2]
        mean, sd = acc.mean(0), acc.std(0, ddof=1) if len(acc) > 1 else 0 * acc[0]
        for ax, x in zip(axes, (steps, secs), strict=True):
            ax.plot(x, mean, marker="o", label=f"{METHODS[m]} ({len(acc)} seeds)")
            ax.fill_between(x, mean - sd, mean + sd, alpha=0.2)
    for ax, xl in zip(axes, ("student steps", "student training time (s, sum of step times)")):
        ax.axhline(
            teacher, color="k", ls="--", lw=1, label=f"teacher (GRPO 400 steps) {teacher:.3f}"
        )
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out accuracy (avg@4, T=1)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle("Demo task: students from the same SFT warm start, mean +- std over seeds")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    steps = sorted({int(x) for arr in data.values() for x in arr[0, :, 0]})
    print(f"teacher {teacher:.4f}, warm start {start:.4f}")
    print(
        "| method | seeds | "
        + " | ".join(f"step {s}" for s in steps)
        + f" | time of steps 2-{steps[-1]} (s) | median step (s) | step 1 (s, compiles) |"
    )
    print("|---|---|" + "---|" * (len(steps) + 3))
    for m, arr in data.items():
        at = {int(x): i for i, x in enumerate(arr[0, :, 0])}
        cells = [fmt(arr[:, at[s], 2]) if s in at else "-" for s in steps]
        last = int(arr[0, -1, 0])
        pattern = f"{m}_s*" if m != "sft_teacher" else f"{m}_s*_n{last}"
        done = sorted(glob.glob(os.path.join(root, pattern, "summary.json")))
        times = [step_times(os.path.dirname(r)) for r in done]
        first = [t[0] for t in times]
        median = [float(np.median(t[1:])) for t in times]
        print(
            f"| {METHODS[m]} | {len(arr)} | "
            + " | ".join(cells)
            + f" | {fmt(arr[:, -1, 1], 1)} | {fmt(median)} | {fmt(first, 1)} |"
        )


def eval_accuracy(path):
    """``eval/accuracy`` from the output of ``jaxrlvr eval``."""
    with open(path) as f:
        return float(next(line.split()[1] for line in f if line.startswith("eval/accuracy:")))


def two_teachers(root="runs/distill"):
    """The two-teacher table (scripts/distill_two_teachers.sh), when its runs exist: each task's
    held-out accuracy of its own teacher, the mixture warm start and the distilled students (one
    per seed: two_teachers, two_teachers_s<seed>), mean +- sd over seeds, and each student's
    per-domain reverse KL (mean of the first and last 10 steps)."""
    ev = os.path.join(root, "two_eval")
    students = sorted(
        n
        for n in os.listdir(root)
        if re.fullmatch(r"two_teachers(_s\d+)?", n)
        and os.path.exists(os.path.join(ev, f"{n}_code_demo.txt"))
    )
    if not students:
        return
    teachers = {
        "demo": read_json(os.path.join(root, "teacher", "summary.json"))["eval_accuracy_final"],
        "code_demo": read_json(os.path.join(root, "code_teacher", "summary.json"))[
            "eval_accuracy_final"
        ],
    }
    kl = {}
    for n in students:
        with open(os.path.join(root, n, "metrics.jsonl")) as f:
            rows = [r for r in map(json.loads, f) if "distill/arith/reverse_kl" in r]
        for d in ("arith", "code"):
            kl[n, d] = (
                np.mean([r[f"distill/{d}/reverse_kl"] for r in rows[:10]]),
                np.mean([r[f"distill/{d}/reverse_kl"] for r in rows[-10:]]),
            )
    print()
    print(
        "| task | its teacher | mixture warm start | two-teacher students "
        f"({' / '.join(students)}) | mean +- sd | reverse KL to its teacher |"
    )
    print("|---|---|---|---|---|---|")
    for task, domain in (("demo", "arith"), ("code_demo", "code")):
        ws = eval_accuracy(os.path.join(ev, f"two_sft_{task}.txt"))
        acc = [eval_accuracy(os.path.join(ev, f"{n}_{task}.txt")) for n in students]
        sd = np.std(acc, ddof=1) if len(acc) > 1 else 0.0
        kls = " / ".join(f"{kl[n, domain][0]:.3f} -> {kl[n, domain][1]:.3f}" for n in students)
        print(
            f"| {domain} ({task}.yaml held-out) | {teachers[task]:.3f} | {ws:.3f} "
            f"| {' / '.join(f'{x:.3f}' for x in acc)} | {np.mean(acc):.3f} +- {sd:.3f} | {kls} |"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
    two_teachers(*sys.argv[1:2])
