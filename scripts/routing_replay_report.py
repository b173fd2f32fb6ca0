"""Plot and table of the routing-replay experiment (scripts/routing_replay_experiment.sh).

Usage: python scripts/routing_replay_report.py [RUNS_DIR] [OUT_PREFIX]
Reads RUNS_DIR/{grpo,grpo_r3,gspo}_s*/metrics.jsonl and summary.json; writes OUT_PREFIX.png
(routing disagreement, k3 gaps, reward and held-out accuracy against RL steps, mean over seeds)
and prints a markdown table (mean +- std over seeds).
"""

import glob
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

VARIANTS = {"grpo": "GRPO, no replay", "grpo_r3": "GRPO + R3", "gspo": "GSPO, no replay"}


def rl_rows(run: str) -> list[dict]:
    """The RL update rows of a run's metrics.jsonl (one per step; eval-only rows left out)."""
    with open(os.path.join(run, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if "loss" in r]


def series(rows, key):
    """``key`` of every row as float, NaN where a row lacks it."""
    return np.asarray([r.get(key, np.nan) for r in rows], float)


def ms(x):
    """'mean ± std' of ``x`` (NaN-aware)."""
    x = np.asarray(x, float)
    return f"{np.nanmean(x):.4g} ± {np.nanstd(x):.2g}"


def main(root="runs/routing_replay", out="docs/experiments/routing_replay"):
    runs = {v: sorted(glob.glob(os.path.join(root, f"{v}_s*"))) for v in VARIANTS}
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    print(
        "| variant | seeds | disagree (token, layer) | tokens differing in any layer | "
        "k3 no replay | k3 replay | reward, last 10 steps | held-out accuracy |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for v, label in VARIANTS.items():
        done = [r for r in runs[v] if os.path.exists(os.path.join(r, "summary.json"))]
        if not done:
            continue
        per = [rl_rows(r) for r in done]
        n = min(len(p) for p in per)
        stat = {}
        for key in (
            "routing/disagree",
            "routing/token_disagree",
            "routing/k3_live",
            "routing/k3_replay",
            "reward_mean",
        ):
            stat[key] = np.stack([series(p[:n], key) for p in per])
        acc = []
        for r in done:
            with open(os.path.join(r, "summary.json")) as f:
                acc.append(json.load(f)["eval_accuracy_final"])
        steps = np.arange(1, n + 1)
        axes[0].plot(steps, stat["routing/token_disagree"].mean(0), label=f"{label}: any layer")
        axes[0].plot(steps, stat["routing/disagree"].mean(0), "--", label=f"{label}: per layer")
        axes[1].plot(steps, stat["routing/k3_live"].mean(0), label=f"{label}: no replay")
        axes[1].plot(steps, stat["routing/k3_replay"].mean(0), "--", label=f"{label}: replay")
        axes[2].plot(steps, stat["reward_mean"].mean(0), label=label)
        hist = []
        for r in done:
            with open(os.path.join(r, "summary.json")) as f:
                hist.append([(h["step"], h["eval/accuracy"]) for h in json.load(f)["eval_history"]])
        m = min(len(h) for h in hist)
        axes[3].plot(
            [s for s, _ in hist[0][:m]],
            np.mean([[a for _, a in h[:m]] for h in hist], 0),
            "o-",
            label=label,
        )

        print(
            f"| {label} | {len(done)} | {ms(np.nanmean(stat['routing/disagree'], 1))} | "
            f"{ms(np.nanmean(stat['routing/token_disagree'], 1))} | "
            f"{ms(np.nanmean(stat['routing/k3_live'], 1))} | "
            f"{ms(np.nanmean(stat['routing/k3_replay'], 1))} | "
            f"{ms(np.nanmean(stat['reward_mean'][:, -10:], 1))} | {ms(acc)} |"
        )
    titles = (
        "routing disagreement, sampler (bf16) vs trainer (fp32)",
        "k3 of KL(sampler || trainer)",
        "train reward",
        "held-out accuracy (eval step)",
    )
    for ax, t in zip(axes, titles):
        ax.set_title(t, fontsize=9)
        ax.set_xlabel("RL step")
        ax.legend(fontsize=6)
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:])
