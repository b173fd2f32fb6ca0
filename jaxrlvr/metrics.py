"""Run metrics on disk: ``metrics.jsonl`` (one JSON line per step), TensorBoard scalars, a summary.

A run directory gets:

- ``metrics.jsonl``: one line per :meth:`MetricsLogger.log` call, ``{"step": N, ...}`` with keys
  sorted. Values are JSON numbers: ints stay ints, everything else becomes a Python float, and
  non-finite values (NaN, +-inf) are written as ``null``, because strict JSON has no NaN and a
  diverged step should stay readable by every JSON tool. Each line is flushed as it is written,
  so a run killed with SIGKILL keeps every line it logged.
- ``tb/``: the same scalars as TensorBoard event files (tensorboardX), NaN and inf included, as
  TensorBoard can show them.
- ``summary.json``: whatever the driver hands :meth:`MetricsLogger.write_summary` at the end.

Resuming: call :meth:`MetricsLogger.truncate_after` with the first step the resumed run will log;
lines from that step on are dropped (the killed run may have logged past its last checkpoint), and
TensorBoard is told to purge its events from that step on, so neither holds duplicates.

:class:`PhaseTimer` measures wall-clock seconds per phase of a step (``time/sample_s``, ...).

Left out on purpose: multi-host coordination (the driver creates the logger on process 0 only),
the progress bar (the driver's tqdm), and plotting (``jaxrlvr.plots``).
"""

import contextlib
import json
import math
import numbers
import os
import time
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
TB_DIR = "tb"


def _scalar(key: str, value: Any) -> int | float:
    """A metric value as a Python int or float (numpy and 0-d JAX arrays included)."""
    if isinstance(value, bool | np.bool_):
        return int(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):  # numpy / JAX arrays
        arr = np.asarray(value)
        if arr.shape == ():
            if arr.dtype.kind in "biu":
                return int(arr)
            if arr.dtype.kind in "fV":  # "V": ml_dtypes such as bfloat16
                with contextlib.suppress(TypeError, ValueError):
                    return float(arr)
    raise TypeError(
        f"metric {key!r} must be a real scalar (int, float, or a 0-d array), "
        f"got {type(value).__name__} {getattr(value, 'shape', '')}"
    )


