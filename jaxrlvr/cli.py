"""The ``jaxrlvr`` command line: train, sft, eval, pairs, plot, export, bench, curate, serve-vllm.

Each sub-command parses its own flags and hands over to the module that does the work. Errors a
user can fix (a bad config key, a missing file or checkpoint, an unsafe bind address) print one
line, ``jaxrlvr <command>: error: ...``, and exit with status 2, without a traceback; a checkpoint
that cannot be written or read (``checkpoint.CheckpointError``) exits with status 1. eval and
export check what they will read (``preflight``) before building anything.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import os
import sys

BENCHMARKS = ("update", "sampler", "sync", "forward", "rewards", "memory", "loop", "ops")

# glibc malloc settings for the commands that run XLA:CPU programs. Without them every call of
# a compiled program maps its temporary buffers afresh (large allocations are mmap'd, and a
# worker thread's arena cannot hold them), and the kernel zero-fills each page on first touch:
# 54,000 page faults and ~120 ms of system time per step of the demo's GRPO update, about a third
# of its CPU time. One arena, mmap only above 1 GiB and no trimming below 1 GiB keep freed
# buffers in the heap for the next call (2,700 faults per step). glibc reads them at start-up, so
# the command line re-executes itself once with them set. JAXRLVR_MALLOC=off leaves the
# environment alone; any of the variables already set is kept as set.
MALLOC_ENV = {
    "MALLOC_ARENA_MAX": "1",
    "MALLOC_MMAP_THRESHOLD_": str(2**30),
    "MALLOC_TRIM_THRESHOLD_": str(2**30),
}
# jemalloc, where the system has it (``apt install libjemalloc2``; or JAXRLVR_JEMALLOC=PATH),
# is preloaded as well, with freed pages kept (no decay: the same reason as glibc's settings
# above). A cold run compiles in two thirds of the time (LLVM allocates a lot), and its steps
# no longer slow down after the compiles: in glibc's single heap the compiles' leftovers make
# every later large allocation search longer free lists (``_int_malloc``: 0.8 % of a warm GRPO
# phase's CPU samples, 6.6 % of a cold one's; docs/moe.md). JAXRLVR_JEMALLOC=off: glibc only.
JEMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
)
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"
MALLOC_COMMANDS = ("train", "sft", "eval", "pairs", "export", "bench")
_MALLOC_MARK = "JAXRLVR_MALLOC_SET"  # the variables this re-exec added (bench peers drop them)


def jemalloc_path(environ) -> str | None:
    """The jemalloc library to preload: ``JAXRLVR_JEMALLOC`` (a path, or off), else the first
    of ``JEMALLOC_PATHS`` that exists; None: glibc's malloc alone."""
    chosen = environ.get("JAXRLVR_JEMALLOC", "")
    if chosen.lower() in ("off", "0", "false"):
        return None
    candidates = (chosen,) if chosen else JEMALLOC_PATHS
    return next((p for p in candidates if os.path.isfile(p)), None)


def malloc_env(environ) -> dict[str, str] | None:
    """``environ`` with ``MALLOC_ENV`` added, and jemalloc preloaded where there is one
    (``jemalloc_path``: ``LD_PRELOAD`` and ``MALLOC_CONF``), with the mark of what was added; or
    None when there is nothing to do: JAXRLVR_MALLOC=off, already re-executed, or not glibc
    Linux. A variable already set is kept as set (a user's ``LD_PRELOAD`` too: no jemalloc)."""
    import platform

    off = environ.get("JAXRLVR_MALLOC", "").lower() in ("off", "0", "false")
    if off or _MALLOC_MARK in environ:
        return None
    if sys.platform != "linux" or platform.libc_ver()[0] != "glibc":
        return None
    wanted = dict(MALLOC_ENV)
    if (jemalloc := jemalloc_path(environ)) is not None:
        wanted.update(LD_PRELOAD=jemalloc, MALLOC_CONF=JEMALLOC_CONF)
    added = {k: v for k, v in wanted.items() if k not in environ}
    return {**environ, **added, _MALLOC_MARK: ",".join(added)}


def without_malloc_env(environ) -> dict[str, str]:
    """``environ`` without the malloc variables this command line added (a peer system run by a
    benchmark gets the environment its users have)."""
    env = dict(environ)
    for key in env.pop(_MALLOC_MARK, "").split(","):
        env.pop(key, None)
    return env


