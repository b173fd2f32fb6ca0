"""Helpers of the tests that run ``jaxrlvr train`` as a real multi-process JAX job
(``test_multihost``, ``test_multihost_moe``, ``test_multihost_vllm``): ports, launch
environments, starting and finishing the processes, reading and comparing their runs. Not a
test module."""

import json
import os
import pathlib
import socket
import subprocess
import sys
import time

import numpy as np
import runs
from runs import REPO, TINY_MODEL, final_params

TINY = [
    *TINY_MODEL,
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
    # Sampled metrics: each process's rewards and votes are gathered before they are reduced.
    "eval.pass_k=[1,4]",
    "eval.maj_k=[4]",
    "checkpoint.every=1",
    "mesh.data=1",
    "mesh.fsdp=8",
    "reward.num_workers=1",
    "run.progress=false",
    "run.tensorboard=false",
]
# distributed.heartbeat_timeout of the killed run, seconds: JAX's verdict (an abort from C++)
# comes from half of it after the kill on; process 0 reaches its failing collective up to ~4 s
# after the kill here, then the roll call waits HEARTBEAT / 6 s.
HEARTBEAT = 30
# Host-side timings differ run to run; everything else must agree.
VOLATILE = ("time/", "throughput/", "sync/", "grading/seconds")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DISTRIBUTED_ENV = (
    "JAXRLVR_COORDINATOR",
    "JAXRLVR_NUM_PROCESSES",
    "JAXRLVR_PROCESS_ID",
    "JAXRLVR_DISTRIBUTED",
    "JAXRLVR_PORT",
    "JOB_COMPLETION_INDEX",
)


def env(devices: int) -> dict:
    e = dict(os.environ, JAX_PLATFORMS="cpu")
    # -O0: the suite is compile-bound (see conftest)
    e["XLA_FLAGS"] = (
        f"--xla_force_host_platform_device_count={devices} --xla_backend_optimization_level=0"
    )
    for k in list(e):  # nothing of an enclosing job (CI under SLURM or in a pod) leaks in
        if k.startswith(("SLURM_", "KUBERNETES_")) or k in DISTRIBUTED_ENV:
            e.pop(k)
    return e


def launch_env(how: str, port: int, i: int, processes: int = 2) -> tuple[dict, list[str]]:
    """(extra env vars, extra flags) of process ``i`` launched the ``how`` way."""
    if how == "flags":
        return {}, ["--coordinator", f"127.0.0.1:{port}", "--num-processes", str(processes)] + [
            "--process-id",
            str(i),
        ]
    if how == "slurm":  # what srun sets; the port follows from the job id (distributed.py)
        return {
            "SLURM_JOB_ID": str(port - 61000),
            "SLURM_PROCID": str(i),
            "SLURM_LOCALID": str(i),
            "SLURM_STEP_NUM_TASKS": str(processes),
            "SLURM_NTASKS": str(processes),
            "SLURM_STEP_NUM_NODES": "1",
            "SLURM_STEP_NODELIST": socket.gethostname(),
        }, []
    if how == "k8s":  # an indexed Job's pod: the manifest sets the JAXRLVR_* pair
        return {
            "JOB_COMPLETION_INDEX": str(i),
            "KUBERNETES_SERVICE_HOST": "10.0.0.1",
            "JAXRLVR_COORDINATOR": f"{socket.gethostname()}:{port}",
            "JAXRLVR_NUM_PROCESSES": str(processes),
        }, []
    raise ValueError(how)


def slurm_port() -> int:
    """A free port in the range a SLURM job id maps to."""
    rng = np.random.default_rng()
    for _ in range(100):
        port = int(rng.integers(61000, 65000))
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port in 61000-64999")


def start(run_dir, *extra, processes=2, port=None, args=TINY, how="flags"):
    """The processes of one job (``processes`` == 1: a plain single-process run on 8 devices),
    launched ``how``: "flags", "slurm" or "k8s" (``launch_env``)."""
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
    port = port or (slurm_port() if how == "slurm" else free_port())
    procs = []
    for i in range(processes):
        extra_env, flags = launch_env(how, port, i, processes)
        procs.append(
            subprocess.Popen(
                [*base, *flags],
                env={**env(4), **extra_env},
                cwd=REPO,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


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


def assert_like_single(single, multi, steps=3):
    """A multi-process run ``multi`` ended ``steps`` steps with the parameters (1e-5: float32,
    the cross-process reductions add in another order, ~1e-7 apart) and the metrics of the
    single-process run ``single``, and learned something; returns (single's params, the
    multi-process run's metric lines)."""
    step_a, a = final_params(single)
    step_b, b = final_params(multi)
    assert step_a == step_b == steps
    assert a.keys() == b.keys() and len(a) > 5
    for k in a:
        np.testing.assert_allclose(b[k], a[k], atol=1e-5, rtol=0, err_msg=k)
    assert_same_metrics(single, multi)
    lines = metric_lines(multi)
    # The runs learned something (the comparison is not of untouched initial parameters).
    assert all(x["grad_norm"] > 0 for x in lines[1:])
    return a, lines


def wait_for_checkpoint(procs, run_dir, step, timeout=900):
    """Polls (a deadline, not a sleep) until the job ``procs`` has written checkpoint ``step``
    in ``run_dir``, all its processes still running."""
    ckpt = pathlib.Path(run_dir) / "checkpoints" / str(step)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and all(p.poll() is None for p in procs):
        if ckpt.is_dir():
            break
        time.sleep(0.2)
    assert all(p.poll() is None for p in procs), "a process ended before the checkpoint"
    assert ckpt.is_dir(), f"no step-{step} checkpoint within {timeout} s"


def assert_resumed_like(resumed, uninterrupted, steps=3):
    """A resumed run ended ``steps`` steps with exactly (bit for bit) the parameters of the
    uninterrupted run."""
    runs.assert_same_params(final_params(uninterrupted), final_params(resumed))
    assert final_params(resumed)[0] == steps
