"""``jaxrlvr train`` as a real two-process JAX job (gloo CPU collectives, 4 fake devices each).

Every run here is real processes on 127.0.0.1 started through the CLI flags (``--coordinator
--num-processes --process-id``): 3 GRPO steps of a tiny config with the JAX sampler, two data
shards (``data.shards=2``) so that one process holding both shards is the reference.

- 2 processes x 4 devices end with the parameters (1e-5) and log the metrics of 1 process x 8
  devices on the same (1, 8, 1) mesh.
- One process SIGKILLed mid-step (after the step-1 checkpoint): the other exits non-zero within
  120 s with one line naming the lost process; ``--resume`` of both then ends with exactly the
  uninterrupted two-process run's parameters.
"""

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

REPO = pathlib.Path(__file__).parent.parent

TINY = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "model.num_hidden_layers=1",
    "model.num_attention_heads=2",
    "model.num_key_value_heads=1",
    "data.synthetic_train_size=64",
    "data.synthetic_eval_size=16",
    "data.shards=2",
    "sft.steps=0",
    "rl.steps=3",
    "rl.prompts_per_step=4",
    "rl.group_size=4",
    # One rollout per row: both runs lay out the same 16 rows (packing each process's rows
    # separately would change the summation order of the loss, not its value).
    "rl.packing=false",
    # A random model answers nothing right: reward the format too, so advantages are non-zero
    # and every step moves the parameters (no warmup).
    "reward.format_weight=0.5",
    "optim.warmup_steps=0",
    "eval.every=3",
    "eval.max_problems=16",
    "checkpoint.every=1",
    "mesh.data=1",
    "mesh.fsdp=8",
    "reward.num_workers=1",
    "run.progress=false",
    "run.tensorboard=false",
]
# Host-side timings differ run to run; everything else must agree.
VOLATILE = ("time/", "throughput/", "sync/", "grading/seconds")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(devices: int) -> dict:
    e = dict(os.environ, JAX_PLATFORMS="cpu")
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    for k in ("JAXRLVR_COORDINATOR", "JAXRLVR_NUM_PROCESSES", "JAXRLVR_PROCESS_ID"):
        e.pop(k, None)
    return e


def start(run_dir, *extra, processes=2, port=None, args=TINY):
    """The processes of one job (``processes`` == 1: a plain single-process run on 8 devices)."""
    base = [sys.executable, "-m", "jaxrlvr.cli", "train", "configs/demo.yaml"]
    base += [f"run.out_dir={run_dir}", *args, *extra]
    if processes == 1:
        return [
            subprocess.Popen(
                base,
                env=env(8),
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        ]
    port = port or free_port()
    flags = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)]
    return [
        subprocess.Popen(
            [*base, *flags, "--process-id", str(i)],
            env=env(4),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]


def finish(procs, timeout=900):
    outs = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            out, err = p.communicate()
        outs.append((p.returncode, out, err))
    for i, (rc, out, err) in enumerate(outs):
        assert rc == 0, f"process {i} exited {rc}:\n{out[-2000:]}\n{err[-6000:]}"
    return outs


def final_params(run_dir):
    import jax

    from jaxrlvr import checkpoint as checkpoint_lib

    ckpt = checkpoint_lib.Checkpointer(os.path.join(run_dir, "checkpoints"))
    step = ckpt.latest_step()
    params = ckpt.read_arrays(step)["state"]["params"]
    ckpt.close()
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    return step, {jax.tree_util.keystr(k): np.asarray(v) for k, v in flat}


def metric_lines(run_dir):
    return [
        json.loads(x) for x in (pathlib.Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    ]


def assert_same_metrics(a_dir, b_dir, rtol=1e-5, atol=1e-6):
    a, b = metric_lines(a_dir), metric_lines(b_dir)
    assert [x["step"] for x in a] == [x["step"] for x in b]
    compared = 0
    for la, lb in zip(a, b):
        keys = {k for k in la if not k.startswith(VOLATILE)}
        assert keys == {k for k in lb if not k.startswith(VOLATILE)}
        for k in keys:
            if la[k] is None or lb[k] is None:
                assert la[k] is None and lb[k] is None, k
                continue
            np.testing.assert_allclose(
                lb[k], la[k], rtol=rtol, atol=atol, err_msg=f"{la['step']} {k}"
            )
            compared += 1
    assert compared > 50


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the 1-process x 8-device run dir, the 2-process x 4-device run dir), run concurrently."""
    root = tmp_path_factory.mktemp("multihost")
    single, multi = root / "single", root / "multi"
    procs = start(single, processes=1) + start(multi)
    finish(procs)
    return single, multi


@pytest.mark.slow
def test_two_processes_match_one_process(runs):
    single, multi = runs
    step_a, a = final_params(single)
    step_b, b = final_params(multi)
    assert step_a == step_b == 3
    assert a.keys() == b.keys() and len(a) > 5
    for k in a:
        # float32; the cross-process (gloo) reductions add in another order: ~1e-7 apart.
        np.testing.assert_allclose(b[k], a[k], atol=1e-5, rtol=0, err_msg=k)
    assert_same_metrics(single, multi)
    # The runs learned something (the comparison is not of untouched initial parameters).
    assert all(x["grad_norm"] > 0 for x in metric_lines(single)[1:])
    # Each process logged nothing itself: process 0 writes the run's files once.
    lines = metric_lines(multi)
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    assert lines[-1]["eval/n"] == 16 and lines[1]["grading/n"] == 16  # both processes' rows


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Process 1 SIGKILLed during step 2 (after the step-1 checkpoint): (run dir, process 0's
    exit code, its stderr, seconds from the kill to its exit)."""
    run_dir = tmp_path_factory.mktemp("multihost_killed") / "run"
    procs = start(run_dir)
    ckpt = run_dir / "checkpoints" / "1"
    deadline = time.time() + 900
    while time.time() < deadline and all(p.poll() is None for p in procs) and not ckpt.is_dir():
        time.sleep(0.2)
    assert all(p.poll() is None for p in procs), "a process ended before the kill"
    assert ckpt.is_dir(), "no step-1 checkpoint within 900 s"
    time.sleep(1.0)  # into step 2
    procs[1].send_signal(signal.SIGKILL)
    t0 = time.time()
    try:
        _, err = procs[0].communicate(timeout=180)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        _, err = procs[0].communicate()
    procs[1].communicate()
    return run_dir, procs[0].returncode, err, time.time() - t0


@pytest.mark.slow
def test_lost_process_is_reported_in_one_line_within_120s(killed):
    _, rc, err, seconds = killed
    assert rc not in (0, None), err[-3000:]
    assert seconds < 120, f"process 0 took {seconds:.0f} s to stop"
    lines = [x for x in err.strip().splitlines() if "lost process" in x]
    assert len(lines) == 1, err[-3000:]
    assert "lost process 1" in lines[0] and lines[0].startswith("jaxrlvr: error: process 0:")


@pytest.mark.slow
def test_killed_run_resumes_to_the_uninterrupted_params(killed, runs):
    run_dir = killed[0]
    finish(start(run_dir, "--resume"))
    _, multi = runs
    step_a, a = final_params(multi)
    step_b, b = final_params(run_dir)
    assert step_a == step_b == 3
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    assert [x["step"] for x in metric_lines(run_dir)] == [0, 1, 2, 3]
