"""``jaxrlvr train`` as a real two-process JAX job (gloo CPU collectives, 4 fake devices each).

Every run here is real processes on this machine: 3 GRPO steps of a tiny config with the JAX
sampler, two data shards (``data.shards=2``) so that one process holding both shards is the
reference. Each way of launching is used once: explicit flags (``--coordinator --num-processes
--process-id``), simulated ``srun`` variables (SLURM_*) and Kubernetes variables
(``JOB_COMPLETION_INDEX`` + ``JAXRLVR_COORDINATOR`` / ``JAXRLVR_NUM_PROCESSES``).

- 2 processes x 4 devices end with the parameters (1e-5) and log the metrics of 1 process x 8
  devices on the same (1, 8, 1) mesh.
- SIGTERM to process 1 of a SLURM-launched job: both processes stop at the same step (JAX's
  preemption sync point), save it and exit 0; ``--resume`` through the Kubernetes variables ends
  with exactly the uninterrupted two-process run's parameters.
- One process SIGKILLed mid-step (after the step-1 checkpoint): the other exits with status 1
  and one line naming the lost process within the heartbeat timeout
  (``distributed.heartbeat_timeout=30``; ``distributed.report_failure``); ``--resume`` of both
  then ends with exactly the uninterrupted two-process run's parameters.
"""

import json
import os
import pathlib
import re
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
    e["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
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
    procs = start(run_dir, f"distributed.heartbeat_timeout={HEARTBEAT}")
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
def test_lost_process_is_reported_in_one_line_within_the_heartbeat_timeout(killed):
    _, rc, err, seconds = killed
    assert rc == 1, err[-3000:]
    print(f"process 0 stopped {seconds:.1f} s after process 1's SIGKILL")  # shown with -s
    assert seconds < HEARTBEAT / 2, f"process 0 took {seconds:.1f} s to stop"  # before JAX
    lines = [x for x in err.strip().splitlines() if x.startswith("jaxrlvr:")]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("jaxrlvr: error: process 0: lost process 1 (a collective failed"), (
        lines
    )
    assert "Traceback" not in err, err[-3000:]


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


@pytest.fixture(scope="module")
def preempted(tmp_path_factory):
    """A job launched through SLURM's variables; process 1 gets SIGTERM as soon as the run has
    logged its first line: (run dir, [(exit code, stdout + stderr)] per process)."""
    run_dir = tmp_path_factory.mktemp("multihost_preempted") / "run"
    procs = start(run_dir, how="slurm")
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 900
    while time.time() < deadline and all(p.poll() is None for p in procs):
        if metrics.is_file() and metrics.read_text().strip():
            break
        time.sleep(0.2)
    assert all(p.poll() is None for p in procs), "a process ended before the signal"
    procs[1].send_signal(signal.SIGTERM)
    return run_dir, [(rc, out + err) for rc, out, err in finish(procs)]


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(preempted):
    run_dir, outs = preempted  # finish() asserted exit code 0 for both
    steps = []
    for _, text in outs:
        found = re.findall(r"SIGTERM: saved checkpoint step (\d+) and stopped", text)
        assert len(found) == 1, text[-3000:]
        steps += map(int, found)
    assert steps[0] == steps[1], steps
    print(f"both processes stopped after step {steps[0]}")  # shown with -s
    step, _ = final_params(run_dir)
    assert step == steps[0] and 1 <= step < 3, (step, steps)  # a mid-run stop
    assert [x["step"] for x in metric_lines(run_dir)] == list(range(step + 1))


@pytest.mark.slow
def test_preempted_run_resumes_through_kubernetes_variables_to_the_same_params(preempted, runs):
    run_dir = preempted[0]
    finish(start(run_dir, "--resume", how="k8s"))
    _, multi = runs
    step_a, a = final_params(multi)
    step_b, b = final_params(run_dir)
    assert step_a == step_b == 3
    for k in a:
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    assert [x["step"] for x in metric_lines(run_dir)] == [0, 1, 2, 3]
