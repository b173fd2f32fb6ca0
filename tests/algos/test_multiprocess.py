"""Two processes on 127.0.0.1 with jax.distributed (gloo CPU collectives, 4 fake devices each)
run one GRPO update on a mesh over all 8 devices, from a full batch on every process and from
each process's own half of the rows; both finish and the params equal a single-process run of
the same worker."""

import os
import socket
import subprocess
import sys

import numpy as np
import pytest

WORKER = os.path.join(os.path.dirname(__file__), "_multiprocess_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the worker sets its own device count
    return env


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the single-process reference npz, [the npz of each of the two processes])."""
    tmp_path = tmp_path_factory.mktemp("multiprocess")
    port = _free_port()
    multi = tmp_path / "multi"
    procs = [
        subprocess.Popen(
            [sys.executable, WORKER, str(multi), str(port), "2", str(i)],
            env=_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    single = tmp_path / "single"
    ref = subprocess.run(
        [sys.executable, WORKER, str(single), "0", "1", "0"],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            out, _ = p.communicate()
        outs.append(out)
    for i, p in enumerate(procs):
        assert p.returncode == 0, f"process {i} failed:\n{outs[i][-4000:]}"
    assert ref.returncode == 0, ref.stdout[-2000:] + ref.stderr[-4000:]
    return np.load(f"{single}.0.npz"), [np.load(f"{multi}.{pid}.npz") for pid in range(2)]


def _param_keys(npz):
    return [k for k in npz.files if not k.startswith("local") and k != "num_devices"]


def _assert_matches(multi, ref, prefix):
    keys = _param_keys(ref)
    assert len(keys) > 10
    assert {prefix + k for k in keys} <= set(multi.files)
    for k in keys:
        # float32; the 8-device run reduces in a different order: ~1e-7 differences.
        np.testing.assert_allclose(multi[prefix + k], ref[k], atol=1e-5, rtol=0, err_msg=k)


@pytest.mark.slow
def test_two_process_update_matches_single_process(runs):
    ref, multi = runs
    assert int(ref["num_devices"]) == 1
    for pid in range(2):  # both processes end with the single-process params
        assert int(multi[pid]["num_devices"]) == 8
        assert set(_param_keys(multi[pid])) == set(_param_keys(ref))
        _assert_matches(multi[pid], ref, "")


@pytest.mark.slow
def test_two_process_local_rows_match_single_process_full_batch(runs):
    """Each process fed only its own half of the rows (``step.shard_local_batch``); the update
    equals the single-process update on the full batch."""
    ref, multi = runs
    rows = [multi[pid]["local_rows"] for pid in range(2)]
    np.testing.assert_array_equal(rows[0], np.arange(4))  # process 0 holds data index 0
    np.testing.assert_array_equal(rows[1], np.arange(4, 8))
    for pid in range(2):
        _assert_matches(multi[pid], ref, "local/")
