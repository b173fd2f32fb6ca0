"""Tests for jaxrlvr.metrics: the JSON-lines file, TensorBoard events, summary, resume
truncation, kill safety (in a subprocess), and the phase timer."""

import glob
import json
import math
import os
import signal
import struct
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest
from tensorboardX.proto import event_pb2

from jaxrlvr import metrics


def _tb_events(run_dir):
    """All events of every file under run_dir/tb, in file-name then record order.

    A TFRecord is: uint64 length, uint32 crc, payload, uint32 crc (crcs not checked here).
    """
    events = []
    for path in sorted(glob.glob(os.path.join(run_dir, "tb", "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            payload = data[pos + 12 : pos + 12 + length]
            pos += 12 + length + 4
            event = event_pb2.Event()
            event.ParseFromString(payload)
            events.append(event)
    return events


def _tb_scalars(run_dir):
    return [(e.step, v.tag, v.simple_value) for e in _tb_events(run_dir) for v in e.summary.value]


def test_log_writes_sorted_lines_with_plain_types(tmp_path):
    with metrics.MetricsLogger(tmp_path) as log:
        log.log(
            0,
            {
                "reward_mean": np.float32(0.25),
                "loss": jnp.asarray(1.5, jnp.bfloat16),
                "tokens": np.int64(1200),
                "grad_norm": jnp.asarray(2.0),
                "eval/accuracy": 0.5,
                "dropped": True,
            },
        )
        log.log(1, {"reward_mean": 0.75, "kl": float("nan"), "len": float("inf")})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert list(first) == sorted(first)  # keys sorted on disk
    assert first == {
        "step": 0,
        "reward_mean": 0.25,
        "loss": 1.5,
        "tokens": 1200,
        "grad_norm": 2.0,
        "eval/accuracy": 0.5,
        "dropped": 1,
    }
    assert isinstance(first["tokens"], int) and isinstance(first["loss"], float)
    # Strict JSON: non-finite values are null, never the NaN/Infinity tokens.
    assert "NaN" not in lines[1] and "Infinity" not in lines[1]
    assert json.loads(lines[1]) == {"step": 1, "reward_mean": 0.75, "kl": None, "len": None}
    assert metrics.read_metrics(tmp_path) == [first, json.loads(lines[1])]


def test_tensorboard_scalars(tmp_path):
    with metrics.MetricsLogger(tmp_path) as log:
        log.log(3, {"reward_mean": 0.5, "kl": float("nan")})
        log.log(4, {"reward_mean": 0.75})
    scalars = _tb_scalars(tmp_path)
    assert [(s, t) for s, t, _ in scalars] == [(3, "kl"), (3, "reward_mean"), (4, "reward_mean")]
    assert math.isnan(scalars[0][2])
    # 0.5 and 0.75 are exact in float32.
    assert [v for _, _, v in scalars[1:]] == [0.5, 0.75]


def test_no_tensorboard(tmp_path):
    with metrics.MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(0, {"a": 1})
    assert not (tmp_path / "tb").exists()
    assert metrics.read_metrics(tmp_path) == [{"step": 0, "a": 1}]


def test_lines_are_flushed_while_open(tmp_path):
    log = metrics.MetricsLogger(tmp_path)
    log.log(0, {"a": 1.0})
    # Another reader sees the line before close().
    assert metrics.read_metrics(tmp_path) == [{"step": 0, "a": 1.0}]
    log.close()


def test_sigkilled_writer_keeps_its_lines(tmp_path):
    child = textwrap.dedent(
        """
        import os, signal, sys
        from jaxrlvr import metrics
        log = metrics.MetricsLogger(sys.argv[1])
        for step in range(3):
            log.log(step, {"reward_mean": step / 4})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", child, str(tmp_path)], timeout=120)
    assert proc.returncode == -signal.SIGKILL
    assert metrics.read_metrics(tmp_path) == [{"step": s, "reward_mean": s / 4} for s in range(3)]


def test_truncate_after_for_resume(tmp_path):
    with metrics.MetricsLogger(tmp_path) as log:
        for step in range(6):
            log.log(step, {"x": float(step)})
    # The resumed run restarts at step 3: lines 3, 4, 5 go, the new 3 and 4 are appended once.
    with metrics.MetricsLogger(tmp_path) as log:
        log.truncate_after(3)
        assert [r["step"] for r in metrics.read_metrics(tmp_path)] == [0, 1, 2]
        log.log(3, {"x": 30.0})
        log.log(4, {"x": 40.0})
    records = metrics.read_metrics(tmp_path)
    assert [(r["step"], r["x"]) for r in records] == [
        (0, 0.0),
        (1, 1.0),
        (2, 2.0),
        (3, 30.0),
        (4, 40.0),
    ]
    # TensorBoard was told to purge steps >= 3: a SessionLog START at step 3 in a new file.
    starts = [
        e.step
        for e in _tb_events(tmp_path)
        if e.HasField("session_log") and e.session_log.status == e.session_log.START
    ]
    assert starts == [3]


def test_partial_last_line_from_a_kill(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "a": 1}\n{"step": 1, "a"')
    assert metrics.read_metrics(tmp_path) == [{"step": 0, "a": 1}]
    with metrics.MetricsLogger(tmp_path, tensorboard=False) as log:
        log.log(1, {"a": 2})
    assert metrics.read_metrics(tmp_path) == [{"step": 0, "a": 1}, {"step": 1, "a": 2}]
    path.write_text('{"step": 0}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON line"):
        metrics.read_metrics(tmp_path)


def test_write_summary(tmp_path):
    with metrics.MetricsLogger(tmp_path, tensorboard=False) as log:
        path = log.write_summary(
            {"accuracy_sft": 0.25, "accuracy_rl": 0.5, "final_kl": float("nan"), "steps": 10}
        )
    assert path == os.path.join(tmp_path, "summary.json")
    with open(path) as f:
        assert json.load(f) == {
            "accuracy_rl": 0.5,
            "accuracy_sft": 0.25,
            "final_kl": None,
            "steps": 10,
        }
    assert metrics.read_metrics(tmp_path / "missing") == []


def test_bad_input(tmp_path):
    with metrics.MetricsLogger(tmp_path, tensorboard=False) as log:
        with pytest.raises(TypeError, match="metric 'v' must be a real scalar"):
            log.log(0, {"v": np.ones(3)})
        with pytest.raises(TypeError, match="metric 's'"):
            log.log(0, {"s": "text"})
        with pytest.raises(ValueError, match="'step' is reserved"):
            log.log(0, {"step": 1})
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            log.log(-1, {})
        with pytest.raises(ValueError, match="step must be an int >= 0"):
            log.log(1.5, {})
    assert metrics.read_metrics(tmp_path) == []  # nothing half-written
    with pytest.raises(RuntimeError, match="closed"):
        log.log(0, {})


def test_phase_timer():
    timer = metrics.PhaseTimer()
    with timer.phase("sample"):
        time.sleep(0.02)
    with timer.phase("update"):
        time.sleep(0.01)
    with timer.phase("sample"):  # accumulates
        time.sleep(0.02)
    with pytest.raises(ZeroDivisionError), timer.phase("reward"):
        1 / 0  # noqa: B018 -- the time is still recorded
    out = timer.collect()
    assert set(out) == {"time/sample_s", "time/update_s", "time/reward_s"}
    # Lower bounds only: sleep() lasts at least as long as asked; no upper bound (shared CPUs).
    assert out["time/sample_s"] >= 0.04
    assert out["time/update_s"] >= 0.01
    assert out["time/reward_s"] >= 0.0
    assert timer.collect() == {}  # collect() starts over
    with timer.phase("a"), pytest.raises(RuntimeError, match="already being timed"):
        with timer.phase("a"):
            pass


def test_length_by_outcome():
    out = metrics.length_by_outcome([4, 10, 6, 20], np.array([1.0, 0.0, 1.0, 0.0]), prefix="e/")
    assert out == {"e/response_length_correct_mean": 5.0, "e/response_length_incorrect_mean": 15.0}
    none_right = metrics.length_by_outcome([3, 5], [False, False])
    assert math.isnan(none_right["response_length_correct_mean"])
    assert none_right["response_length_incorrect_mean"] == 4.0
    with pytest.raises(ValueError, match="3 lengths, 2 flags"):
        metrics.length_by_outcome([1, 2, 3], [1, 0])


def test_tensorboard_writer_does_not_import_torch_and_torch_still_imports(tmp_path):
    """A fresh process opens the TensorBoard writer without loading torch (seconds of start-up),
    its scalars are written, and a later ``import torch`` still works."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from jaxrlvr import metrics\n"
        f"with metrics.MetricsLogger({str(tmp_path)!r}) as log:\n"
        "    log.log(3, {'reward': 0.25})\n"
        "print('torch' in sys.modules)\n"
        "import torch\n"
        "print(torch.ones(2).sum().item())\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "2.0"]
    assert _tb_scalars(tmp_path) == [(3, "reward", 0.25)]
