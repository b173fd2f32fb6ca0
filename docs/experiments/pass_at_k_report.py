"""Table and plot of the pass@k experiment (docs/experiments/pass_at_k.md).

Reads the ``jaxrlvr eval`` reports ``OUT/passk_s<S>/{sft,grpo,distill}.json`` (256 samples per
problem on the demo's held-out problems) and writes ``OUT/pass_at_k.md`` and the PNG: pass@k for
k = 1..256 of each policy (mean over seeds, min-max band), the difference to the SFT warm start,
and the problems each policy never solves in 256 samples (the coverage Yue et al. measure).

    python docs/experiments/pass_at_k_report.py runs/experiments/scalerl [--png PATH]
"""

import argparse
import json
import pathlib
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

POLICIES = {"sft": "SFT warm start", "grpo": "GRPO", "distill": "distillation student"}


def _ms(xs):
    if len(xs) == 1:
        return f"{xs[0]:.3f}"
    return f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs):.3f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    reports: dict[str, dict[int, dict]] = {p: {} for p in POLICIES}
    for d in sorted(out.glob("passk_s*")):
        seed = int(d.name.removeprefix("passk_s"))
        for p in POLICIES:
            f = d / f"{p}.json"
            if f.exists():
                reports[p][seed] = json.loads(f.read_text())
    reports = {p: r for p, r in reports.items() if r}
    ks = next(iter(next(iter(reports.values())).values()))["pass_k"]
    md = ["| policy | seeds | " + " | ".join(f"pass@{k}" for k in ks)
          + " | maj@8 | unsolved in 256 |", "|---|---|" + "---|" * (len(ks) + 2)]  # fmt: skip
    curves = {}
    for p, by_seed in reports.items():
        cells = []
        mat = np.asarray([[r["aggregate"][f"eval/pass@{k}"] for k in ks] for r in by_seed.values()])
        curves[p] = mat
        for j in range(len(ks)):
            cells.append(_ms(list(mat[:, j])))
        maj = [r["aggregate"]["eval/maj@8"] for r in by_seed.values()]
        unsolved = [sum(q["correct"] == 0 for q in r["problems"]) for r in by_seed.values()]
        md.append(
            f"| {POLICIES[p]} | {','.join(map(str, by_seed))} | " + " | ".join(cells)
            + f" | {_ms(maj)} | {'/'.join(map(str, unsolved))} |"
        )  # fmt: skip
    # Per seed: pass@k of each RL policy minus the SFT warm start it started from.
    if "sft" in reports:
        md += ["", "| difference to SFT (same seed) | " + " | ".join(f"k={k}" for k in ks) + " |",
               "|---|" + "---|" * len(ks)]  # fmt: skip
        for p in reports:
            if p == "sft":
                continue
            seeds = sorted(set(reports[p]) & set(reports["sft"]))
            diffs = np.asarray(
                [
                    [
                        reports[p][s]["aggregate"][f"eval/pass@{k}"]
                        - reports["sft"][s]["aggregate"][f"eval/pass@{k}"]
                        for k in ks
                    ]
                    for s in seeds
                ]
            )
            md.append(
                f"| {POLICIES[p]} - SFT ({len(seeds)} seeds) | "
                + " | ".join(f"{_ms(list(diffs[:, j]))}" for j in range(len(ks)))
                + " |"
            )
        # Narrowing per problem: problems whose success count (of 256) RL lowered, and the
        # hardest problem's count (a policy that narrows loses its rare successes there first).
        md += ["", "| policy | problems RL made worse (c < SFT's c) | hardest problem's c (min) |",
               "|---|---|---|"]  # fmt: skip
        for p in reports:
            seeds = sorted(set(reports[p]) & set(reports["sft"]))
            worse = [
                sum(
                    a["correct"] < b["correct"]
                    for a, b in zip(reports[p][s]["problems"], reports["sft"][s]["problems"])
                )
                for s in seeds
            ]
            hardest = [min(q["correct"] for q in reports[p][s]["problems"]) for s in seeds]
            md.append(
                f"| {POLICIES[p]} | "
                + ("-" if p == "sft" else "/".join(map(str, worse)))
                + f" | {'/'.join(map(str, hardest))} |"
            )
    text = "\n".join(md) + "\n"
    (out / "pass_at_k.md").write_text(text)
    print(text)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (p, mat) in enumerate(curves.items()):
        color = f"C{i}"
        label = f"{POLICIES[p]} ({mat.shape[0]} seeds)"
        ax1.plot(ks, mat.mean(0), "o-", color=color, label=label, ms=3)
        ax1.fill_between(ks, mat.min(0), mat.max(0), color=color, alpha=0.2)
        if p != "sft" and "sft" in curves:
            n = min(mat.shape[0], curves["sft"].shape[0])
            d = mat[:n] - curves["sft"][:n]
            ax2.plot(ks, d.mean(0), "o-", color=color, label=f"{POLICIES[p]} - SFT", ms=3)
            ax2.fill_between(ks, d.min(0), d.max(0), color=color, alpha=0.2)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("k")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    ax1.set_ylabel("pass@k (100 held-out problems, T = 1)")
    ax2.axhline(0.0, color="k", lw=0.8)
    ax2.set_ylabel("pass@k minus the SFT warm start's")
    fig.tight_layout()
    png = args.png or str(out / "pass_at_k.png")
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
