"""Smoke tests of the `jaxrlvr` entry points that test_train.py does not already run
(train, sft path, eval, plot and export run there)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).parent.parent


def _run(*args, timeout=900):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env.pop("XLA_FLAGS", None)
    return subprocess.run(
        [sys.executable, "-m", "jaxrlvr.cli", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=timeout,
    )


def test_help_lists_every_command():
    proc = _run("--help")
    assert proc.returncode == 0
    for command in ("train", "sft", "eval", "plot", "export", "bench", "curate", "serve-vllm"):
        assert command in proc.stdout


def test_unknown_command_and_benchmark_are_errors():
    proc = _run("fly")
    assert proc.returncode == 2 and "unknown command 'fly'" in proc.stdout
    proc = _run("bench", "nope")
    assert proc.returncode != 0 and "unknown benchmark 'nope'" in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, args",
    [
        ("forward", ["--shapes", "tiny", "--repeats", "1"]),
        ("update", ["--tiny", "--repeats", "1", "--systems", "jaxrlvr"]),
        ("rewards", ["--n", "20", "--workers", "1"]),
    ],
)
def test_bench_writes_json(tmp_path, name, args):
    out = tmp_path / f"{name}.json"
    proc = _run("bench", name, *args, "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(out.read_text())
    assert data  # records were written


@pytest.mark.slow
def test_sft_command_runs_sft_only(tmp_path):
    run_dir = tmp_path / "sft"
    proc = _run(
        "sft",
        "configs/demo.yaml",
        f"run.out_dir={run_dir}",
        "sft.steps=3",
        "sft.batch_size=8",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=1",
        "data.synthetic_train_size=50",
        "data.synthetic_eval_size=8",
        "eval.max_problems=8",
        "reward.num_workers=1",
        "run.progress=false",
        "run.tensorboard=false",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sft_steps"] == 3 and summary["rl_steps"] == 0
    assert summary["eval_accuracy_after_sft"] is not None


@pytest.mark.slow
def test_eval_on_a_benchmark_file_writes_its_problems_report(tmp_path):
    """``jaxrlvr eval --benchmark mbpp`` evaluates the file's problems (not the config's) with
    the code verifier, on the config's initial (random) model; ~10 s."""
    report = tmp_path / "r.json"
    proc = _run(
        "eval",
        "configs/demo.yaml",
        f"run.out_dir={tmp_path}",
        "model.hidden_size=32",
        "model.intermediate_size=64",
        "model.num_hidden_layers=1",
        "model.num_attention_heads=2",
        "model.num_key_value_heads=1",
        "model.max_position_embeddings=512",
        "reward.num_workers=1",
        *("--benchmark", "mbpp", "--benchmark-file", "jaxrlvr/data/samples/mbpp_sample.jsonl"),
        *("--samples", "2", "--k", "1,2", "--maj", "2", "--report", str(report)),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert data["benchmark"] == "mbpp" and data["samples_per_problem"] == 2
    assert [p["id"] for p in data["problems"]] == [f"mbpp-{i}" for i in range(1, 6)]
    assert {p["domain"] for p in data["problems"]} == {"code"}
    assert "pass@2 " in proc.stdout and (tmp_path / "r_pass_at_k.png").exists()
    proc = _run(
        "eval", "configs/demo.yaml", "--benchmark", "gsm8k", "--benchmark-file", "nope.jsonl"
    )
    assert proc.returncode == 2 and proc.stderr.strip().endswith(
        "no such file (expected a jsonl or parquet file with fields question, answer)"
    )
