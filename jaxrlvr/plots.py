"""PNG learning curves from run directories: ``jaxrlvr plot RUN_DIR [RUN_DIR ...]``.

One PNG per metric key (reward, held-out accuracy, response length by default), x = step, with
every run given overlaid for ablations: a faint line of the raw values and a solid line smoothed
by a debiased exponential moving average (TensorBoard's smoothing), labelled with the run
directory's name. Data come from each run's ``metrics.jsonl`` (``jaxrlvr.metrics``); null values
(non-finite when logged) are left out, and a key a run never logged is skipped for that run.

``--pass-k``: the arguments are ``jaxrlvr eval`` reports, whose pass@k curves (and maj@k points)
are overlaid; ``--fit``: ScaleRL's sigmoid fitted to each run's pass rate against RL compute
(``jaxrlvr.scaling``), printed and overlaid (docs/evaluation.md).

Figures are drawn with ``matplotlib.figure.Figure`` and saved through the Agg canvas, never
through pyplot, so this sets no global backend and leaks no figures.
Left out: interactive plots, confidence bands over seeds, and wall-clock x axes.
"""

import argparse
import os
import re
from collections.abc import Sequence

import matplotlib.backends.backend_agg
import matplotlib.figure
import numpy as np

from jaxrlvr import metrics

DEFAULT_KEYS = ("reward_mean", "eval/accuracy", "response_length_mean")


def smooth(values: Sequence[float], weight: float) -> np.ndarray:
    """Debiased EMA: ``s_t = w*s_{t-1} + (1-w)*x_t``, divided by ``1 - w**(t+1)`` (s_{-1} = 0).

    ``weight`` in [0, 1): 0 returns the values unchanged. Debiasing keeps the first points
    from being pulled toward zero.
    """
    if not 0.0 <= weight < 1.0:
        raise ValueError(f"smoothing must be in [0, 1), got {weight}")
    out = np.empty(len(values), dtype=np.float64)
    acc = 0.0
    for t, x in enumerate(values):
        acc = weight * acc + (1.0 - weight) * float(x)
        out[t] = acc / (1.0 - weight ** (t + 1))
    return out


def series(records: Sequence[dict], key: str) -> tuple[np.ndarray, np.ndarray]:
    """``(steps, values)`` of ``key`` sorted by step; null values dropped; for a step logged
    twice (a resumed run that was not truncated) the later line wins."""
    by_step = {}
    for r in records:
        value = r.get(key)
        if value is not None:
            by_step[int(r["step"])] = float(value)
    steps = np.array(sorted(by_step), dtype=np.int64)
    return steps, np.array([by_step[s] for s in steps], dtype=np.float64)


def run_labels(run_dirs: Sequence[str]) -> list[str]:
    """Each run's directory name; the paths as given when two names collide."""
    names = [os.path.basename(os.path.normpath(d)) for d in run_dirs]
    return names if len(set(names)) == len(names) else [os.path.normpath(d) for d in run_dirs]


def make_figure(
    runs: Sequence[tuple[str, Sequence[dict]]], key: str, *, smoothing: float = 0.6
) -> matplotlib.figure.Figure | None:
    """One figure of ``key`` against step for each ``(label, records)`` run; None if no run has it.

    Each plotted run adds two lines to the axes: the raw values (faint, unlabelled) and the
    smoothed ones (labelled, in the legend).
    """
    fig = matplotlib.figure.Figure(figsize=(7, 4.2), dpi=100)
    ax = fig.add_subplot()
    plotted = 0
    for i, (label, records) in enumerate(runs):
        steps, values = series(records, key)
        if len(steps) == 0:
            continue
        color = f"C{i % 10}"
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=1.0)
        ax.plot(steps, smooth(values, smoothing), color=color, linewidth=2.0, label=label)
        plotted += 1
    if not plotted:
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(key)
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return fig


