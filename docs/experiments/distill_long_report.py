"""Table and plot of the long-output distillation experiment (docs/experiments/distill_long_run.sh).

Usage: python docs/experiments/distill_long_report.py [RUNS_DIR] [OUT_PREFIX]

Reads RUNS_DIR/{opd,opd_reward,grpo}_s*/ and sft_teacher_s*_n*/ (summary.json, metrics.jsonl,
config.yaml), RUNS_DIR/teacher, RUNS_DIR/sft, RUNS_DIR/teacher_samples.jsonl and, when present,
RUNS_DIR/rkl/<run>.json (``distill_long_rkl.py``: each final student's held-out reverse KL to the
teacher). Writes OUT_PREFIX.png (held-out accuracy against student steps and against student
FLOPs, mean over seeds, band one standard deviation; the OPD runs' training reverse KL) and prints
markdown tables (mean +- std over seeds, ddof 1).

FLOPs (``jaxrlvr.scaling``'s bench formula, ``ModelConfig.flops_per_token`` at rows of prompt +
``sampler.max_tokens``; F = one forward per token, 3F forward + backward):
- an RL step (GRPO, OPD): the sampler's forward and the update's forward + backward over the
  step's prompt and response tokens (``scaling.step_flops``: 4F per token, one epoch), plus for
  OPD the teacher's forward over the same tokens (F_teacher per token: the teacher's scoring);
- an SFT step: 3F over its batch (256 rows of prompt + the mean kept sample's length + EOS),
  plus, once, before its first step, the teacher's sampling of the SFT data (F_teacher over
  k x training problems x (prompt + mean kept sample length): the kept rows' length stands in for
  every sample's);
- left out everywhere: the teacher's own training (shared by OPD and SFT, not by GRPO; its FLOPs
  are printed apart), the warm start, the evaluations.
"""

import glob
import json
import os
import re
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlvr import config as config_lib  # noqa: E402
from jaxrlvr import metrics as metrics_lib  # noqa: E402
from jaxrlvr import scaling  # noqa: E402

METHODS = {
    "opd": "on-policy distillation (reverse KL)",
    "opd_reward": "on-policy distillation + task reward",
    "grpo": "GRPO (task reward)",
    "sft_teacher": "SFT on the teacher's verified samples",
}


def read_json(path):
    with open(path) as f:
        return json.load(f)


def forward_flops(run_dir):
    """F per token (one forward) of the run's config.yaml, and its per-step prompt tokens."""
    cfg = config_lib.load_config(os.path.join(run_dir, "config.yaml"), [])
    shape = scaling.rollout_shape(cfg)
    return shape["flops_per_token"] / 3.0, shape, cfg


def rl_curve(run, teacher_f):
    """[(step, flops, accuracy, reverse_kl)] of an RL student (step 0: after the warm start)."""
    per_token, prompt_tokens = scaling.step_flops(run)
    distill = forward_flops(run)[2].rl.algo == "distill"
    by_step = {int(r["step"]): r for r in metrics_lib.read_metrics(run)}
    total, flops, rkl = 0.0, {0: 0.0}, {}
    for step in sorted(by_step):
        r = by_step[step]
        if r.get("tokens/response") is not None:
            tokens = prompt_tokens + float(r["tokens/response"])
            total += tokens * (per_token + (teacher_f if distill else 0.0))
            flops[step] = total
        if "distill/reverse_kl" in r:
            rkl[step] = float(r["distill/reverse_kl"])
    summary = read_json(os.path.join(run, "summary.json"))
    points = [(0, 0.0, summary["eval_accuracy_after_sft"], np.nan)]
    for h in summary["eval_history"]:
        if h["phase"] != "sft":
            s = h["step"]
            points.append((s, flops.get(s, total), h["eval/accuracy"], rkl.get(s, np.nan)))
    return points


def sft_curve(runs, start_acc, sample_f):
    """[(steps, flops, accuracy, nan)] of one seed's SFT runs of increasing length (step 0 at the
    FLOPs of the teacher's sampling: paid before the first step)."""
    points = [(0, sample_f["flops"], start_acc, np.nan)]  # the teacher's sampling comes first
    for run in runs:
        n = int(re.search(r"_n(\d+)$", run).group(1))
        f, shape, cfg = forward_flops(run)
        tokens = cfg.sft.batch_size * (shape["prompt_tokens"] + sample_f["mean_len"] + 1)
        flops = sample_f["flops"] + n * 3 * f * tokens
        acc = read_json(os.path.join(run, "summary.json"))["eval_accuracy_final"]
        points.append((n, flops, acc, np.nan))
    return sorted(points)


def stack(curves):
    """[seeds, points, 4] over the steps every seed has."""
    common = sorted(set.intersection(*[{p[0] for p in c} for c in curves]))
    return np.asarray([[next(p for p in c if p[0] == s) for s in common] for c in curves])


def fmt(x, digits=3):
    x = np.asarray(x, float)
    sd = float(np.std(x, ddof=1)) if len(x) > 1 else float("nan")
    return f"{float(np.mean(x)):.{digits}g} +- {sd:.2g}"


def done(root, pattern):
    return sorted(
        r for r in glob.glob(os.path.join(root, pattern)) if os.path.exists(f"{r}/summary.json")
    )


