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

import re
import signal
import subprocess
import time

import pytest
from multihost_runs import (
    HEARTBEAT,
    assert_like_single,
    assert_resumed_like,
    final_params,
    finish,
    metric_lines,
    start,
    wait_for_checkpoint,
)


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
    _, lines = assert_like_single(single, multi)  # gloo reductions: another order
    # Each process logged nothing itself: process 0 writes the run's files once.
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    assert lines[-1]["eval/n"] == 16 and lines[1]["grading/n"] == 16  # both processes' rows
    assert {"eval/pass@4", "eval/maj@4", "eval/avg@4_se"} <= lines[-1].keys()  # gathered votes


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Process 1 SIGKILLed during step 2 (after the step-1 checkpoint): (run dir, process 0's
    exit code, its stderr, seconds from the kill to its exit)."""
    run_dir = tmp_path_factory.mktemp("multihost_killed") / "run"
    procs = start(run_dir, f"distributed.heartbeat_timeout={HEARTBEAT}")
    # The loop goes on to step 2 once checkpoint 1 is written (its directory appears whole, by
    # a rename): the kill lands in step 2 (its rollouts or update) with no sleep to wait for it.
    wait_for_checkpoint(procs, run_dir, 1)
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
    assert_resumed_like(run_dir, multi)
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
    assert_resumed_like(run_dir, multi)
    assert [x["step"] for x in metric_lines(run_dir)] == [0, 1, 2, 3]
