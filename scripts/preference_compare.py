"""Held-out accuracy of online GRPO against offline preference runs (docs/preference.md).

Usage: python scripts/preference_compare.py OUT_PNG LABEL=RUN_DIR[,RUN_DIR...] [...]

Each LABEL names one method, its run directories are its seeds. The plot draws each method's
mean held-out accuracy over its seeds against the fraction of the run's updates done (GRPO and
the preference runs take different step counts), every seed as a thin line, and the warm start
(each run's step-0 evaluation, the same model evaluated the same way) as a dashed line. Printed:
one Markdown row per method: the warm start, the final accuracy per seed, and their mean and
the mean change from each seed's own warm-start evaluation.
"""

import sys

import numpy as np

from jaxrlvr import metrics


def curve(run_dir: str) -> tuple[np.ndarray, np.ndarray]:
    """(fraction of the updates done, held-out accuracy) at each evaluation of a run."""
    evals = [r for r in metrics.read_metrics(run_dir) if "eval/accuracy" in r]
    steps = np.asarray([r["step"] for r in evals], float)
    return steps / max(steps.max(), 1.0), np.asarray([r["eval/accuracy"] for r in evals])


def main(argv: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out, specs = argv[0], [a.split("=", 1) for a in argv[1:]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    print("| method | seeds | warm start (step 0) | final, per seed | final mean | change |")
    print("|---|---|---|---|---|---|")
    starts = []
    for i, (label, dirs) in enumerate(specs):
        color = f"C{i}"
        curves = [curve(d) for d in dirs.split(",")]
        for x, y in curves:
            ax.plot(x, y, color=color, alpha=0.25, lw=0.8)
        x = curves[0][0]
        ys = np.asarray([y for _, y in curves if len(y) == len(x)])
        ax.plot(x, ys.mean(0), color=color, lw=2, marker="o", ms=3, label=f"{label} ({len(ys)})")
        start, final = ys[:, 0], ys[:, -1]
        starts.extend(start)
        per_seed = " / ".join(f"{v:.3f}" for v in final)
        print(
            f"| {label} | {len(ys)} | {start.mean():.3f} | {per_seed} | {final.mean():.3f} | "
            f"{(final - start).mean():+.3f} |"
        )
    ax.axhline(np.mean(starts), color="gray", ls="--", lw=1, label="warm start")
    ax.set_xlabel("fraction of the run's updates")
    ax.set_ylabel("held-out accuracy (avg@16, T=1)")
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)


if __name__ == "__main__":
    main(sys.argv[1:])