def _train_parser(prog: str, help_text: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=help_text)
    p.add_argument("config", help="YAML config (see configs/)")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. rl.steps=10")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in an out_dir that holds a run (its files move to out_dir/previous-*)",
    )
    multi = p.add_argument_group(
        "multi-process (one JAX process per host; docs/multihost.md)",
        "each flag falls back to its env var, then to SLURM (srun) or Kubernetes "
        "(JOB_COMPLETION_INDEX); --num-processes 1 or none of them: one process",
    )
    multi.add_argument(
        "--coordinator", metavar="HOST:PORT", help="process 0's address (env JAXRLVR_COORDINATOR)"
    )
    multi.add_argument(
        "--num-processes",
        type=int,
        metavar="N",
        help="processes in the job (JAXRLVR_NUM_PROCESSES)",
    )
    multi.add_argument(
        "--process-id", type=int, metavar="I", help="this process, 0..N-1 (JAXRLVR_PROCESS_ID)"
    )
    multi.add_argument(
        "--distributed-auto",
        action="store_true",
        help="leave it all to JAX's cluster detection: Open MPI, TPU, Kubernetes API, SLURM "
        "(JAXRLVR_DISTRIBUTED=auto); under srun no flag is needed",
    )
    return p


def _cmd_train(argv, *, sft_only=False):
    from jaxrlvr import config as config_lib
    from jaxrlvr import train

    name = "jaxrlvr sft" if sft_only else "jaxrlvr train"
    args = _train_parser(name, "Run a training job from a YAML config.").parse_args(argv)
    overrides = list(args.overrides)
    if sft_only:
        overrides.append("rl.algo=none")
    cfg = config_lib.load_config(args.config, overrides)
    from jaxrlvr import distributed

    cfg = dataclasses.replace(
        cfg,
        distributed=distributed.from_flags(
            cfg.distributed,
            coordinator=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
            auto=args.distributed_auto,
        ),
    )
    try:
        summary = train.run(cfg, resume=args.resume, overwrite=args.overwrite)
    except Exception as e:
        # Several processes: one line naming a lost process, exit 1 (returns otherwise).
        distributed.report_failure(e)
        raise
    return 0 if summary is not None else 1


def _cmd_eval(argv):
    from jaxrlvr import config as config_lib
    from jaxrlvr import evaluation

    p = argparse.ArgumentParser(prog="jaxrlvr eval", description="Evaluate a model or checkpoint.")
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", help="run directory whose newest checkpoint is evaluated")
    _eval_flags(p)
    args = p.parse_args(argv)
    problems, bench_overrides = None, []
    if args.benchmark is not None:
        from jaxrlvr.data import benchmarks

        problems, _ = benchmarks.load_benchmark(args.benchmark, args.benchmark_file)
        bench_overrides = benchmarks.reward_overrides(args.benchmark)
    cfg = config_lib.load_config(
        args.config, [*args.overrides, *bench_overrides, *eval_overrides(args)]
    )
    sampled = (
        args.report is not None
        or args.plot is not None
        or cfg.eval.pass_k
        or cfg.eval.maj_k
        or problems is not None
    )
    if not sampled:  # the plain held-out metrics, as before
        result = evaluation.evaluate_only(cfg, run_dir=args.checkpoint)
        _print_metrics(result)
        return 0
    result, rows = evaluation.evaluate_only_detailed(
        cfg,
        run_dir=args.checkpoint,
        chunk=args.chunk,
        progress=not args.no_progress,
        problems=problems,
    )
    _print_metrics(result)
    heads = [f"pass@{k}" for k in cfg.eval.pass_k] + [f"maj@{k}" for k in cfg.eval.maj_k]
    print(
        "  ".join(f"{h} {result[f'eval/{h}']:.4f} +- {result[f'eval/{h}_se']:.4f}" for h in heads)
    )
    where = args.checkpoint or cfg.run.out_dir
    report_path = args.report or os.path.join(where, "eval", "report.json")
    meta = {
        "config": args.config,
        "benchmark": args.benchmark,
        "checkpoint": args.checkpoint,
        "model": cfg.model.path,
        "sampler": cfg.sampler.kind,
        "temperature": cfg.sampler.eval_temperature,
        "top_p": cfg.sampler.eval_top_p,
        "max_tokens": cfg.sampler.eval_max_tokens or cfg.sampler.max_tokens,
        "seed": cfg.run.seed,
        "samples_per_problem": cfg.eval.samples_per_problem,
        "pass_k": list(cfg.eval.pass_k),
        "maj_k": list(cfg.eval.maj_k),
    }
    report = evaluation.write_report(report_path, result, rows, meta=meta)
    print(f"wrote {report_path}")
    if rows:
        from jaxrlvr import plots

        plot_path = args.plot or os.path.splitext(report_path)[0] + "_pass_at_k.png"
        label = os.path.basename(os.path.normpath(where))
        plots.write_pass_at_k_plot(plot_path, [plots.curve_of_report(report, label=label)])
        print(f"wrote {plot_path}")
    return 0