def main(root="runs/distill_long", out="docs/experiments/distill_long"):
    teacher_dir = os.path.join(root, "teacher")
    teacher_acc = read_json(os.path.join(teacher_dir, "summary.json"))["eval_accuracy_final"]
    start = read_json(os.path.join(root, "sft", "summary.json"))["eval_accuracy_final"]
    teacher_f, t_shape, t_cfg = forward_flops(teacher_dir)
    teacher_train = scaling.run_curve(teacher_dir)[0]
    rows = [json.loads(x) for x in open(os.path.join(root, "teacher_samples.jsonl"))]
    counts = read_json(os.path.join(root, "teacher_samples.json"))
    mean_len = statistics.fmean(len(r["response"]) for r in rows) if rows else 0.0
    sample_f = {
        "mean_len": mean_len,
        "flops": teacher_f * counts["completions"] * (t_shape["prompt_tokens"] + mean_len),
    }
    data = {}
    for m in ("opd", "opd_reward", "grpo"):
        runs = done(root, f"{m}_s*")
        if runs:
            data[m] = stack([rl_curve(r, teacher_f) for r in runs])
    seeds = sorted({re.search(r"_s(\d+)_n", p).group(1) for p in done(root, "sft_teacher_s*")})
    sft = []
    for s in seeds:
        grpo = os.path.join(root, f"grpo_s{s}", "summary.json")
        start_s = read_json(grpo)["eval_accuracy_after_sft"] if os.path.exists(grpo) else start
        sft.append(sft_curve(done(root, f"sft_teacher_s{s}_n*"), start_s, sample_f))
    if sft:
        data["sft_teacher"] = stack(sft)

    fig, axes = plt.subplots(1, 3, figsize=(17, 4.4))
    for m, arr in data.items():
        steps, flops, acc = arr[..., 0].mean(0), arr[..., 1].mean(0), arr[..., 2]
        mean = acc.mean(0)
        sd = acc.std(0, ddof=1) if len(acc) > 1 else 0 * mean
        for ax, x in zip(axes[:2], (steps, flops), strict=True):
            ax.plot(x, mean, marker="o", label=f"{METHODS[m]} ({len(acc)} seeds)")
            ax.fill_between(x, mean - sd, mean + sd, alpha=0.2)
        if m.startswith("opd"):
            axes[2].plot(steps[1:], np.nanmean(arr[:, 1:, 3], 0), marker="o", label=METHODS[m])
    for ax, xl in zip(axes[:2], ("student steps", "student FLOPs (teacher's scoring included)")):
        ax.axhline(teacher_acc, color="k", ls="--", lw=1, label=f"teacher {teacher_acc:.3f}")
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out accuracy (avg@4, T=1)")
        ax.grid(alpha=0.3)
    axes[1].set_xlim(left=0)
    axes[2].set_xlabel("student steps")
    axes[2].set_ylabel("training reverse KL to the teacher (k1, per token)")
    axes[2].grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    axes[2].legend(fontsize=8)
    fig.suptitle("Long scratchpad task: students from one SFT warm start, mean +- std over seeds")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)

    print(
        f"teacher {teacher_acc:.4f} (its GRPO: {teacher_train[-1]:.3g} FLOPs), "
        f"warm start {start:.4f}; teacher samples: {counts}, mean kept length {mean_len:.1f}"
    )
    steps = sorted({int(x) for arr in data.values() for x in arr[0, :, 0]})
    print("| method | seeds | " + " | ".join(f"step {s}" for s in steps) + " | FLOPs at the end |")
    print("|---|---|" + "---|" * (len(steps) + 1))
    for m, arr in data.items():
        at = {int(x): i for i, x in enumerate(arr[0, :, 0])}
        cells = [fmt(arr[:, at[s], 2]) if s in at else "-" for s in steps]
        print(f"| {METHODS[m]} | {len(arr)} | " + " | ".join(cells) + f" | {fmt(arr[:, -1, 1])} |")
    if "grpo" in data:
        print_equal_flops(data)
    rkl_dir = os.path.join(root, "rkl")
    if os.path.isdir(rkl_dir):
        print_rkl(rkl_dir)


def at_flops(arr, budget):
    """Each seed's accuracy at ``budget`` FLOPs, linear in FLOPs between its evaluations (None
    more than 2 % past the method's last one: the seeds' token counts differ by about 1 %)."""
    if budget > 1.02 * arr[:, -1, 1].min():
        return None
    return [float(np.interp(budget, a[:, 1], a[:, 2])) for a in arr]


def print_equal_flops(data):
    """Accuracy at equal student compute: at GRPO's FLOPs after each of its evaluations."""
    budgets = [float(x) for x in data["grpo"][:, 1:, 1].mean(0)]
    print()
    print("| method | " + " | ".join(f"{b:.3g} FLOPs" for b in budgets) + " |")
    print("|---|" + "---|" * len(budgets))
    for m, arr in data.items():
        cells = [at_flops(arr, b) for b in budgets]
        print(f"| {METHODS[m]} | " + " | ".join("-" if c is None else fmt(c) for c in cells) + " |")


def print_rkl(rkl_dir):
    """The held-out reverse KL to the teacher, mean +- std over seeds per method (the warm start
    alone)."""
    groups = {}
    for path in sorted(glob.glob(os.path.join(rkl_dir, "*.json"))):
        name = os.path.basename(path)[:-5]
        groups.setdefault(re.sub(r"_s\d+", "", name), []).append(read_json(path))
    print()
    print("| student | seeds | held-out reverse KL per token | per sequence | accuracy | length |")
    print("|---|---|---|---|---|---|")
    for name, rs in groups.items():
        col = lambda k: fmt([r[k] for r in rs])  # noqa: B023, E731
        print(
            f"| {name} | {len(rs)} | {col('reverse_kl_per_token')} | "
            f"{col('reverse_kl_per_sequence')} | {col('accuracy')} | {col('response_length')} |"
        )


if __name__ == "__main__":
    main(*sys.argv[1:])
