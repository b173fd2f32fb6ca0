"""Pieces the benchmarks share: reference model shapes, timing, peak RSS, worker processes, JSON.

- Shapes are ``ModelConfig`` factories (float32, untied, 512 positions unless overridden):
  ``update_ref`` (issue 4's GRPO-update shape, ~31M params), ``sampler_ref`` (issue 5's rollout
  and weight-sync shape, ~7M params) and ``tiny``; ``hf_kwargs`` turns one into the
  ``transformers.Qwen2Config`` arguments for a random transformers model of the same size.
  They import ``jaxrlvr.model`` (so JAX) when called, not when this module is imported: the
  torch-only workers never call them, so JAX does not count towards their peak RSS.
- ``run_worker`` runs one system in a fresh ``python -m MODULE`` process (so its peak RSS is its
  own) on one real CPU device, and reads back the JSON record the worker wrote to ``--_out``.

Deliberately left out: the systems themselves and their tables; each benchmark keeps its own.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jaxrlvr.model import config as model_config

# The size fields of a Qwen2 config, in the order `qwen2` takes them.
_SIZES = tuple(
    "vocab_size hidden_size intermediate_size "
    "num_hidden_layers num_attention_heads num_key_value_heads".split()
)


def qwen2(
    *, vocab: int, hidden: int, mlp: int, layers: int, heads: int, kv_heads: int, **overrides
) -> model_config.ModelConfig:
    """A float32, untied, 512-position ``ModelConfig`` of this size; ``overrides`` win."""
    from jaxrlvr.model import config as model_config

    sizes = dict(zip(_SIZES, (vocab, hidden, mlp, layers, heads, kv_heads)))
    defaults = dict(max_position_embeddings=512, tie_word_embeddings=False)  # dtypes: float32
    return model_config.ModelConfig(**(sizes | defaults | overrides))


def update_ref(**overrides) -> model_config.ModelConfig:
    """Issue 4's update shape: vocab 8192, hidden 512, 8 layers, 8/2 heads, ~31M params."""
    return qwen2(vocab=8192, hidden=512, mlp=1408, layers=8, heads=8, kv_heads=2, **overrides)


def sampler_ref(**overrides) -> model_config.ModelConfig:
    """Issue 5's sampler shape: vocab 8192, hidden 256, 4 layers, 4/2 heads, ~7M params."""
    return qwen2(vocab=8192, hidden=256, mlp=704, layers=4, heads=4, kv_heads=2, **overrides)


def tiny(**overrides) -> model_config.ModelConfig:
    """A tied ~0.1M-parameter model for runs of seconds (vocab 512, hidden 64, 2 layers)."""
    overrides = dict(tie_word_embeddings=True) | overrides
    return qwen2(vocab=512, hidden=64, mlp=128, layers=2, heads=4, kv_heads=2, **overrides)


def hf_kwargs(cfg: model_config.ModelConfig) -> dict[str, Any]:
    """``transformers.Qwen2Config`` arguments for a model of ``cfg``'s size and positions."""
    out = {k: getattr(cfg, k) for k in _SIZES}
    out.update(
        tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
    )
    return out


def peak_rss_mib() -> float:
    """This process's peak resident set size so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def timed_calls(fn: Callable[[], Any], repeats: int) -> list[float]:
    """Wall seconds of each of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    return statistics.median(timed_calls(fn, repeats))


class WorkerError(RuntimeError):
    """A worker process that failed or wrote no record."""


def worker_env() -> dict[str, str]:
    """The environment for a worker: CPU JAX unless set, one device (not the tests' 8 fake)."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    env.pop("XLA_FLAGS", None)
    return env


def run_worker(module: str, argv: Sequence[str], *, capture_output: bool = False) -> dict:
    """Runs ``python -m module *argv --_out PATH`` and returns the JSON record it wrote to PATH.

    The worker writes its record with ``save_json(args._out, record)``. With ``capture_output``
    the worker's output is kept out of the terminal and its tail goes into the ``WorkerError``.
    """
    with tempfile.TemporaryDirectory(prefix="jaxrlvr-bench-worker-") as tmp:
        out = os.path.join(tmp, "record.json")
        cmd = [sys.executable, "-m", module, *argv, "--_out", out]
        proc = subprocess.run(cmd, capture_output=capture_output, text=True, env=worker_env())
        if proc.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                return json.load(f)
    tail = (proc.stderr or proc.stdout or "")[-2000:]
    raise WorkerError(f"exit {proc.returncode}: {tail}")


def save_json(path: str | None, obj: Any) -> None:
    """Writes ``obj`` to ``path`` as indented JSON; nothing when ``path`` is None (no --json)."""
    if path:
        with open(path, "w") as f:
            json.dump(obj, f, indent=2)
