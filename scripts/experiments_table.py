"""Result table of the scratchpad experiments (docs/experiments/README.md) from their runs.

Usage: python scripts/experiments_table.py [RUNS_DIR]   (default runs/experiments)

One Markdown row per RL run directory under RUNS_DIR (those with an eval at RL step 0): held-out
accuracy (avg@4) at the start of RL and at its last evaluation, the held-out mean length of the
correct and of the incorrect responses at both points, and the training rollouts' reward and
lengths averaged over the first and the last 10 RL steps ("a -> b").
"""

import os
import sys

import numpy as np

from jaxrlvr import metrics


def _window(records, key, first: bool, n: int = 10) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    part = values[:n] if first else values[-n:]
    return float(np.mean(part)) if part else float("nan")


def _evals(records):
    return [r for r in records if "eval/accuracy" in r]


def row(run_dir: str) -> str | None:
    records = metrics.read_metrics(run_dir)
    train = [r for r in records if "reward_mean" in r]
    evals = _evals(records)
    if not train or len(evals) < 2:
        return None
    e0, e1 = evals[0], evals[-1]

    def ev(r, key):
        v = r.get(key)
        return "-" if v is None else f"{v:.1f}" if "length" in key else f"{v:.3f}"

    def tr(key, fmt):
        return f"{_window(train, key, True):{fmt}} -> {_window(train, key, False):{fmt}}"

    return (
        f"| {os.path.basename(run_dir)} | {len(train)} | {ev(e0, 'eval/accuracy')} -> "
        f"{ev(e1, 'eval/accuracy')} | {ev(e0, 'eval/response_length_correct_mean')} -> "
        f"{ev(e1, 'eval/response_length_correct_mean')} | "
        f"{ev(e0, 'eval/response_length_incorrect_mean')} -> "
        f"{ev(e1, 'eval/response_length_incorrect_mean')} | {tr('reward_mean', '.3f')} | "
        f"{tr('response_length_correct_mean', '.1f')} | "
        f"{tr('response_length_incorrect_mean', '.1f')} |"
    )


def main(runs_dir: str = "runs/experiments") -> int:
    print(
        "| run | RL steps | held-out acc. start -> end | held-out len. correct | "
        "held-out len. incorrect | train reward (first 10 -> last 10 steps) | "
        "train len. correct | train len. incorrect |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name in sorted(os.listdir(runs_dir)):
        path = os.path.join(runs_dir, name)
        if os.path.isfile(os.path.join(path, metrics.METRICS_FILE)):
            line = row(path)
            if line:
                print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
