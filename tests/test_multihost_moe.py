"""A tiny Qwen3-MoE trained by ``jaxrlvr train`` as a real two-process JAX job, expert-parallel.

The tiny config of tests/multihost_runs.py with a Qwen3-MoE in place of the Qwen2: 8 experts
(top-2) on the mesh (data=1, fsdp=1, expert=8, tensor=1), so each device holds one expert and
the tokens travel to it (``model.expert_parallel``, the ring dispatch on the CPU), the expert
axis across the two processes' 4 + 4 devices. Three GRPO steps:

- 2 processes x 4 devices end with the parameters (1e-5) and log the metrics (router metrics
  included) of 1 process x 8 devices without expert parallelism (mesh data=8: each device
  routes its rows through all 8 experts);
- both processes SIGKILLed after the step-1 checkpoint, then ``--resume``: the final parameters
  are exactly (bit for bit) those of the uninterrupted two-process run.
"""

import signal

import pytest
from multihost_runs import (
    assert_like_single,
    assert_resumed_like,
    finish,
    start,
    wait_for_checkpoint,
)

MOE = [
    "model.model_type=qwen3_moe",
    "model.num_experts=8",
    "model.num_experts_per_tok=2",
    "model.moe_intermediate_size=32",
    "mesh.fsdp=1",
]
EP = ["mesh.expert=8"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the 1-process x 8-device run dir without expert parallelism (data=8), the 2-process x
    4-device expert-parallel run dir), run concurrently."""
    root = tmp_path_factory.mktemp("multihost_moe")
    single, multi = root / "single", root / "multi"
    finish(start(single, *MOE, "mesh.data=8", processes=1) + start(multi, *MOE, *EP))
    return single, multi


@pytest.mark.slow
def test_two_processes_match_one_process_with_sharded_experts(runs):
    single, multi = runs
    a, lines = assert_like_single(single, multi)
    assert any("experts" in k for k in a)
    (gate,) = [k for k in a if "experts" in k and "gate_proj" in k]
    assert a[gate].shape[-3] == 8  # [layers, E, D, F]
    assert all(0.0 < x["router/load_entropy"] for x in lines[1:])


@pytest.mark.slow
def test_killed_moe_job_resumes_to_the_uninterrupted_params(runs, tmp_path):
    run_dir = tmp_path / "run"
    procs = start(run_dir, *MOE, *EP)
    wait_for_checkpoint(procs, run_dir, 1)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    for p in procs:
        p.communicate()
    finish(start(run_dir, *MOE, *EP, "--resume"))
    assert_resumed_like(run_dir, runs[1])