def _eval_flags(p: argparse.ArgumentParser) -> None:
    from jaxrlvr.data import benchmarks

    g = p.add_argument_group(
        "sampled metrics (docs/evaluation.md); each flag sets the config key named in its help"
    )
    g.add_argument("--model", help="a Hugging Face folder to evaluate (model.path)")
    g.add_argument("--samples", type=int, help="samples per problem n (eval.samples_per_problem)")
    g.add_argument("--k", help="pass@k for these k, e.g. 1,4,16,64 (eval.pass_k)")
    g.add_argument("--maj", help="maj@k for these k, e.g. 8,64 (eval.maj_k)")
    g.add_argument("--temperature", type=float, help="sampler.eval_temperature")
    g.add_argument("--top-p", type=float, help="sampler.eval_top_p")
    g.add_argument("--max-tokens", type=int, help="sampler.eval_max_tokens")
    g.add_argument("--max-problems", type=int, help="eval.max_problems")
    g.add_argument(
        "--vllm-url", help="sample from this vLLM server (sampler.kind=vllm, sampler.vllm_urls)"
    )
    g.add_argument(
        "--benchmark",
        choices=tuple(benchmarks.BENCHMARKS),
        help="evaluate on this benchmark's problems (data.benchmarks) with its verifier",
    )
    g.add_argument(
        "--benchmark-file", help="the benchmark's local file (humaneval: the package's own)"
    )
    g.add_argument("--report", help="JSON report (default: RUN_DIR/eval/report.json)")
    g.add_argument("--plot", help="pass@k curve PNG (default: beside the report)")
    g.add_argument("--chunk", type=int, default=16, help="problems per sampler call (progress)")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def eval_overrides(args) -> list[str]:
    """The config overrides ``jaxrlvr eval``'s sampling flags stand for (``--k 1,4`` ->
    ``eval.pass_k=[1, 4]``); a bad k list is one line."""
    from jaxrlvr import passk

    out = []
    if args.model is not None:
        out.append(f"model.path={args.model}")
    if args.samples is not None:
        out.append(f"eval.samples_per_problem={args.samples}")
    if args.k is not None:
        out.append(f"eval.pass_k={list(passk.parse_ks(args.k, '--k'))}")
    if args.maj is not None:
        out.append(f"eval.maj_k={list(passk.parse_ks(args.maj, '--maj'))}")
    for flag, key in (
        ("temperature", "sampler.eval_temperature"),
        ("top_p", "sampler.eval_top_p"),
        ("max_tokens", "sampler.eval_max_tokens"),
        ("max_problems", "eval.max_problems"),
    ):
        if getattr(args, flag) is not None:
            out.append(f"{key}={getattr(args, flag)}")
    if args.vllm_url is not None:
        out += ["sampler.kind=vllm", f'sampler.vllm_urls=["{args.vllm_url}"]']
    return out


def _print_metrics(result: dict) -> None:
    for key, value in sorted(result.items()):
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")


