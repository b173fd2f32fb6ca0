"""Tests for jaxrlvr.plots: smoothing, series extraction, overlaid figures, PNG files, and the
``jaxrlvr plot`` entry point. Runs are written with the real MetricsLogger."""

import os

import matplotlib.image
import numpy as np
import pytest

from jaxrlvr import metrics, plots


def _write_run(run_dir, rows):
    with metrics.MetricsLogger(run_dir, tensorboard=False) as log:
        for step, values in rows:
            log.log(step, values)
    return str(run_dir)


@pytest.fixture
def two_runs(tmp_path):
    a = _write_run(
        tmp_path / "grpo",
        [
            (0, {"reward_mean": 0.1, "response_length_mean": 40.0, "eval/accuracy": 0.2}),
            (1, {"reward_mean": 0.3, "response_length_mean": 42.0}),
            (2, {"reward_mean": float("nan"), "response_length_mean": 45.0}),
            (3, {"reward_mean": 0.6, "response_length_mean": 47.0, "eval/accuracy": 0.5}),
        ],
    )
    b = _write_run(
        tmp_path / "dr_grpo",
        [(0, {"reward_mean": 0.2, "response_length_mean": 30.0}), (1, {"reward_mean": 0.4})],
    )
    return a, b


def test_smooth():
    # Hand-computed with w = 0.5: s0 = 0.5*1 / (1-0.5) = 1; s1 = (0.25 + 0) / (1-0.25) = 1/3.
    np.testing.assert_allclose(plots.smooth([1.0, 0.0], 0.5), [1.0, 1 / 3], rtol=1e-12)
    np.testing.assert_array_equal(plots.smooth([3.0, -1.0, 2.0], 0.0), [3.0, -1.0, 2.0])
    # Debiasing: a constant stays constant from the first point (float64 rounding only).
    np.testing.assert_allclose(plots.smooth([5.0] * 10, 0.9), [5.0] * 10, rtol=1e-12)
    with pytest.raises(ValueError, match=r"smoothing must be in \[0, 1\)"):
        plots.smooth([1.0], 1.0)


def test_series_drops_nulls_and_keeps_last_duplicate():
    records = [
        {"step": 2, "x": 2.0},
        {"step": 0, "x": 0.0},
        {"step": 1, "x": None},
        {"step": 2, "x": 20.0},
        {"step": 3, "y": 1.0},
    ]
    steps, values = plots.series(records, "x")
    np.testing.assert_array_equal(steps, [0, 2])
    np.testing.assert_array_equal(values, [0.0, 20.0])
    steps, values = plots.series(records, "missing")
    assert steps.size == 0 and values.size == 0


def test_make_figure_overlays_runs(two_runs):
    runs = [(os.path.basename(d), metrics.read_metrics(d)) for d in two_runs]
    fig = plots.make_figure(runs, "reward_mean", smoothing=0.5)
    (ax,) = fig.axes
    lines = ax.get_lines()
    assert len(lines) == 4  # raw + smoothed per run
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["grpo", "dr_grpo"]
    raw_a, smooth_a, raw_b, smooth_b = lines
    # Run "grpo": the NaN at step 2 was logged as null and is left out.
    np.testing.assert_array_equal(raw_a.get_xdata(), [0, 1, 3])
    np.testing.assert_array_equal(raw_a.get_ydata(), [0.1, 0.3, 0.6])
    np.testing.assert_allclose(smooth_a.get_ydata(), plots.smooth([0.1, 0.3, 0.6], 0.5))
    np.testing.assert_array_equal(raw_b.get_ydata(), [0.2, 0.4])
    assert smooth_a.get_color() == raw_a.get_color() != smooth_b.get_color() == raw_b.get_color()
    assert raw_a.get_alpha() < 1.0 and smooth_a.get_alpha() is None  # raw is the faint one

    # A key only one run has: that run's two lines only.
    fig = plots.make_figure(runs, "eval/accuracy")
    assert len(fig.axes[0].get_lines()) == 2
    assert [t.get_text() for t in fig.axes[0].get_legend().get_texts()] == ["grpo"]
    assert plots.make_figure(runs, "kl") is None


def test_plot_runs_writes_pngs(two_runs, tmp_path):
    out = tmp_path / "plots"
    written = plots.plot_runs(list(two_runs), out, keys=("reward_mean", "eval/accuracy", "kl"))
    # "kl" is in no run: no file for it.
    assert written == [str(out / "reward_mean.png"), str(out / "eval_accuracy.png")]
    assert sorted(os.listdir(out)) == ["eval_accuracy.png", "reward_mean.png"]
    for path in written:
        image = matplotlib.image.imread(path)
        assert image.shape == (420, 700, 4)  # figsize 7 x 4.2 in at 100 dpi, RGBA
        assert image.std() > 0  # something was drawn


def test_run_labels_disambiguate():
    assert plots.run_labels(["x/a", "y/b/"]) == ["a", "b"]
    assert plots.run_labels(["x/run", "y/run"]) == ["x/run", "y/run"]


def test_plot_main(two_runs, capsys):
    a, b = two_runs
    assert plots.plot_main([a, b]) == 0
    default_out = os.path.join(a, "plots")
    expected = ["response_length_mean.png", "reward_mean.png", "eval_accuracy.png"]
    assert sorted(os.listdir(default_out)) == sorted(expected)
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(os.path.join(default_out, n) for n in expected)

    out = os.path.join(b, "elsewhere")
    assert plots.plot_main([b, "--out", out, "--keys", "response_length_mean, reward_mean"]) == 0
    assert sorted(os.listdir(out)) == ["response_length_mean.png", "reward_mean.png"]

    with pytest.raises(ValueError, match="none of the keys"):
        plots.plot_main([a, "--keys", "kl"])
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl in /nonexistent/run"):
        plots.plot_main(["/nonexistent/run"])
