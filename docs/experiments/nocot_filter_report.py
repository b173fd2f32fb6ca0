"""Tables and plot of the no-CoT filter experiment (docs/experiments/nocot_filter.md).

Reads what docs/experiments/nocot_filter_run.sh wrote under OUT: the training pool and what the
filter dropped from it (``pool/``, ``filtered/``), the same filter's labels of the held-out split
(``held_filter/``), each GRPO run's ``metrics.jsonl`` and its final per-problem held-out report
(``runs/<arm>_s<seed>/eval_held_out.json``, and ``runs/warm_start_eval.json``). Prints markdown
tables (which problems the filter drops, by the number of operations and the answer's size; the
held-out accuracy per run, split into dropped-like and kept-like problems; mean +- sd per arm and
the paired differences per seed) and writes ``nocot_filter.png`` (held-out accuracy over the GRPO
steps per arm, and the final accuracy by split). The arms: ``unfiltered`` (the whole pool),
``filtered`` (what the no-CoT filter keeps), ``random`` (as many problems drawn at random).

    python docs/experiments/nocot_filter_report.py runs/nocot --out docs/experiments
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import statistics

ARMS = ("unfiltered", "filtered", "random")
# The paired differences reported (same seed): (arm, minus arm).
PAIRS = (("filtered", "unfiltered"), ("random", "unfiltered"), ("filtered", "random"))


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def ops(question: str) -> int:
    """The number of additions and subtractions in a scratchpad question."""
    return len(re.findall(r"[+-]", question))


def shortcut(question: str) -> str:
    """Whether a question has a step that needs no arithmetic: an operand 0, or a number taken
    away right after it was added or started with ("8 - 8", "+ 4 - 4")."""
    nums = [int(x) for x in re.findall(r"\d+", question)]
    signs = ["+"] + re.findall(r"[+-]", question)
    zero = any(n == 0 for n in nums)
    cancel = any(nums[i] == nums[i + 1] and signs[i] != signs[i + 1] for i in range(len(nums) - 1))
    return "zero or cancelling pair" if zero or cancel else "neither"


def answer_bin(answer: str) -> str:
    a = int(answer)
    return "0-9" if a < 10 else "10-19" if a < 20 else "20-30"


def share_table(pool, dropped_ids, key, title):
    total, drop = collections.Counter(), collections.Counter()
    for r in pool:
        k = key(r)
        total[k] += 1
        drop[k] += r["id"] in dropped_ids
    lines = [f"| {title} | problems | dropped | share dropped |", "|---|---|---|---|"]
    for k in sorted(total):
        lines.append(f"| {k} | {total[k]} | {drop[k]} | {drop[k] / total[k]:.2f} |")
    n, d = sum(total.values()), sum(drop.values())
    lines.append(f"| all | {n} | {d} | {d / n:.2f} |")
    return "\n".join(lines)


def split_accuracy(report_path, dropped_like):
    """(all, dropped-like, kept-like) avg@n of one per-problem eval report."""
    rows = json.load(open(report_path))["problems"]
    n = len(rows[0]["answer_rewards"])

    def acc(rs):
        return sum(r["correct"] for r in rs) / (n * len(rs)) if rs else float("nan")

    return (
        acc(rows),
        acc([r for r in rows if r["id"] in dropped_like]),
        acc([r for r in rows if r["id"] not in dropped_like]),
    )


def mean_sd(xs):
    return f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs) if len(xs) > 1 else 0.0:.3f}"


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("root", help="OUT of nocot_filter_run.sh (e.g. runs/nocot)")
    p.add_argument("--out", default=None, help="folder for nocot_filter.png (default: ROOT)")
    args = p.parse_args()
    root = args.root
    pool = read_jsonl(f"{root}/pool/scratchpad.jsonl")
    dropped = [r for r in read_jsonl(f"{root}/filtered/dropped.jsonl") if r["step"] == "no_cot"]
    dropped_ids = {r["id"] for r in dropped}
    held = read_jsonl(f"{root}/pool/scratchpad_held_out.jsonl")
    held_drop = {r["id"] for r in read_jsonl(f"{root}/held_filter/dropped.jsonl")}

    print("## Which problems the filter drops (training pool)\n")
    print(share_table(pool, dropped_ids, lambda r: ops(r["problem"]), "operations"))
    print()
    print(share_table(pool, dropped_ids, lambda r: answer_bin(r["answer"]), "answer"))
    print()
    print(share_table(pool, dropped_ids, lambda r: shortcut(r["problem"]), "a trivial step"))
    print()
    total = collections.Counter(int(r["answer"]) for r in pool)
    drop = collections.Counter(int(r["answer"]) for r in pool if r["id"] in dropped_ids)
    print(
        "Share dropped by answer value (share of the pool in brackets): "
        + ", ".join(
            f"{a}: {drop[a] / total[a]:.2f} ({total[a] / len(pool):.3f})" for a in sorted(total)
        )
    )
    print()
    rates = collections.Counter(r["detail"] for r in dropped)
    print(
        "No-CoT pass rate of the dropped problems: "
        + ", ".join(
            f"{k.removeprefix('solved in ').split(' of')[0]}: {v}" for k, v in sorted(rates.items())
        )
    )
    by_id = {r["id"]: r for r in pool}
    print(
        "Examples: "
        + "; ".join(
            f"`{by_id[i]['problem']} {by_id[i]['answer']}`" for i in sorted(dropped_ids)[:6]
        )
    )
    print(
        f"\nHeld-out split: {len(held)} problems, {len(held_drop)} dropped-like "
        f"({len(held_drop) / len(held):.2f}), {len(held) - len(held_drop)} kept-like.\n"
    )

    print("## Held-out accuracy after GRPO (avg@n, final checkpoint)\n")
    print(
        "| run | seed | all | dropped-like | kept-like | eval curve (steps 0, 10, ...) |"
        " zero-variance groups | train reward first 5 -> last 5 | eval length start -> end |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    warm = split_accuracy(f"{root}/runs/warm_start_eval.json", held_drop)
    print(f"| warm start | - | {warm[0]:.3f} | {warm[1]:.3f} | {warm[2]:.3f} | | | | |")
    results = {arm: {} for arm in ARMS}
    curves = {arm: {} for arm in ARMS}
    for arm in ARMS:
        for run in sorted(glob.glob(f"{root}/runs/{arm}_s*/")):
            seed = int(run.rstrip("/").rsplit("_s", 1)[1])
            report = f"{run}eval_held_out.json"
            if not os.path.exists(report):
                continue
            acc = split_accuracy(report, held_drop)
            recs = read_jsonl(f"{run}metrics.jsonl")
            ev = [(r["step"], r["eval/accuracy"]) for r in recs if "eval/accuracy" in r]
            rl = [r for r in recs if "reward_mean" in r]
            lens = [r["eval/response_length_mean"] for r in recs if "eval/accuracy" in r]
            zv = statistics.mean(r.get("zero_variance_group_fraction", float("nan")) for r in rl)
            rew = [r["reward_mean"] for r in rl]
            results[arm][seed] = acc
            curves[arm][seed] = ev
            curve = " ".join(f"{a:.2f}" for _, a in ev)
            print(
                f"| {arm} | {seed} | {acc[0]:.3f} | {acc[1]:.3f} | {acc[2]:.3f} | {curve} | "
                f"{zv:.2f} | {statistics.mean(rew[:5]):.3f} -> {statistics.mean(rew[-5:]):.3f} | "
                f"{lens[0]:.1f} -> {lens[-1]:.1f} |"
            )
    for arm in ARMS:
        vals = list(results[arm].values())
        if vals:
            cols = " | ".join(mean_sd([v[i] for v in vals]) for i in range(3))
            print(f"| **{arm}**, mean +- sd | | {cols} | | | | |")
    for a, b in PAIRS:
        seeds = sorted(set(results[a]) & set(results[b]))
        if not seeds:
            continue
        cols = []
        for i in range(3):
            d = [results[a][s][i] - results[b][s][i] for s in seeds]
            cols.append(f"{mean_sd(d)} ({', '.join(f'{x:+.3f}' for x in d)})")
        print(f"| {a} - {b}, same seed | | {' | '.join(cols)} | | | | |")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    colors = {"unfiltered": "tab:blue", "filtered": "tab:orange", "random": "tab:green"}
    for arm in ARMS:
        runs = list(curves[arm].values())
        for ev in runs:
            a1.plot([s for s, _ in ev], [a for _, a in ev], color=colors[arm], alpha=0.3, lw=1)
        if runs:
            steps = [s for s, _ in runs[0]]
            mean = [statistics.mean(ev[i][1] for ev in runs) for i in range(len(steps))]
            a1.plot(steps, mean, color=colors[arm], lw=2.5, label=f"{arm} (mean of {len(runs)})")
    a1.set_xlabel("GRPO step")
    a1.set_ylabel("held-out accuracy (avg@4, first 100)")
    a1.legend()
    a1.set_title("held-out accuracy during GRPO")
    labels = ["all", "dropped-like", "kept-like"]
    groups = [("warm start", [warm])] + [
        (arm, list(results[arm].values())) for arm in ARMS if results[arm]
    ]
    width = 0.8 / len(groups)
    for j, (name, vals) in enumerate(groups):
        means = [statistics.mean(v[i] for v in vals) for i in range(3)]
        xs = [i + (j - (len(groups) - 1) / 2) * width for i in range(3)]
        a2.bar(xs, means, width, label=name, color=colors.get(name, "tab:gray"))
        for i, x in enumerate(xs):
            a2.scatter([x] * len(vals), [v[i] for v in vals], color="k", s=8, zorder=3)
    a2.set_xticks(range(3), labels)
    a2.set_ylabel(f"held-out accuracy (avg@4, {len(held)} problems)")
    a2.set_ylim(0, 1)
    a2.legend()
    a2.set_title("final accuracy by the filter's label")
    fig.tight_layout()
    out = os.path.join(args.out or root, "nocot_filter.png")
    fig.savefig(out, dpi=110)
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
