"""Helpers of the tests that run ``jaxrlvr`` end to end in a subprocess: the tiny run's
overrides, the CLI call, and the newest checkpoint's parameters. Not a test module: test modules
import this one, never each other."""

import os
import pathlib
import subprocess
import sys
import tempfile

REPO = pathlib.Path(__file__).parent.parent
# XLA:CPU's backend at -O0: tiny programs compile ~30% faster, same semantics (see conftest).
FAST_COMPILE = "--xla_backend_optimization_level=0"

# A tiny run: 1-layer model, a handful of SFT and RL steps, small eval.
# The tiny model every subprocess run trains: 1 layer, hidden 32.
TINY_MODEL = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
]
TINY = [
    *TINY_MODEL,
    "data.synthetic_train_size=200",
    "data.synthetic_eval_size=16",
    "sft.batch_size=16",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    "eval.max_problems=16",
    "reward.num_workers=1",
    "run.progress=false",
    "run.tensorboard=false",
]


def vllm_python() -> str:
    """The vLLM environment's interpreter (env ``JAXRLVR_VLLM_PYTHON``); the calling test is
    skipped without it locally and failed without it in CI (env ``CI`` set)."""
    import pytest

    python = os.environ.get("JAXRLVR_VLLM_PYTHON")
    if not python:
        if os.environ.get("CI"):
            pytest.fail("JAXRLVR_VLLM_PYTHON is not set in CI: the vLLM environment is missing")
        pytest.skip("JAXRLVR_VLLM_PYTHON not set (scripts/setup_vllm.sh)")
    return python


def env():
    env = dict(os.environ)
    # one CPU device, like a user's laptop; LLVM at -O0 as in conftest (the suite is compile-bound)
    env["XLA_FLAGS"] = FAST_COMPILE
    env["JAX_PLATFORMS"] = "cpu"
    return env


def jaxrlvr(*args, timeout=900, check=True):
    cmd = [sys.executable, "-m", "jaxrlvr.cli", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env(), timeout=timeout, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def launch(*args, pipe=True):
    """``jaxrlvr *args`` started in a subprocess. With ``pipe=False`` (a run left to itself in
    the background: tiny runs are mostly single-threaded Python, so two side by side take about
    the time of one on CI's two cores) its output goes to temporary files, which no full pipe
    can stall; ``wait`` collects it either way."""
    cmd = [sys.executable, "-m", "jaxrlvr.cli", *args]
    if pipe:
        out = err = subprocess.PIPE
    else:
        out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=out, stderr=err, text=True)
    proc.output_files = None if pipe else (out, err)
    return proc


def wait(proc, timeout=900, check=True):
    """Waits for a ``launch``-ed run (asserts it exited 0 unless not ``check``); returns its
    (stdout, stderr)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
    if proc.output_files:
        for f in proc.output_files:
            f.seek(0)
        out, err = (f.read() for f in proc.output_files)
    if check and proc.returncode != 0:
        raise AssertionError(f"{proc.args} failed ({proc.returncode}):\n{out}\n{err}")
    return out, err


def final_params(run_dir):
    """The newest checkpoint's step and policy params as {path: numpy array}."""
    import jax

    from jaxrlvr import checkpoint as checkpoint_lib

    ckpt = checkpoint_lib.Checkpointer(os.path.join(run_dir, "checkpoints"))
    step = ckpt.latest_step()
    params = ckpt.read_arrays(step)["state"]["params"]
    ckpt.close()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return step, {jax.tree_util.keystr(k): v for k, v in flat}


def start_until_lines(args, run_dir, min_lines, timeout=900):
    """Starts ``jaxrlvr *args`` in a subprocess and returns it once its ``run_dir`` has logged
    ``min_lines`` metrics lines (a poll with a deadline); the run must still be going."""
    import time

    proc = launch(*args)
    metrics = pathlib.Path(run_dir) / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= min_lines:
            break
        time.sleep(0.2)
    assert proc.poll() is None, "the run finished before it could be interrupted"
    return proc


def assert_same_params(a, b):
    """Two ``final_params`` results: the same step and bit-identical arrays."""
    import numpy as np

    (step_a, pa), (step_b, pb) = a, b
    assert step_a == step_b and pa.keys() == pb.keys()
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)
