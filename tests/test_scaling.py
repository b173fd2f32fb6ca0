"""ScaleRL's sigmoid fit (jaxrlvr.scaling) on synthetic curves with known parameters."""

import json
import shutil

import numpy as np
import pytest
import yaml

from jaxrlvr import plots, scaling

pytest.importorskip("scipy")
TRUE = {"a": 0.72, "b": 1.4, "c_mid": 3e14, "r0": 0.12}


def test_fit_recovers_known_parameters():
    c = np.geomspace(1e13, 1e16, 25)
    exact = scaling.fit_sigmoid(c, scaling.sigmoid(c, **TRUE), TRUE["r0"])
    # Noise-free points: least squares lands on the generating parameters (to the solver's
    # tolerance, 1e-8 relative is ~1e3 x its default xtol).
    np.testing.assert_allclose(
        [exact.a, exact.b, exact.c_mid], [TRUE["a"], TRUE["b"], TRUE["c_mid"]], rtol=1e-6
    )
    rng = np.random.default_rng(0)
    z = []
    for _ in range(20):
        y = scaling.sigmoid(c, **TRUE) + rng.normal(0, 0.01, c.size)
        f = scaling.fit_sigmoid(c, y, TRUE["r0"])
        z.append(
            [
                (f.a - TRUE["a"]) / f.a_se,
                (f.b - TRUE["b"]) / f.b_se,
                np.log(f.c_mid / TRUE["c_mid"]) / (f.c_mid_se / f.c_mid),
            ]
        )
    # The covariance's standard errors are calibrated: the errors in units of SE have an RMS
    # near 1 for each parameter (measured over 100 fits: 1.15, 1.06, 1.07, nonlinear least
    # squares reading a little low); 0.6..1.6 is over 2.5 sds of a 20-fit RMS from either side.
    rms = np.sqrt(np.mean(np.square(z), axis=0))
    assert ((rms > 0.6) & (rms < 1.6)).all(), rms


def test_fit_refuses_too_few_points_and_zero_compute():
    with pytest.raises(ValueError, match="at least 3 points"):
        scaling.fit_sigmoid([1.0, 2.0], [0.1, 0.2], 0.0)
    with pytest.raises(ValueError, match="must be > 0"):
        scaling.fit_sigmoid([0.0, 1.0, 2.0], [0.1, 0.2, 0.3], 0.0)


def _synthetic_run(path, params, steps=40, every=2, tokens=100):
    """A run directory with the demo's config and a metrics.jsonl of 5 SFT steps then RL steps
    of ``tokens`` response tokens whose eval/accuracy follows the sigmoid of ``params``."""
    path.mkdir()
    shutil.copy("configs/demo.yaml", path / "config.yaml")
    per_token, prompt = scaling.step_flops(str(path))
    lines, compute = [], 0.0
    for step in range(1, 6):
        lines.append(
            {"step": step, "sft/loss": 1.0} | ({"eval/accuracy": params["r0"]} if step == 5 else {})
        )
    for step in range(6, 6 + steps):
        compute += per_token * (prompt + tokens)
        line = {"step": step, "tokens/response": tokens}
        if step % every == 0:
            line["eval/accuracy"] = float(scaling.sigmoid(compute, **params))
        lines.append(line)
    (path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return per_token, prompt


def test_run_curve_counts_the_bench_flops_and_plot_fit_overlays_runs(tmp_path, capsys):
    cfg = yaml.safe_load(open("configs/demo.yaml"))
    per_token, prompt = _synthetic_run(tmp_path / "x", {**TRUE, "c_mid": 1.0})
    # The bench formula: rollouts x mean prompt tokens, and one sampler forward + epochs x 3.
    rollouts = cfg["rl"]["prompts_per_step"] * cfg["rl"]["group_size"]
    assert prompt / rollouts > 3  # "13 + 7 =" and the like, rendered
    step = per_token * (prompt + 100)
    a = {**TRUE, "c_mid": 12 * step}
    b = {**TRUE, "a": 0.5, "b": 2.0, "c_mid": 6 * step}
    _synthetic_run(tmp_path / "a", a)
    _synthetic_run(tmp_path / "b", b)
    compute, rate, r0 = scaling.run_curve(str(tmp_path / "a"))
    assert r0 == TRUE["r0"] and len(compute) == 20
    np.testing.assert_allclose(compute, step * np.arange(1, 40, 2), rtol=1e-12)
    assert (
        plots.plot_main(
            [str(tmp_path / "a"), str(tmp_path / "b"), "--fit", "--out", str(tmp_path / "p")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert (tmp_path / "p" / "fit_eval_accuracy.png").stat().st_size > 1000
    for name, p in (("a", a), ("b", b)):
        line = next(x for x in out.splitlines() if x.startswith(f"{name}: A = "))
        fitted_a = float(line.split("A = ")[1].split()[0])
        fitted_b = float(line.split("B = ")[1].split()[0])
        assert fitted_a == pytest.approx(p["a"], abs=1e-3) and fitted_b == pytest.approx(
            p["b"], abs=1e-2
        )
