"""Tables and plots of the off-policy routing-replay experiment (issue 48 item 4;
docs/experiments/replay_offpolicy_run.sh, docs/experiments/replay_offpolicy.md).

Usage: python scripts/replay_offpolicy_report.py [RUNS_DIR] [OUT_PREFIX] [FULL_EVERY]
Reads RUNS_DIR/{grpo,grpo_tis,grpo_r3,grpo_r3_tis,gspo}_s*/metrics.jsonl and summary.json
(reusing scripts/routing_replay_report.py's readers); writes OUT_PREFIX.png (curves, mean over
seeds) and prints two markdown tables (per-run means over the RL steps, then mean ± std over
seeds).

Which rows a metric comes from (``passes.routing_replay``): on the "full" steps (every
FULL_EVERY-th, the first included) ``routing/*`` come from two extra forwards under the
parameters the step starts from (= the sampler's weights: the engine gap alone) and carry
``routing/k3_live`` / ``routing/k3_replay``; on the other steps of an arm without replay they
come from the update's own last-epoch forward (the engine gap plus the drift of the epochs
before it), and an arm with replay reports none there (its routes are forced).
"""

import glob
import json
import os
import sys
import warnings

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from routing_replay_report import ms, rl_rows, series  # noqa: E402

ARMS = {
    "grpo": "GRPO",
    "grpo_tis": "GRPO + TIS",
    "grpo_r3": "GRPO + R3",
    "grpo_r3_tis": "GRPO + R3 + TIS",
    "gspo": "GSPO",
}


def load(run: str):
    rows = rl_rows(run)
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    hist = [(h["step"], h["eval/accuracy"]) for h in summary["eval_history"]]
    if "eval_accuracy_after_sft" in summary and (not hist or hist[0][0] > 0):
        hist.insert(0, (0, summary["eval_accuracy_after_sft"]))
    return rows, summary, hist


