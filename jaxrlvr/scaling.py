"""Compute-performance curves: ScaleRL's sigmoid fitted to a run's held-out pass rate.

ScaleRL (Khatri et al. 2025, arXiv 2510.13786) compares RL recipes by the curve

    R(C) = R0 + (A - R0) / (1 + (C_mid / C)^B)

of validation pass rate R against training compute C: A is the asymptote (the pass rate the
recipe tends to), B the efficiency (how steeply it gets there), C_mid the compute at which half of
the gain A - R0 is reached, R0 the pass rate at the start of RL.

``fit_sigmoid`` fits A, B and C_mid by least squares (scipy's ``curve_fit``, in log C_mid) with R0
held at the given start value, and reports each parameter's standard error from the fit's
covariance (C_mid's by the delta method from log C_mid's). ``run_curve`` reads one run
directory's points:

- R: each evaluation's ``eval/accuracy`` (or another key, e.g. ``eval/pass@1``) in
  ``metrics.jsonl``; R0 is the evaluation at RL compute 0 (after the SFT warm start, or the
  run's first), which the fit holds fixed and leaves out of the fit's points.
- C: the RL phase's cumulative model FLOPs from the bench formula
  (``ModelConfig.flops_per_token`` through ``rollout_shape``, which ``bench loop``'s
  ``update_gflop`` uses too, on the run's own config.yaml). Per RL step, with ``P`` the mean
  rendered prompt tokens of the run's training problems, ``rollouts = rl.prompts_per_step x
  rl.group_size`` and ``R_t`` the step's logged ``tokens/response``: the sampler costs one
  forward pass over its tokens, ``forward(P + max_tokens) x (rollouts x P + R_t)``, and the
  update three (forward and backward) per epoch, ``3 x forward(...) x (rollouts x P + R_t) x
  rl.epochs_per_step``. Left out: the SFT warm start, the old / reference log-prob forwards of
  ``prepare``, the evaluations, shared prompts counted once (each rollout is counted with its
  own prompt), and tokens a filter drops.

Left out: fitting R0, and ScaleRL's exclusion of the early compute (pass ``min_compute``).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import warnings
from collections.abc import Sequence

import numpy as np

from jaxrlvr import metrics as metrics_lib


def sigmoid(compute, a: float, b: float, c_mid: float, r0: float):
    """ScaleRL's R(C) (the module docstring); ``compute`` > 0 (an array or a float)."""
    c = np.asarray(compute, dtype=np.float64)
    return r0 + (a - r0) / (1.0 + (c_mid / c) ** b)


@dataclasses.dataclass(frozen=True)
class SigmoidFit:
    """Fitted A, B, C_mid with their standard errors (NaN when the covariance is not finite:
    too few points, or a parameter the points do not determine), R0 as held, and the points."""

    a: float
    b: float
    c_mid: float
    a_se: float
    b_se: float
    c_mid_se: float
    r0: float
    points: int

    def describe(self) -> str:
        return (
            f"A = {self.a:.4f} +- {self.a_se:.4f}, B = {self.b:.3f} +- {self.b_se:.3f}, "
            f"C_mid = {self.c_mid:.4g} +- {self.c_mid_se:.2g} FLOPs (R0 = {self.r0:.4f}, "
            f"{self.points} points)"
        )


def fit_sigmoid(compute: Sequence[float], rate: Sequence[float], r0: float) -> SigmoidFit:
    """Least-squares fit of A, B, C_mid to points (``compute`` > 0, ``rate``), R0 held.

    Raises:
      ValueError: fewer than 3 points, or a compute value <= 0 (one line).
      ImportError: scipy is not installed (one line naming it).
    """
    c = np.asarray(compute, dtype=np.float64)
    y = np.asarray(rate, dtype=np.float64)
    if c.shape != y.shape or c.ndim != 1:
        raise ValueError(f"fit_sigmoid: {c.shape} compute values for {y.shape} pass rates")
    if c.size < 3:
        raise ValueError(f"fit_sigmoid needs at least 3 points past compute 0, got {c.size}")
    if (c <= 0).any():
        raise ValueError("fit_sigmoid: compute values must be > 0 (the start point is R0)")
    try:
        from scipy import optimize
    except ImportError:
        raise ImportError("jaxrlvr plot --fit needs scipy (pip install scipy)") from None
    log_c = np.log(c)

    def model(cc, a, b, log_mid):
        return sigmoid(cc, a, b, np.exp(log_mid), r0)

    lo, hi = log_c.min() - 10.0, log_c.max() + 10.0
    p0 = (float(np.clip(y.max(), 0.0, 1.0)), 1.0, float(np.median(log_c)))
    with warnings.catch_warnings():
        # Points that do not determine a parameter (a flat curve): its SE is reported as NaN.
        warnings.simplefilter("ignore", optimize.OptimizeWarning)
        params, cov = optimize.curve_fit(
            model,
            c,
            y,
            p0=p0,
            bounds=([0.0, 1e-3, lo], [1.0, 50.0, hi]),
            maxfev=20000,
        )
    a, b, log_mid = (float(x) for x in params)
    se = np.sqrt(np.diag(cov)) if np.all(np.isfinite(cov)) else np.full(3, np.nan)
    c_mid = float(np.exp(log_mid))
    return SigmoidFit(
        a=a,
        b=b,
        c_mid=c_mid,
        a_se=float(se[0]),
        b_se=float(se[1]),
        c_mid_se=float(c_mid * se[2]),
        r0=float(r0),
        points=int(c.size),
    )


