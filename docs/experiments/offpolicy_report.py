"""Table and plot of the off-policy correction experiment (docs/corrections.md).

Reads ``OUT/seed<S>/<arm>/metrics.jsonl`` (one ``jaxrlvr bench loop`` invocation per seed, one
row per arm) and writes ``OUT/table.md`` and ``OUT/offpolicy.png``: held-out accuracy (avg@4)
over the RL steps, the training reward, and the staleness diagnostics (mismatch KL k3, masked /
truncated token fractions, effective sample size), mean over seeds with the min-max band.

    python docs/experiments/offpolicy_report.py runs/offpolicy [--png docs/experiments/x.png]
"""

import argparse
import json
import pathlib
import statistics

import numpy as np

# k0_control (optional): the same settings with rl.max_staleness=0, no off-policy error.
ARMS = ("none", "token_truncate", "sequence_mask", "icepop", "k0_control")
# bench loop's default row (the config itself, no correction) is named after the system.
DIRS = {"none": "jaxrlvr"}


def _lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def _runs(out: pathlib.Path) -> dict[str, list[list[dict]]]:
    runs: dict[str, list[list[dict]]] = {}
    for seed_dir in sorted(out.glob("seed*")):
        for arm in ARMS:
            run = seed_dir / DIRS.get(arm, arm)
            f = run / "metrics.jsonl"
            if (run / "summary.json").exists():  # finished runs only (STOP_AT may cut one)
                runs.setdefault(arm, []).append(_lines(f))
    return runs


def _series(lines: list[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    pts = [(m["step"], m[key]) for m in lines if key in m]
    return np.array([p[0] for p in pts]), np.array([p[1] for p in pts], float)


def _fmt(xs: list[float], digits: int = 3) -> str:
    if len(xs) == 1:
        return f"{xs[0]:.{digits}f}"
    return f"{statistics.mean(xs):.{digits}f} +- {statistics.stdev(xs):.{digits}f}"


def table(runs: dict[str, list[list[dict]]]) -> str:
    head = (
        "| arm | seeds | held-out acc. start | held-out acc. end | best held-out acc. | "
        "train reward, last 10 steps | staleness k3 | staleness ratio max | "
        "tokens masked | tokens truncated | seqs masked | ESS (staleness) | "
        "weight mean | time/logprobs_s |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )
    rows = [head]
    for arm in ARMS:
        if arm not in runs:
            continue
        per = runs[arm]
        acc = [_series(lines, "eval/accuracy")[1] for lines in per]
        rl = [[m for m in lines if "reward_mean" in m] for lines in per]

        def mean_of(key, rl=rl):
            return [float(np.mean([m[key] for m in r if key in m])) for r in rl]

        cells = [
            arm,
            str(len(per)),
            _fmt([a[0] for a in acc]),
            _fmt([a[-1] for a in acc]),
            _fmt([a.max() for a in acc]),
            _fmt([float(np.mean([m["reward_mean"] for m in r[-10:]])) for r in rl]),
            _fmt(mean_of("offpolicy/staleness/k3"), 4),
            _fmt([max(m["offpolicy/staleness/ratio_max"] for m in r) for r in rl], 2),
            _fmt(mean_of("offpolicy/both/masked"), 4),
            _fmt(mean_of("offpolicy/both/truncated"), 4),
            _fmt(mean_of("offpolicy/both/seq_masked"), 4),
            _fmt(mean_of("offpolicy/staleness/ess"), 4),
            _fmt(mean_of("offpolicy/weight"), 4),
            _fmt([float(np.median([m["time/logprobs_s"] for m in r])) for r in rl], 3),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(runs: dict[str, list[list[dict]]], png: pathlib.Path, suptitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("eval/accuracy", "held-out accuracy (avg@4)", 0.0),
        ("reward_mean", "train reward (EMA 0.8)", 0.8),
        ("offpolicy/staleness/k3", "staleness KL k3 (EMA 0.8)", 0.8),
        ("offpolicy/both/masked", "tokens masked, both sources (EMA 0.8)", 0.8),
        ("offpolicy/both/truncated", "tokens truncated, both sources (EMA 0.8)", 0.8),
        ("offpolicy/staleness/ess", "effective sample size, staleness (EMA 0.8)", 0.8),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for ax, (key, title, ema) in zip(axes.flat, panels):
        for arm in ARMS:
            if arm not in runs:
                continue
            curves = []
            for lines in runs[arm]:
                x, y = _series(lines, key)
                if ema:
                    out, acc = [], y[0]
                    for v in y:
                        acc = ema * acc + (1 - ema) * v
                        out.append(acc)
                    y = np.array(out)
                curves.append((x, y))
            n = min(len(c[1]) for c in curves)
            x = curves[0][0][:n]
            ys = np.stack([c[1][:n] for c in curves])
            (line,) = ax.plot(x, ys.mean(0), label=f"{arm} ({len(curves)} seeds)")
            ax.fill_between(x, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.15)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("RL step")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"{suptitle}: mean over seeds, min-max band")
    fig.tight_layout()
    fig.savefig(png, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=pathlib.Path)
    p.add_argument("--png", type=pathlib.Path, default=None)
    p.add_argument("--title", default="demo task, rl.max_staleness=4 (configs/offpolicy_k4.yaml)")
    args = p.parse_args()
    runs = _runs(args.out)
    text = table(runs)
    (args.out / "table.md").write_text(text + "\n")
    print(text)
    plot(runs, args.png or args.out / "offpolicy.png", args.title)


if __name__ == "__main__":
    main()
