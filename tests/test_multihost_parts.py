"""The single-process parts of multi-host training: data shards, flags and env vars, padding a
process's rows to the job's shape, and the row block of a process on one host."""

import dataclasses

import numpy as np
import pytest

from jaxrlvr import distributed
from jaxrlvr.data import iterators, shards


def test_split_is_disjoint_complete_and_fixed_by_the_seed():
    items = list(range(103))
    a = shards.split(items, 4, seed=0)
    assert sorted(x for s in a for x in s) == items
    assert [len(s) for s in a] == [26, 26, 26, 25]
    assert all(s == sorted(s) for s in a)  # each shard keeps the original order
    assert shards.split(items, 4, seed=0) == a  # a restart reads the same rows
    assert shards.split(items, 4, seed=1) != a
    assert shards.split(items, 1, seed=5) == [items]  # one shard: unchanged
    with pytest.raises(ValueError, match="3 items cannot be split into 4"):
        shards.split(items[:3], 4, seed=0)


def test_owned_shards_follow_the_row_block():
    assert list(shards.owned(4, 0, 2)) == [0, 1]
    assert list(shards.owned(4, 1, 2)) == [2, 3]
    with pytest.raises(ValueError, match="data.shards=3 does not split over 2"):
        shards.owned(3, 0, 2)


def test_one_process_holding_two_shards_reads_what_two_processes_read():
    """The global batch of a step does not depend on which process holds which shard; the state
    round-trips per shard."""
    items = [f"p{i}" for i in range(40)]
    split = shards.split(items, 2, seed=3)

    def make(xs, seed):
        return iterators.PromptIterator(xs, 3, seed=seed)

    both = shards.ShardedIterator(dict(enumerate(split)), make, seed=3)
    p0 = shards.ShardedIterator({0: split[0]}, make, seed=3)
    p1 = shards.ShardedIterator({1: split[1]}, make, seed=3)
    for _ in range(20):  # across epoch boundaries
        assert both.next_batch() == p0.next_batch() + p1.next_batch()
    state = both.state_dict()
    assert sorted(state["shards"]) == ["0", "1"]
    again = shards.ShardedIterator({1: split[1]}, make, seed=3)
    again.load_state_dict(state)
    assert again.next_batch() == p1.next_batch()
    with pytest.raises(ValueError, match="no state for data shard 1"):
        again.load_state_dict({"shards": {"0": state["shards"]["0"]}})


def test_flags_and_env_vars():
    base = distributed.DistributedConfig()
    assert distributed.from_flags(base, environ={}) == base
    env = {
        "JAXRLVR_COORDINATOR": "10.0.0.1:1234",
        "JAXRLVR_NUM_PROCESSES": "4",
        "JAXRLVR_PROCESS_ID": "3",
    }
    cfg = distributed.from_flags(base, environ=env)
    assert (cfg.enabled, cfg.coordinator_address, cfg.num_processes, cfg.process_id) == (
        True,
        "10.0.0.1:1234",
        4,
        3,
    )
    # flags win over env vars
    assert distributed.from_flags(base, process_id=1, environ=env).process_id == 1
    assert distributed.from_flags(base, num_processes=1, environ={}).enabled is False
    auto = distributed.from_flags(base, environ={"JAXRLVR_DISTRIBUTED": "auto"})
    assert auto.enabled and auto.auto
    with pytest.raises(ValueError, match="JAXRLVR_NUM_PROCESSES='two' is not a valid int"):
        distributed.from_flags(base, environ={"JAXRLVR_NUM_PROCESSES": "two"})
    with pytest.raises(ValueError, match=r"process_id must be in \[0, num_processes=2\)"):
        distributed.from_flags(base, coordinator="h:1", num_processes=2, process_id=2, environ={})
    with pytest.raises(ValueError, match="JAXRLVR_DISTRIBUTED='yes'"):
        distributed.from_flags(base, environ={"JAXRLVR_DISTRIBUTED": "yes"})


def test_cli_rejects_a_bad_process_id_in_one_line(tmp_path):
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "jaxrlvr.cli", "train", "configs/demo.yaml"]
        + ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "5"],
        capture_output=True,
        text=True,
        cwd=str(__import__("pathlib").Path(__file__).parent.parent),
        timeout=300,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "jaxrlvr train: error: process_id must be in [0, num_processes=2), got 5"
    ]


