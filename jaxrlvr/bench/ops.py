"""Where a short training run's XLA time goes, by program and by op class.

``jaxrlvr bench ops [--config C] [--sft-steps N] [--rl-steps M] [--set key=value ...]
[--json PATH]`` runs ``jaxrlvr train``'s own loop (``train.run``) on a config, shortened (N SFT
steps, M RL steps, evaluations only at the phases' ends, no checkpoints), under
``jax.profiler.trace`` (no Python tracer), and sums the XLA:CPU thunk events by the program that
ran them (each event's ``hlo_module``: ``jit_`` + the jitted function's name: the SFT step and
the GRPO update, the old/reference log-prob pass, the sampler's generate with its prefill and
decode loop) and by op class (``bench.update.op_kind``: matmul fusions, elementwise, copies,
zero-filled broadcasts, gathers, scatters, sorts, the scan's slices, while loops). A program's
calls are its executions (the events' ``run_id``); programs that share a name (the SFT step and
the GRPO update are both ``jit_update``; the rollouts' and the evaluation's generate) are told
apart by the ops they ran and numbered in the order they first ran (one function compiled for
two shapes whose ops have the same names counts as one program). So every program a run
executes is profiled as the trainer runs it, with its real shapes, instead of one program at a
benchmark's shape (``bench update --op-classes``).

Thread times are summed (both cores count), so a program's milliseconds can exceed its wall
time; compile time is not in the trace's thunk events. The first calls of each program are
included (their execution only). Used for the MoE demo beside the dense one (docs/moe.md).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import sys
import tempfile

from jaxrlvr.bench import common, update


def profile(events: list[dict]) -> dict[str, dict]:
    """Per program: ``calls`` (executions: the events' ``run_id``) and milliseconds by op class
    (``ms``), from a Chrome-trace event list. Programs that share a name (``jit_update`` is the
    SFT step and the GRPO update) are told apart by the ops they ran and numbered by first
    execution: ``jit_update#1`` ran first (the SFT phase's), ``#2`` next."""
    runs: dict[str, dict] = {}
    for e in events:
        args = e.get("args") or {}
        module = args.get("hlo_module")
        kind = update.op_kind(e.get("name", "")) if e.get("ph") == "X" else None
        if not module or not kind:
            continue
        run = runs.setdefault(
            args.get("run_id", ""),
            {"module": module, "t0": e["ts"], "ops": set(), "ms": collections.Counter()},
        )
        run["t0"] = min(run["t0"], e["ts"])
        run["ops"].add(args.get("hlo_op", e.get("name", "")))
        run["ms"][kind] += e["dur"] / 1000
    variants: dict[str, list[frozenset]] = collections.defaultdict(list)
    out: dict[str, dict] = {}
    for run in sorted(runs.values(), key=lambda r: r["t0"]):
        module, ops = run["module"], frozenset(run["ops"])
        if ops not in variants[module]:
            variants[module].append(ops)
        key = (module, variants[module].index(ops) + 1)
        rec = out.setdefault(key, {"calls": 0, "ms": collections.Counter()})
        rec["calls"] += 1
        rec["ms"].update(run["ms"])
    return {
        (m if len(variants[m]) == 1 else f"{m}#{i}"): {
            "calls": r["calls"],
            "ms": dict(r["ms"]),
            "total_ms": sum(r["ms"].values()),
        }
        for (m, i), r in out.items()
    }


def trace(fn) -> list[dict]:
    """The Chrome-trace events of ``fn()`` run under ``jax.profiler.trace``, without the Python
    tracer (its events, every builtin call while tracing, fill the profiler's buffer of ~1M
    events before the programs' own)."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.enable_hlo_proto = False
    with tempfile.TemporaryDirectory(prefix="bench-ops-trace-") as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True, profiler_options=options):
            fn()
        (path,) = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            return json.load(f)["traceEvents"]


def run_traced(config: str, overrides: list[str]) -> dict[str, dict]:
    """``train.run`` on ``config`` + ``overrides`` under the profiler; its profile by program."""
    from jaxrlvr import config as config_lib
    from jaxrlvr import train

    with tempfile.TemporaryDirectory(prefix="bench-ops-") as tmp:
        cfg = config_lib.load_config(
            config,
            [
                f"run.out_dir={tmp}/run",
                "run.progress=false",
                "run.tensorboard=false",
                "eval.at_start=false",
                "eval.every=1000000",
                "checkpoint.every=1000000",
                *overrides,
            ],
        )
        return profile(trace(lambda: train.run(cfg)))


KINDS = ("matmul", "elementwise", "copy", "broadcast", "gather", "scatter", "sort", "scan_slices",
         "while")  # fmt: skip


def table(programs: dict[str, dict], top: int = 12) -> str:
    """Markdown: the ``top`` programs by total time; per call, and the op classes' shares."""
    head = "| program | calls | ms / call | total ms | " + " | ".join(KINDS) + " |"
    lines = [head, "|" + "---|" * (4 + len(KINDS))]
    ranked = sorted(programs.items(), key=lambda kv: -kv[1]["total_ms"])[:top]
    for name, p in ranked:
        total = p["total_ms"] or 1.0
        shares = " | ".join(f"{100 * p['ms'].get(k, 0.0) / total:.0f} %" for k in KINDS)
        per_call = p["total_ms"] / p["calls"] if p["calls"] else float("nan")
        lines.append(
            f"| `{name}` | {p['calls']} | {per_call:.1f} | {p['total_ms']:.0f} | {shares} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="jaxrlvr bench ops", description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/demo_moe.yaml")
    p.add_argument("--sft-steps", type=int, default=20)
    p.add_argument("--rl-steps", type=int, default=10)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--json", default=None, help="write the per-program record here")
    args = p.parse_args(argv)
    if args.sft_steps < 0 or args.rl_steps < 0:
        p.error("--sft-steps and --rl-steps must be >= 0")
    config = args.config
    if not os.path.isabs(config) and not os.path.exists(config):
        config = os.path.join(common.REPO, config)
    overrides = [f"sft.steps={args.sft_steps}", f"rl.steps={args.rl_steps}", *args.set]
    programs = run_traced(config, overrides)
    print(f"bench ops: {args.config} ({' '.join(overrides)})")
    print(table(programs))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.config, "overrides": overrides, "programs": programs}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
