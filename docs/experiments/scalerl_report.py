"""Table and plot of the ScaleRL experiment (docs/experiments/scalerl.md).

Reads ``OUT/grpo_s<S>``, ``OUT/scalerl_s<S>`` and ``OUT/cispo_s<S>`` (finished runs:
``summary.json``), fits ScaleRL's sigmoid (``jaxrlvr.scaling``) to each run's held-out accuracy
against its RL FLOPs, and to each recipe's seeds pooled (every seed's points, R0 the seeds'
mean), and writes ``OUT/scalerl.md`` (the tables, with each recipe paired by seed against GRPO at
equal steps and at equal FLOPs) and the PNG: held-out accuracy over RL steps (mean and min-max
band over seeds) and pass rate against compute with the pooled fits.

    python docs/experiments/scalerl_report.py runs/experiments/scalerl [--png PATH]
"""

import argparse
import json
import pathlib
import statistics

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from jaxrlvr import scaling  # noqa: E402

RECIPES = {"grpo": "demo GRPO", "scalerl": "ScaleRL recipe", "cispo": "CISPO alone"}


def _lines(run: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def _runs(out: pathlib.Path, recipe: str) -> list[pathlib.Path]:
    return sorted(p for p in out.glob(f"{recipe}_s*") if (p / "summary.json").exists())


def _fit(compute, rate, r0):
    try:
        return scaling.fit_sigmoid(compute, rate, r0)
    except (ValueError, RuntimeError) as e:  # curve_fit's "optimal parameters not found"
        print(f"fit failed: {e}")
        return None


def _mean_sd(xs):
    xs = [x for x in xs if x is not None and np.isfinite(x)]
    if not xs:
        return "n/a"
    sd = statistics.stdev(xs) if len(xs) > 1 else float("nan")
    return f"{statistics.mean(xs):.3f} +- {sd:.3f}"


def _count(x) -> str:
    return "-" if np.isnan(x) else f"{x:.0f}"


def _last(lines, key):
    vals = [m[key] for m in lines if key in m]
    return vals[-1] if vals else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    rows, pooled, curves, series = [], {}, [], {}
    for recipe in RECIPES:
        runs = _runs(out, recipe)
        if not runs:
            continue
        all_c, all_r, r0s, fits = [], [], [], []
        series[recipe] = []
        for run in runs:
            c, r, r0 = scaling.run_curve(str(run))
            f = _fit(c, r, r0)
            fits.append(f)
            all_c.extend(c)
            all_r.extend(r)
            r0s.append(r0)
            lines = _lines(run)
            evals = [(m["step"] - 300, m["eval/accuracy"]) for m in lines if "eval/accuracy" in m]
            series[recipe].append(evals)
            rows.append(
                {
                    "recipe": recipe,
                    "run": run.name,
                    "r0": r0,
                    "final": evals[-1][1],
                    "best": max(v for _, v in evals),
                    "rl_flops": float(c[-1]) if len(c) else float("nan"),
                    "fit": f,
                    "retired": _last(lines, "data/retired"),
                    "zero_var": statistics.mean(
                        m["zero_variance_group_fraction"]
                        for m in lines
                        if "zero_variance_group_fraction" in m
                    ),
                }
            )
        f = _fit(np.asarray(all_c), np.asarray(all_r), statistics.mean(r0s))
        pooled[recipe] = (f, len(runs))
        if f is not None:
            curves.append(
                {
                    "label": f"{RECIPES[recipe]} ({len(runs)} seeds pooled)",
                    "compute": np.asarray(all_c),
                    "rate": np.asarray(all_r),
                    "r0": f.r0,
                    "fit": f,
                }
            )

    def fmt(f, attr, p=3):
        if f is None:
            return "fit failed"
        v, se = getattr(f, attr), getattr(f, attr + "_se")
        if attr == "c_mid":
            return f"{v:.{p}g} +- {se:.2g}"
        bound = " (at its bound 1)" if attr == "a" and v > 0.999 else ""
        return f"{v:.{p}f} +- {se:.{p}f}{bound}"

    head = "| run | R0 (after SFT) | final | best | RL FLOPs | A | B | C_mid | retired | zero-var |"
    md = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        f = r["fit"]
        md.append(
            f"| {r['run']} | {r['r0']:.3f} | {r['final']:.3f} | {r['best']:.3f} | "
            f"{r['rl_flops']:.3g} | {fmt(f, 'a')} | {fmt(f, 'b')} | {fmt(f, 'c_mid')} | "
            f"{_count(r['retired'])} | {r['zero_var']:.3f} |"
        )
    md += ["", "| recipe | seeds | final (mean +- sd) | A per seed (mean +- sd) | "
           "B per seed (mean +- sd) | pooled fit |", "|---|---|---|---|---|---|"]  # fmt: skip
    for recipe, (f, n) in pooled.items():
        mine = [r for r in rows if r["recipe"] == recipe]
        md.append(
            f"| {RECIPES[recipe]} | {n} | {_mean_sd([r['final'] for r in mine])} | "
            f"{_mean_sd([r['fit'].a if r['fit'] else None for r in mine])} | "
            f"{_mean_sd([r['fit'].b if r['fit'] else None for r in mine])} | "
            f"{f.describe() if f else 'fit failed'} |"
        )
    # Paired by seed (the same SFT warm start): each other recipe's accuracy at the GRPO run's
    # final step and at the GRPO run's total RL FLOPs (linear in log compute between its points).
    by_run = {r["run"]: r for r in rows}
    for recipe in [x for x in RECIPES if x != "grpo"]:
        paired = []
        for r in rows:
            other = by_run.get(r["run"].replace("grpo", recipe))
            if r["recipe"] != "grpo" or other is None:
                continue
            c, y, _ = scaling.run_curve(str(out / other["run"]))
            at_c = float(np.interp(np.log(r["rl_flops"]), np.log(c), y))
            paired.append((r["run"][-2:], r["final"], other["final"], r["rl_flops"], at_c))
        if not paired:
            continue
        name = RECIPES[recipe]
        md += ["", f"| seed | GRPO final | {name} final (same steps) | GRPO's RL FLOPs | "
               f"{name} at those FLOPs |", "|---|---|---|---|---|"]  # fmt: skip
        for seed, g, sc, flops, at_c in paired:
            md.append(f"| {seed} | {g:.3f} | {sc:.3f} | {flops:.3g} | {at_c:.3f} |")
        d1 = [sc - g for _, g, sc, _, _ in paired]
        d2 = [at - g for _, g, _, _, at in paired]
        md.append(f"| {name} - GRPO | | {_mean_sd(d1)} | | {_mean_sd(d2)} |")
    text = "\n".join(md) + "\n"
    (out / "scalerl.md").write_text(text)
    print(text)

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    for i, (recipe, runs) in enumerate(series.items()):
        steps = np.asarray([s for s, _ in runs[0]])
        n = min(len(r) for r in runs)
        vals = np.asarray([[v for _, v in r[:n]] for r in runs])
        color = f"C{i}"
        ax1.plot(
            steps[:n], vals.mean(0), color=color, label=f"{RECIPES[recipe]} ({len(runs)} seeds)"
        )
        ax1.fill_between(steps[:n], vals.min(0), vals.max(0), color=color, alpha=0.2)
    ax1.set_xlabel("RL step")
    ax1.set_ylabel("held-out accuracy (avg@4, T = 1)")
    ax1.grid(True, alpha=0.3)
    ax1.legend(fontsize="small")
    for i, c in enumerate(curves):
        color = f"C{i}"
        f = c["fit"]
        ax2.plot(c["compute"], c["rate"], "o", color=color, alpha=0.35, ms=3)
        grid = np.geomspace(c["compute"].min(), c["compute"].max() * 100, 200)
        label = f"{c['label']}: A={f.a:.3f}+-{f.a_se:.3f}, B={f.b:.2f}+-{f.b_se:.2f}"
        ax2.plot(
            grid, scaling.sigmoid(grid, f.a, f.b, f.c_mid, f.r0), "--", color=color, label=label
        )
        ax2.axhline(f.a, color=color, linestyle=":", alpha=0.5)
    ax2.set_xscale("log")
    ax2.set_xlabel("RL compute (model FLOPs)")
    ax2.set_ylabel("held-out pass rate")
    ax2.set_title("R0 + (A - R0) / (1 + (C_mid / C)^B)", fontsize="small")
    ax2.grid(True, alpha=0.3)
    ax2.legend(fontsize="x-small", loc="lower right")
    fig.tight_layout()
    png = args.png or str(out / "scalerl.png")
    fig.savefig(png, dpi=100)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