def _cmd_pairs(argv):
    from jaxrlvr import config as config_lib
    from jaxrlvr import pairs

    p = argparse.ArgumentParser(
        prog="jaxrlvr pairs",
        description="Sample k completions per training problem, grade them, and write "
        "(correct, incorrect) preference pairs as jsonl (for rl.algo: dpo | ipo | simpo | orpo).",
    )
    p.add_argument("config")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--checkpoint", help="run directory whose newest checkpoint samples")
    p.add_argument("--out", required=True, help="the jsonl file to write")
    p.add_argument("--k", type=int, default=8, help="completions per problem")
    p.add_argument("--pairs-per-problem", type=int, default=1)
    p.add_argument("--max-problems", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    cfg = config_lib.load_config(args.config, args.overrides)
    pairs_cfg = pairs.PairsConfig(
        k=args.k,
        pairs_per_problem=args.pairs_per_problem,
        max_problems=args.max_problems,
        seed=args.seed,
    )
    result = pairs.build_pairs(cfg, args.out, pairs_cfg, run_dir=args.checkpoint)
    for key, value in result.items():
        print(f"{key}: {value:.4f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"wrote {result['pairs']} pairs to {args.out}")
    return 0


def _cmd_export(argv):
    from jaxrlvr import export

    p = argparse.ArgumentParser(
        prog="jaxrlvr export", description="Write a checkpoint as a Hugging Face model folder."
    )
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument(
        "--overwrite", action="store_true", help="replace the model files already in OUT_DIR"
    )
    args = p.parse_args(argv)
    check_export(args.run_dir, args.out_dir, step=args.step, overwrite=args.overwrite)
    path = export.export_checkpoint(args.run_dir, args.out_dir, step=args.step)
    print(f"wrote {path}")
    return 0


def check_export(run_dir: str, out_dir: str, *, step=None, overwrite=False) -> None:
    """Before export builds anything: a complete checkpoint (``step``) in RUN_DIR, its
    config.yaml and what that config reads, and an OUT_DIR that holds no model unless
    ``overwrite`` (so an earlier export is never half-replaced)."""
    import yaml

    from jaxrlvr import config as config_lib
    from jaxrlvr import configlib, preflight, rundir

    rundir.check_checkpoint(run_dir, "export RUN_DIR", step)
    config_path = os.path.join(run_dir, "config.yaml")
    if not os.path.isfile(config_path):
        raise configlib.PreflightError(f"export RUN_DIR {run_dir}: no config.yaml in {run_dir}")
    with open(config_path) as f:
        cfg = configlib.build(config_lib.TrainConfig, yaml.safe_load(f))
    preflight.check(cfg, mode="export", checkpoint=run_dir, step=step)
    if os.path.isdir(out_dir) and not overwrite:
        held = sorted(n for n in os.listdir(out_dir) if n.endswith((".safetensors", ".json")))
        if held:
            raise configlib.PreflightError(
                f"export OUT_DIR {out_dir}: already holds a model ({', '.join(held[:4])}); pass "
                "--overwrite to replace it"
            )
    elif os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise configlib.PreflightError(f"export OUT_DIR {out_dir}: is a file")


def _cmd_plot(argv):
    from jaxrlvr import plots

    return plots.plot_main(argv) or 0


def _cmd_bench(argv):
    if not argv or argv[0] in ("-h", "--help"):
        print(f"usage: jaxrlvr bench {{{','.join(BENCHMARKS)}}} [--json PATH] [options]")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        raise SystemExit(f"jaxrlvr bench: unknown benchmark {name!r} (choose from {BENCHMARKS})")
    module = importlib.import_module(f"jaxrlvr.bench.{name}")
    return module.main(rest) or 0


def _cmd_curate(argv):
    from jaxrlvr import curate

    return curate.curate_main(argv)


def _cmd_serve_vllm(argv):
    from jaxrlvr.sampling import vllm_server

    return vllm_server.serve_vllm_main(argv) or 0


COMMANDS = {
    "train": _cmd_train,
    "sft": lambda argv: _cmd_train(argv, sft_only=True),
    "eval": _cmd_eval,
    "pairs": _cmd_pairs,
    "plot": _cmd_plot,
    "export": _cmd_export,
    "bench": _cmd_bench,
    "curate": _cmd_curate,
    "serve-vllm": _cmd_serve_vllm,
}


def main(argv: list[str] | None = None) -> int:
    from_command_line = argv is None  # (in-process callers, e.g. tests, are never re-executed)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: jaxrlvr {" + ",".join(COMMANDS) + "} ...")
        print("  train CONFIG [key=value ...] [--resume | --overwrite]  RL (and SFT) from a config")
        print(
            "  sft CONFIG [key=value ...] [--resume | --overwrite]    supervised fine-tuning only"
        )
        print(
            "  eval CONFIG [--checkpoint RUN_DIR | --model DIR] [--samples N --k 1,4 --maj 8]"
            "  pass@k, maj@k"
        )
        print("  pairs CONFIG --out FILE [--checkpoint RUN_DIR] [--k K]  graded preference pairs")
        print("  plot RUN_DIR [RUN_DIR ...] [--out DIR]    PNG curves, runs overlaid")
        print(
            "  export RUN_DIR OUT_DIR [--step N] [--overwrite]  checkpoint -> Hugging Face folder"
        )
        print("  bench NAME [--json PATH]                  " + "|".join(BENCHMARKS))
        print("  curate CONFIG [key=value ...] --out DIR   decontaminate and filter data before RL")
        print(
            "  serve-vllm --model DIR [--python PATH] [--gpus 0,1 --num-servers N]  vLLM server(s)"
        )
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"jaxrlvr: unknown command {command!r} (choose from {', '.join(COMMANDS)})")
        return 2
    if from_command_line and command in MALLOC_COMMANDS:
        env = malloc_env(os.environ)
        if env is not None:  # re-executes this same command line with glibc's settings
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    from jaxrlvr import checkpoint, configlib
    from jaxrlvr.sampling import base as sampling_base

    try:
        return COMMANDS[command](rest)
    except configlib.ConfigKeyError as e:
        print(f"jaxrlvr {command}: config error: {_one_line(e)}", file=sys.stderr)
        return 2
    except (checkpoint.CheckpointError, sampling_base.SamplerError) as e:
        print(f"jaxrlvr {command}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except (FileNotFoundError, ValueError) as e:
        # PreflightError, model ConfigError, UnsafeBindError are ValueErrors.
        print(f"jaxrlvr {command}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