def test_pad_rows_adds_rows_and_positions_that_hold_nothing():
    from jaxrlvr.algos import batch as batch_lib
    from jaxrlvr.algos import step

    b = batch_lib.Batch(
        input_ids=np.ones((2, 3), np.int32),
        attention_mask=np.ones((2, 3), np.int32),
        labels=np.ones((2, 3), np.int32),
        loss_mask=np.ones((2, 3), np.float32),
        advantages=np.ones(2, np.float32),
    )
    p = step.pad_rows(b, 4, 5)
    assert p.input_ids.shape == (4, 5) and p.advantages.shape == (4,)
    assert p.loss_mask.sum() == 6 and p.attention_mask[:, 3:].sum() == 0
    assert p.attention_mask[2:].sum() == 0 and p.advantages[2:].sum() == 0
    assert step.agree_local_shapes(b) is b  # one process: unchanged
    # MoE routes: padding holds -1 ("no recorded route": the live top-k), real routes are kept
    routes = np.zeros((2, 3, 2, 2), np.int8)
    pr = step.pad_rows(b.replace(routes=routes), 4, 5).routes
    assert pr.shape == (4, 5, 2, 2) and pr.dtype == np.int8
    assert np.all(pr[:2, :3] == 0) and np.all(pr[2:] == -1) and np.all(pr[:, 3:] == -1)


def test_one_process_is_one_row_block_and_metrics_pass_through():
    import jax

    from jaxrlvr import model
    from jaxrlvr.algos import step

    mesh = model.make_mesh(model.MeshConfig(data=2, fsdp=4, tensor=1), jax.devices()[:8])
    assert step.process_row_block(mesh) == (0, 1)
    m = {"reward_mean": 0.5, "response_length_max": 3.0}
    assert distributed.reduce_metrics(m) == m
    assert distributed.allgather_json({"a": 1}) == [{"a": 1}]


def test_config_checks_timeouts():
    with pytest.raises(ValueError, match="distributed.heartbeat_timeout must be a whole number"):
        dataclasses.replace(distributed.DistributedConfig(), heartbeat_timeout=0)
    with pytest.raises(ValueError, match="distributed.shutdown_timeout must be a whole number"):
        dataclasses.replace(distributed.DistributedConfig(), shutdown_timeout=2.5)


SLURM = {  # what srun sets in task 1 of a 4-task step on two nodes
    "SLURM_JOB_ID": "123456",
    "SLURM_PROCID": "1",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_STEP_NODELIST": "gpu[007-008]",
    "SLURM_JOB_NODELIST": "gpu[001-008]",
}


def test_slurm_step_is_detected():
    base = distributed.DistributedConfig()
    cfg = distributed.from_flags(base, environ=SLURM)
    port = 61000 + 123456 % 4000
    assert (cfg.enabled, cfg.auto, cfg.coordinator_address, cfg.num_processes, cfg.process_id) == (
        True,
        False,
        f"gpu007:{port}",
        4,
        1,
    )
    # JAXRLVR_PORT, env vars and flags win over what SLURM says
    cfg = distributed.from_flags(base, process_id=3, environ={**SLURM, "JAXRLVR_PORT": "999"})
    assert (cfg.coordinator_address, cfg.process_id) == ("gpu007:999", 3)
    assert distributed.from_flags(base, environ={**SLURM, "JAXRLVR_DISTRIBUTED": "off"}) == base
    # One task (an sbatch script, `srun -n1`): one process
    assert distributed.from_flags(base, environ={**SLURM, "SLURM_STEP_NUM_TASKS": "1"}) == base
    assert [
        distributed.first_slurm_host(x)
        for x in ("node001", "node001,host2", "node[001-015],host2", "n[7,9-11]", "a-b[03]")
    ] == ["node001", "node001", "node001", "n7", "a-b03"]


def test_kubernetes_index_is_the_process_id():
    base = distributed.DistributedConfig()
    pod = {"JOB_COMPLETION_INDEX": "2", "KUBERNETES_SERVICE_HOST": "10.0.0.1"}
    assert distributed.from_flags(base, environ=pod) == base  # no job size given: one process
    env = {**pod, "JAXRLVR_COORDINATOR": "train-0.train:1234", "JAXRLVR_NUM_PROCESSES": "4"}
    cfg = distributed.from_flags(base, environ=env)
    assert (cfg.enabled, cfg.coordinator_address, cfg.num_processes, cfg.process_id) == (
        True,
        "train-0.train:1234",
        4,
        2,
    )


@pytest.mark.parametrize(
    "environ",
    [
        {**SLURM, "JAXRLVR_COORDINATOR": "127.0.0.1:1234"},
        {**SLURM, "SLURM_STEP_NODELIST": "localhost,gpu2"},
        {
            "JOB_COMPLETION_INDEX": "0",
            "JAXRLVR_COORDINATOR": "[::1]:9",
            "JAXRLVR_NUM_PROCESSES": "2",
        },
    ],
)
def test_a_loopback_coordinator_of_a_multi_host_job_is_refused_naming_the_flag(environ):
    with pytest.raises(ValueError, match=r"is a loopback address .* pass --coordinator HOST:PORT"):
        distributed.from_flags(distributed.DistributedConfig(), environ=environ)
    # on one host (the tests' case) it is what one wants
    one_host = {**environ, "SLURM_STEP_NUM_NODES": "1", "JAXRLVR_NUM_PROCESSES": "1"}
    distributed.from_flags(distributed.DistributedConfig(), environ=one_host)