def rollout_shape(cfg) -> dict[str, float]:
    """One RL step of ``cfg`` (a ``TrainConfig``) as the bench formula sees it: ``rollouts``
    (``rl.prompts_per_step x rl.group_size``), ``prompt_tokens`` (the mean rendered prompt of the
    training problems) and ``flops_per_token`` (forward + backward, at rows of prompt +
    ``sampler.max_tokens``); ``bench loop``'s update GFLOP/s uses the same."""
    from jaxrlvr import builders
    from jaxrlvr import prompts as prompt_lib

    tokenizer = builders.build_tokenizer(cfg.model)
    problems, _ = builders.load_splits(cfg)
    prompt = statistics.fmean(
        len(prompt_lib.encode(tokenizer, prompt_lib.render(cfg.data.template, p, tokenizer)))
        for p in problems
    )
    model_cfg = builders.model_config(cfg.model, tokenizer)
    return {
        "rollouts": cfg.rl.prompts_per_step * cfg.rl.group_size,
        "prompt_tokens": prompt,
        "flops_per_token": model_cfg.flops_per_token(int(prompt + cfg.sampler.max_tokens)),
    }


def step_flops(run_dir: str) -> tuple[float, float]:
    """(FLOPs per rollout token, prompt tokens per step) of the run's config.yaml: an RL step
    computes ``FLOPs per token x (prompt tokens per step + its tokens/response)``, the FLOPs per
    token being one sampler forward plus ``rl.epochs_per_step`` update forward + backward passes
    (the module docstring)."""
    from jaxrlvr import config as config_lib

    path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no config.yaml in {run_dir} (needed for its FLOP count)")
    cfg = config_lib.load_config(path, [])
    shape = rollout_shape(cfg)
    train_fpt = shape["flops_per_token"]  # forward + backward: 3 forwards
    per_token = train_fpt / 3.0 + train_fpt * cfg.rl.epochs_per_step
    return per_token, shape["rollouts"] * shape["prompt_tokens"]


def run_curve(
    run_dir: str, key: str = "eval/accuracy", *, min_compute: float = 0.0
) -> tuple[np.ndarray, np.ndarray, float]:
    """(compute, pass rate, R0) of one run (the module docstring): the evaluations after RL
    compute ``min_compute``, and the evaluation at RL compute 0 as R0."""
    if not os.path.isfile(os.path.join(run_dir, metrics_lib.METRICS_FILE)):
        raise FileNotFoundError(f"no {metrics_lib.METRICS_FILE} in {run_dir}")
    records = metrics_lib.read_metrics(run_dir)
    per_token, prompt_tokens = step_flops(run_dir)
    by_step: dict[int, dict] = {}
    for r in records:  # a step logged twice (resumed): the later line wins
        by_step[int(r["step"])] = r
    compute, total, points, r0 = [], 0.0, [], None
    for step in sorted(by_step):
        r = by_step[step]
        if r.get("tokens/response") is not None:  # an RL step
            total += per_token * (prompt_tokens + float(r["tokens/response"]))
        value = r.get(key)
        if value is None:
            continue
        if total == 0.0:
            r0 = float(value)  # the last evaluation before RL's first step
        elif total >= min_compute:
            compute.append(total)
            points.append(float(value))
    if r0 is None:
        raise ValueError(
            f"{run_dir}: no {key} before the first RL step (R0); evaluate at the start "
            "(eval.at_start) or after the SFT warm start"
        )
    return np.array(compute), np.array(points), r0


def fit_figure(curves: Sequence[dict]):
    """Pass rate against compute (log axis) for each ``{"label", "compute", "rate", "r0",
    "fit"}``: the points and the fitted sigmoid (dashed, its A as a dotted line)."""
    import matplotlib.figure

    fig = matplotlib.figure.Figure(figsize=(7, 4.2), dpi=100)
    ax = fig.add_subplot()
    for i, c in enumerate(curves):
        color = f"C{i % 10}"
        ax.plot(c["compute"], c["rate"], "o", color=color, alpha=0.6)
        f = c["fit"]
        grid = np.geomspace(min(c["compute"]), max(c["compute"]) * 100, 200)
        label = f"{c['label']}: A={f.a:.3f}, B={f.b:.2f}"
        ax.plot(grid, sigmoid(grid, f.a, f.b, f.c_mid, f.r0), "--", color=color, label=label)
        ax.axhline(f.a, color=color, linestyle=":", alpha=0.5)
    ax.set_xscale("log")
    ax.set_xlabel("RL compute (model FLOPs)")
    ax.set_ylabel("held-out pass rate")
    ax.set_title("ScaleRL fit: R0 + (A - R0) / (1 + (C_mid / C)^B)")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return fig
