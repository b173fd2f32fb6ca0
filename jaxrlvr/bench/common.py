"""Pieces the benchmarks share: reference model shapes, timing, peak RSS, worker processes, JSON.

- Shapes are ``ModelConfig`` factories (float32, untied, 512 positions unless overridden):
  ``update_ref`` (issue 4's GRPO-update shape, ~31M params), ``moe_ref`` (its Qwen3-MoE
  counterpart: the same attention and vocabulary, 16 experts top-4 of a quarter of its MLP width,
  so a token's active parameters equal ``update_ref``'s), ``sampler_ref`` (issue 5's rollout
  and weight-sync shape, ~7M params) and ``tiny`` (``ModelConfig.tiny``, vocabulary 512);
  ``hf_kwargs`` turns one into the ``transformers.Qwen2Config`` arguments for a random
  transformers model of the same size.
  They import ``jaxrlvr.model`` (so JAX) when called, not when this module is imported: the
  torch-only workers never call them, so JAX does not count towards their peak RSS.
- ``trainer_step`` builds what ``jaxrlvr train`` compiles for a config's RL phase (the record of
  ``registry.build``, the state shardings of ``checkpoint.abstract_state``, and
  ``step.CompiledAlgorithm``), so ``bench update``, ``bench memory`` and the GPU check time and
  measure the trainer's own path.
- ``run_worker`` runs one system in a fresh ``python -m MODULE`` process (so its peak RSS is its
  own) on one real CPU device, and reads back the JSON record the worker wrote to ``--_out``.
- ``parser`` and the ``add_*`` helpers: every ``jaxrlvr bench NAME`` spells the same thing the
  same way: ``--json PATH`` (the records), ``--repeats N`` (timed repetitions, median reported),
  ``--vllm-python PATH`` (the interpreter of a vLLM environment, default env
  ``JAXRLVR_VLLM_PYTHON``), ``--shapes a,b`` and ``--systems a,b`` (comma lists, checked by
  ``comma_list``); ``prog`` is ``jaxrlvr bench NAME`` so ``--help`` and errors name the command.

Deliberately left out: the systems themselves and their tables; each benchmark keeps its own.
"""

from __future__ import annotations

import argparse
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

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

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


def moe_ref(**overrides) -> model_config.ModelConfig:
    """``update_ref`` as a Qwen3-MoE (QK-norm, head_dim 64): 16 experts of width 352, top-4
    renormalised, so a token's active MLP (4 x 352 = 1,408 wide) is ``update_ref``'s; ~84M
    parameters, ~31M active."""
    fields = dict(
        model_type="qwen3_moe",
        num_experts=16,
        num_experts_per_tok=4,
        moe_intermediate_size=352,
        norm_topk_prob=True,
    )
    return qwen2(
        vocab=8192, hidden=512, mlp=1408, layers=8, heads=8, kv_heads=2, **(fields | overrides)
    )


def sampler_ref(**overrides) -> model_config.ModelConfig:
    """Issue 5's sampler shape: vocab 8192, hidden 256, 4 layers, 4/2 heads, ~7M params."""
    return qwen2(vocab=8192, hidden=256, mlp=704, layers=4, heads=4, kv_heads=2, **overrides)


def tiny(**overrides) -> model_config.ModelConfig:
    """``ModelConfig.tiny`` (tied, ~0.1M parameters) with the benchmarks' vocabulary of 512, for
    runs of seconds."""
    from jaxrlvr.model import config as model_config

    return model_config.ModelConfig.tiny(**(dict(vocab_size=512) | overrides))


def train_config(overrides: Sequence[str], path: str | None = None):
    """A ``TrainConfig`` from ``path`` (a YAML under ``configs/``, relative to the checkout; None:
    the defaults) with dotted ``key=value`` overrides, as ``jaxrlvr train`` reads it."""
    from jaxrlvr import config as config_lib

    if path is not None and not os.path.isabs(path):
        path = os.path.join(REPO, path)
    return config_lib.load_config(path, list(overrides))


def trainer_step(cfg, graphdef, params_shape, mesh, *, microbatches: int | None = None):
    """(record, ``step.CompiledAlgorithm``, state shardings) of ``cfg``'s RL phase, built exactly
    as the trainer builds them (``registry.build`` of ``rl.algo`` with ``microbatches``,
    ``checkpoint.abstract_state``)."""
    from jaxrlvr import checkpoint
    from jaxrlvr.algos import registry, step

    algo = registry.build(cfg.rl.algo, cfg, graphdef, params_shape, mesh, microbatches=microbatches)
    _, shardings = checkpoint.abstract_state(algo, params_shape, mesh)
    return algo, step.CompiledAlgorithm(algo, mesh, shardings), shardings


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
    """The environment for a worker: CPU JAX unless set, one device (the tests' 8 fake devices
    dropped from ``XLA_FLAGS``; its other flags, e.g. the tests' -O0 backend, are kept)."""
    env = dict(os.environ)
    env.setdefault("JAX_PLATFORMS", "cpu")
    flags = [
        f
        for f in env.pop("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
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


# ------------------------------------------------------------------------------------------------
# Command line: the flags every benchmark shares, spelled once

VLLM_PYTHON_ENV = "JAXRLVR_VLLM_PYTHON"


def parser(name: str, doc: str | None) -> argparse.ArgumentParser:
    """The parser of ``jaxrlvr bench NAME``: its prog, the doc's first line, and ``--json PATH``."""
    p = argparse.ArgumentParser(
        prog=f"jaxrlvr bench {name}", description=(doc or "").strip().split("\n")[0]
    )
    p.add_argument("--json", metavar="PATH", default=None, help="write the records to this file")
    return p


def add_repeats(p: argparse.ArgumentParser, default: int, what: str = "timed repeats") -> None:
    """``--repeats N`` (>= 1): how many timed repetitions per system; the median is reported."""

    def positive(text: str) -> int:
        n = int(text)
        if n < 1:
            raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
        return n

    p.add_argument(
        "--repeats", metavar="N", type=positive, default=default, help=f"{what} (default {default})"
    )


def add_vllm_python(p: argparse.ArgumentParser, what: str = "") -> None:
    """``--vllm-python PATH``: the python of a vLLM environment (``scripts/setup_vllm.sh``),
    default env ``JAXRLVR_VLLM_PYTHON``."""
    p.add_argument(
        "--vllm-python",
        metavar="PATH",
        default=os.environ.get(VLLM_PYTHON_ENV),
        help=f"python of a vLLM environment{what} (default: env {VLLM_PYTHON_ENV})",
    )


def comma_list(p: argparse.ArgumentParser, flag: str, value: str, allowed) -> list[str]:
    """The non-empty items of a comma list, each checked against ``allowed`` (``p.error``
    names the flag and the choices otherwise)."""
    items = [s for s in value.split(",") if s]
    for item in items:
        if item not in allowed:
            p.error(f"{flag}: {item!r} is not one of {', '.join(allowed)}")
    if not items:
        p.error(f"{flag}: empty list (choose from {', '.join(allowed)})")
    return items