def _file_name(key: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_") + ".png"


def plot_runs(
    run_dirs: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    keys: Sequence[str] = DEFAULT_KEYS,
    *,
    smoothing: float = 0.6,
    labels: Sequence[str] | None = None,
) -> list[str]:
    """Writes ``out_dir/<key>.png`` for each key some run logged; returns the paths written.

    Args:
      run_dirs: run directories, each holding ``metrics.jsonl``; overlaid in this order.
      out_dir: where the PNGs go (created). ``/`` in a key becomes ``_`` in the file name.
      keys: metric keys to plot; a key no run has is skipped (no file).
      smoothing: EMA weight in [0, 1) for the solid line; 0 disables smoothing.
      labels: legend names, one per run (default: :func:`run_labels`).
    """
    run_dirs = [os.fspath(d) for d in run_dirs]
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    if labels is None:
        labels = run_labels(run_dirs)
    if len(labels) != len(run_dirs):
        raise ValueError(f"got {len(labels)} labels for {len(run_dirs)} runs")
    smooth([], smoothing)  # validates the weight before any work
    runs = []
    for d in run_dirs:
        if not os.path.isfile(os.path.join(d, metrics.METRICS_FILE)):
            raise FileNotFoundError(f"no {metrics.METRICS_FILE} in {d}")
        runs.append(metrics.read_metrics(d))
    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for key in keys:
        fig = make_figure(list(zip(labels, runs)), key, smoothing=smoothing)
        if fig is None:
            continue
        path = os.path.join(out_dir, _file_name(key))
        matplotlib.backends.backend_agg.FigureCanvasAgg(fig)
        fig.savefig(path)
        written.append(path)
    return written


def plot_main(argv: Sequence[str]) -> int:
    """``jaxrlvr plot RUN_DIR [RUN_DIR ...] [--out DIR] [--keys k1,k2] [--smoothing W]``."""
    p = argparse.ArgumentParser(
        prog="jaxrlvr plot", description="PNG curves of metrics.jsonl, several runs overlaid."
    )
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="output directory (default: FIRST_RUN/plots)")
    p.add_argument(
        "--keys", default=",".join(DEFAULT_KEYS), help="comma-separated metric keys to plot"
    )
    p.add_argument("--smoothing", type=float, default=0.6, help="EMA weight in [0, 1)")
    fit = p.add_argument_group("compute curves (jaxrlvr.scaling; docs/evaluation.md)")
    fit.add_argument(
        "--fit",
        action="store_true",
        help="fit ScaleRL's sigmoid to each run's pass rate against RL FLOPs; print A, B, C_mid",
    )
    fit.add_argument("--fit-key", default="eval/accuracy", help="the pass-rate metric fitted")
    fit.add_argument(
        "--fit-min-compute", type=float, default=0.0, help="leave out points below these FLOPs"
    )
    p.add_argument(
        "--pass-k",
        action="store_true",
        help="the arguments are jaxrlvr eval reports (JSON): overlay their pass@k curves",
    )
    args = p.parse_args(list(argv))
    if args.pass_k:
        return pass_k_main(args.run_dirs, args.out or ".")
    if args.fit:
        return fit_main(args.run_dirs, args.out, args.fit_key, args.fit_min_compute)
    keys = [k.strip() for k in args.keys.split(",") if k.strip()]
    if not keys:
        raise ValueError("--keys is empty")
    out = args.out or os.path.join(args.run_dirs[0], "plots")
    written = plot_runs(args.run_dirs, out, keys, smoothing=args.smoothing)
    if not written:
        raise ValueError(f"none of the keys {keys} is in any run's {metrics.METRICS_FILE}")
    for path in written:
        print(path)
    return 0


# ----------------------------------------------------------------------------------------------
# pass@k curves (``jaxrlvr eval``'s report; docs/evaluation.md)


def curve_of_report(report: dict, *, label: str) -> dict:
    """A ``write_pass_at_k_plot`` curve from ``jaxrlvr eval``'s JSON report: its pass@k curve
    (k = 1, 2, 4, ..., n) and its maj@k points."""
    agg = report["aggregate"]
    maj = {int(k): (agg[f"eval/maj@{k}"], agg.get(f"eval/maj@{k}_se")) for k in report["maj_k"]}
    curve = report["curve"]
    return {"label": label, "k": curve["k"], "pass": curve["pass"], "se": curve["se"], "maj": maj}


def pass_at_k_figure(curves: Sequence[dict]) -> matplotlib.figure.Figure:
    """pass@k against k (log 2 axis), one line per curve with +-1 standard error bars, and its
    maj@k as hollow markers of the same colour."""
    fig = matplotlib.figure.Figure(figsize=(7, 4.2), dpi=100)
    ax = fig.add_subplot()
    for i, c in enumerate(curves):
        color = f"C{i % 10}"
        se = [0.0 if s is None or not np.isfinite(s) else s for s in c["se"]]
        ax.errorbar(
            c["k"], c["pass"], yerr=se, color=color, marker="o", capsize=3, label=c["label"]
        )
        if c.get("maj"):
            ks = sorted(c["maj"])
            ax.plot(
                ks,
                [c["maj"][k][0] for k in ks],
                linestyle="none",
                marker="s",
                markerfacecolor="none",
                color=color,
                label=f"{c['label']} maj@k",
            )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples)")
    ax.set_ylabel("pass@k (unbiased)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_title("pass@k")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return fig


def save(fig: matplotlib.figure.Figure, path: str) -> str:
    """Saves ``fig`` through the Agg canvas (no pyplot) to ``path`` (its folder created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    matplotlib.backends.backend_agg.FigureCanvasAgg(fig)
    fig.savefig(path)
    return path


def write_pass_at_k_plot(path: str, curves: Sequence[dict]) -> str:
    """Writes the pass@k figure of ``curves`` (``curve_of_report``) to ``path``."""
    return save(pass_at_k_figure(curves), path)


def fit_main(run_dirs: Sequence[str], out: str | None, key: str, min_compute: float) -> int:
    """``jaxrlvr plot RUN_DIR ... --fit``: prints each run's fitted A, B, C_mid (+- standard
    errors) and writes ``OUT/fit_<key>.png`` with the runs and their fits overlaid."""
    from jaxrlvr import scaling

    curves = []
    for label, d in zip(run_labels(run_dirs), run_dirs):
        compute, rate, r0 = scaling.run_curve(d, key, min_compute=min_compute)
        fit = scaling.fit_sigmoid(compute, rate, r0)
        print(f"{label}: {fit.describe()}")
        curves.append({"label": label, "compute": compute, "rate": rate, "r0": r0, "fit": fit})
    out = out or os.path.join(run_dirs[0], "plots")
    print(save(scaling.fit_figure(curves), os.path.join(out, "fit_" + _file_name(key))))
    return 0


def pass_k_main(reports: Sequence[str], out: str) -> int:
    """``jaxrlvr plot REPORT.json ... --pass-k``: the reports' pass@k curves overlaid in
    ``OUT/pass_at_k.png``, each labelled with its file name."""
    import json

    curves = []
    for path in reports:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no eval report {path}")
        with open(path) as f:
            report = json.load(f)
        label = os.path.splitext(os.path.basename(path))[0]
        curves.append(curve_of_report(report, label=label))
    print(write_pass_at_k_plot(os.path.join(out, "pass_at_k.png"), curves))
    return 0