def _json_value(value: Any) -> Any:
    """Non-finite floats -> None, recursively; everything else unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_value(v) for v in value]
    return value


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _drop_partial_last_line(path: str) -> None:
    """Cuts an unterminated last line (a writer killed mid-line) so appends start clean."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        data = f.read()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        _write_atomic(path, data[:cut].decode("utf-8"))


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The lines of ``run_dir/metrics.jsonl`` as dicts, in file order ([] if there is no file).

    Non-finite values come back as None. A final line cut short by a kill (no trailing newline,
    not valid JSON) is skipped; a malformed line elsewhere is an error naming file and line.
    """
    path = os.path.join(os.fspath(run_dir), METRICS_FILE)
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:  # the unterminated last line of a killed writer
                continue
            raise ValueError(f"{path}:{i + 1}: not a JSON line ({e.msg})") from None
    return records


def _import_tensorboardx() -> Any:
    """tensorboardX, imported without importing torch.

    tensorboardX's package import pulls in torch when it is installed (1.3-2.3 s of a run's
    start-up here, for nothing: jaxrlvr logs numpy scalars) and falls back to numpy when the import
    fails. Unless torch is already loaded, its import is made to fail for this one import (a
    ``None`` entry in ``sys.modules``) and then allowed again, so a later ``import torch`` (the TRL
    peer, transformers) loads it as usual.
    """
    import sys

    if "tensorboardX" in sys.modules or "torch" in sys.modules:
        import tensorboardX

        return tensorboardX
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` raises ImportError
    try:
        import tensorboardX
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return tensorboardX


class MetricsLogger:
    """Appends per-step scalars to ``run_dir/metrics.jsonl`` and TensorBoard (``run_dir/tb``).

    Use as a context manager or call :meth:`close`. Appends to an existing file, so a resumed run
    continues it (after :meth:`truncate_after`).

    Args:
      run_dir: the run directory (created if missing).
      tensorboard: also write TensorBoard event files under ``run_dir/tb``.
    """

    def __init__(self, run_dir: str | os.PathLike, *, tensorboard: bool = True):
        self.run_dir = os.fspath(run_dir)
        self.tensorboard = tensorboard
        os.makedirs(self.run_dir, exist_ok=True)
        self.path = os.path.join(self.run_dir, METRICS_FILE)
        _drop_partial_last_line(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = self._open_tb() if tensorboard else None

    def _open_tb(self, purge_step: int | None = None) -> Any:
        tensorboardX = _import_tensorboardx()
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        writer = tensorboardX.FileWriter(logdir=os.path.join(self.run_dir, TB_DIR))
        if purge_step is not None:
            # A SessionLog START at purge_step: TensorBoard then hides the earlier events at
            # steps >= purge_step (what tensorboardX's SummaryWriter(purge_step=) writes).
            writer.add_event(Event(step=purge_step, file_version="brain.Event:2"))
            start = SessionLog(status=SessionLog.START)
            writer.add_event(Event(step=purge_step, session_log=start))
        return writer

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Writes one line ``{"step": step, **metrics}`` (keys sorted) and the TensorBoard scalars.

        Args:
          step: the training step (an int >= 0).
          metrics: name -> real scalar (Python, numpy or 0-d JAX); ``"step"`` is reserved.
        """
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
        step = int(step)
        if "step" in metrics:
            raise ValueError("metric name 'step' is reserved for the step number")
        values = {str(k): _scalar(str(k), v) for k, v in metrics.items()}
        record = {"step": step, **{k: _json_value(v) for k, v in values.items()}}
        self._file.write(json.dumps(record, sort_keys=True, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            # One event per step holding every scalar: SummaryWriter.add_scalar per key cost
            # 6.3 ms a step with the demo's 39 keys (a fifth of an SFT step); this, 0.9 ms.
            from tensorboardX.proto.summary_pb2 import Summary

            summary = Summary(
                value=[Summary.Value(tag=k, simple_value=values[k]) for k in sorted(values)]
            )
            self._tb.add_summary(summary, global_step=step)
            self._tb.flush()

    def truncate_after(self, step: int) -> None:
        """Drops logged lines with ``line["step"] >= step``; TensorBoard purges the same range.

        Call it with the first step a resumed run will log, before logging.
        """
        self._file.close()
        records = read_metrics(self.run_dir)
        kept = [json.dumps(r, sort_keys=True) + "\n" for r in records if r["step"] < step]
        _write_atomic(self.path, "".join(kept))
        self._file = open(self.path, "a", encoding="utf-8")
        if self._tb is not None:
            self._tb.close()
            self._tb = self._open_tb(purge_step=step)

    def write_summary(self, summary: Mapping[str, Any]) -> str:
        """Writes ``run_dir/summary.json`` atomically (non-finite as null); returns its path."""
        path = os.path.join(self.run_dir, SUMMARY_FILE)
        text = json.dumps(_json_value(dict(summary)), indent=2, sort_keys=True, allow_nan=False)
        _write_atomic(path, text + "\n")
        return path

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> "MetricsLogger":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def length_by_outcome(lengths: Any, correct: Any, prefix: str = "") -> dict[str, float]:
    """Mean response length of the correct and of the incorrect responses (the Dr. GRPO audit's
    curves): ``{prefix}response_length_correct_mean`` and ``..._incorrect_mean``, NaN (logged
    as null) when a side is empty. ``correct``: 0/1 (or bool) per response, like ``lengths``."""
    lengths = np.asarray(lengths, np.float64).reshape(-1)
    right = np.asarray(correct).reshape(-1) > 0
    if lengths.shape != right.shape:
        raise ValueError(f"length_by_outcome: {lengths.shape[0]} lengths, {right.shape[0]} flags")
    out = {}
    for name, sel in (("correct", right), ("incorrect", ~right)):
        out[f"{prefix}response_length_{name}_mean"] = (
            float(lengths[sel].mean()) if sel.any() else float("nan")
        )
    return out


class PhaseTimer:
    """Wall-clock seconds per named phase: ``with timer.phase("sample"): ...``.

    A phase entered several times accumulates. :meth:`collect` returns
    ``{"time/<phase>_s": seconds}`` and starts over (call it once per step). JAX dispatches work
    asynchronously: block on the phase's outputs (``jax.block_until_ready``) inside the ``with``
    or the time lands in a later phase.
    """

    def __init__(self) -> None:
        self._seconds: dict[str, float] = {}
        self._active: set[str] = set()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if name in self._active:
            raise RuntimeError(f"phase {name!r} is already being timed")
        self._active.add(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self._active.discard(name)
            self._seconds[name] = self._seconds.get(name, 0.0) + time.perf_counter() - start

    @property
    def seconds(self) -> dict[str, float]:
        """Accumulated seconds per phase since the last :meth:`collect` (a copy)."""
        return dict(self._seconds)

    def collect(self) -> dict[str, float]:
        """``{"time/<phase>_s": seconds}`` for the phases timed since the last call; resets."""
        out = {f"time/{name}_s": s for name, s in self._seconds.items()}
        self._seconds = {}
        return out