def run_stats(rows, summary, full_every: int) -> dict:
    """One run's per-step means of every reported quantity."""
    steps = series(rows, "step")
    full = (steps - 1) % full_every == 0
    m = lambda key, sel=None: np.nanmean(
        series(rows, key)[sel] if sel is not None else series(rows, key)
    )  # noqa: E731
    return {
        "disagree_start": m("routing/disagree", full),
        "token_disagree_start": m("routing/token_disagree", full),
        "disagree_epochs": m("routing/disagree", ~full) if (~full).any() else np.nan,
        "token_disagree_epochs": m("routing/token_disagree", ~full) if (~full).any() else np.nan,
        "k3_live": m("routing/k3_live", full),
        "k3_replay": m("routing/k3_replay", full),
        "k3_tis": m("offpolicy/both/k3"),
        "truncated": m("offpolicy/both/truncated"),
        "ratio_max": m("offpolicy/both/ratio_max"),
        "clip_frac": m("clip_frac"),
        "clip_frac_late": np.nanmean(series(rows, "clip_frac")[len(rows) // 2 :]),
        "grad_norm": m("grad_norm"),
        "reward_last10": np.nanmean(series(rows, "reward_mean")[-10:]),
        "acc_start": summary.get("eval_accuracy_after_sft", np.nan),
        "acc_final": summary["eval_accuracy_final"],
    }


def main(root="runs/replay_offpolicy", out="docs/experiments/replay_offpolicy", full_every="5"):
    full_every = int(full_every)
    warnings.simplefilter("ignore", RuntimeWarning)  # NaN means of metrics an arm never reports
    fig, axes = plt.subplots(2, 3, figsize=(17, 8.5))
    ax = axes.ravel()
    table1, table2 = [], []
    for arm, label in ARMS.items():
        runs = sorted(glob.glob(os.path.join(root, f"{arm}_s*")))
        done = [r for r in runs if os.path.exists(os.path.join(r, "summary.json"))]
        if not done:
            continue
        loaded = [load(r) for r in done]
        stats = [run_stats(rows, s, full_every) for rows, s, _ in loaded]
        col = {k: [s[k] for s in stats] for k in stats[0]}
        n = len(done)

        def cell(key, col=col):
            return "forced" if np.all(np.isnan(col[key])) else ms(col[key])

        table1.append(
            f"| {label} | {n} | {ms(col['disagree_start'])} | {ms(col['token_disagree_start'])} | "
            f"{cell('disagree_epochs')} | {cell('token_disagree_epochs')} | "
            f"{ms(col['k3_live'])} | {ms(col['k3_replay'])} | {ms(col['k3_tis'])} |"
        )
        table2.append(
            f"| {label} | {n} | {ms(col['clip_frac'])} | {ms(col['clip_frac_late'])} | "
            f"{ms(col['truncated']) if arm.endswith('tis') else '-'} | {ms(col['ratio_max'])} | "
            f"{ms(col['grad_norm'])} | {ms(col['reward_last10'])} | "
            f"{ms(col['acc_start'])} | {ms(col['acc_final'])} |"
        )
        k = min(len(rows) for rows, _, _ in loaded)
        steps = np.arange(1, k + 1)
        full = (steps - 1) % full_every == 0

        def mean(key, loaded=loaded, k=k):
            return np.nanmean(np.stack([series(rows[:k], key) for rows, _, _ in loaded]), 0)

        (line,) = ax[0].plot(
            steps[full], mean("routing/token_disagree")[full], "o-", label=f"{label}: step start"
        )
        if not np.all(np.isnan(mean("routing/token_disagree")[~full])):
            ax[0].plot(
                steps[~full],
                mean("routing/token_disagree")[~full],
                ".",
                color=line.get_color(),
                alpha=0.6,
                label=f"{label}: last epoch",
            )
        ax[1].plot(
            steps[full],
            mean("routing/k3_live")[full],
            "o-",
            color=line.get_color(),
            label=f"{label}: no replay",
        )
        ax[1].plot(
            steps[full],
            mean("routing/k3_replay")[full],
            "x--",
            color=line.get_color(),
            label=f"{label}: replay",
        )
        ax[2].plot(steps, mean("clip_frac"), color=line.get_color(), label=label)
        ax[3].plot(steps, mean("grad_norm"), color=line.get_color(), label=label)
        ax[4].plot(steps, mean("reward_mean"), color=line.get_color(), label=label)
        m = min(len(h) for _, _, h in loaded)
        acc = np.array([[a for _, a in h[:m]] for _, _, h in loaded])
        xs = [s for s, _ in loaded[0][2][:m]]
        ax[5].errorbar(
            xs,
            acc.mean(0),
            yerr=acc.std(0),
            fmt="o-",
            capsize=3,
            color=line.get_color(),
            label=label,
        )
    print(
        "| arm | seeds | disagree (token, layer), step start | tokens differing, step start | "
        "disagree (token, layer), last epoch | tokens differing, last epoch | "
        "k3 no replay | k3 replay | k3 of old / sampler |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table1))
    print()
    print(
        "| arm | seeds | clip fraction | clip fraction, 2nd half | TIS truncated | "
        "max old / sampler | grad norm | reward, last 10 steps | held-out, start | "
        "held-out, final |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(table2))
    titles = (
        "tokens whose top-2 set differs in any layer (sampler bf16 vs trainer fp32)",
        "k3 of KL(sampler || trainer), step start",
        "clip fraction (last epoch)",
        "gradient norm (last epoch, before clipping)",
        "train reward",
        "held-out accuracy (mean ± std over seeds)",
    )
    for a, t in zip(ax, titles):
        a.set_title(t, fontsize=9)
        a.set_xlabel("RL step")
        a.legend(fontsize=6)
    ax[1].set_yscale("log")
    ax[2].set_yscale("symlog", linthresh=0.01)  # GSPO's sequence clip sits at ~0.5, GRPO's at ~0.04
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=100)


if __name__ == "__main__":
    main(*sys.argv[1:])
