"""``jaxrlvr bench loop``: the whole RL loop end to end, several systems in one invocation.

Each row of the table is one system run in its own process on the same task, data splits, model
shape and settings (a jaxrlvr train config, default ``configs/demo.yaml``, plus ``--set``
overrides that every row receives):

1. Warm start (once): ``jaxrlvr sft CONFIG`` (the config's SFT phase), exported to a Hugging Face
   folder with ``jaxrlvr export``; ``--warm-start DIR`` reuses such a folder. Every row's RL
   phase starts from these identical weights.
2. Rows (``ROWS``, extended by ``--row``): ``jaxrlvr`` is the real ``jaxrlvr train`` code path on
   the config with ``model.path=`` the warm start and ``sft.steps=0``; ``trl`` is TRL's
   ``GRPOTrainer`` (``bench.trl_peer``). A row is ``Row(label, system, overrides)``: further
   jaxrlvr variants (another sampler, ``rl.max_staleness=1``, ...) are rows with their own
   overrides, added in ``ROWS`` or with ``--row LABEL:key=value,key=value``.
3. Per row: the step-time breakdown (sample, reward, old/ref log-probs, host shaping, update,
   weight sync, waiting; median seconds per step), GRPO steps/s (steps over the summed step
   times, the first compiling steps included, and over the median step), rollout tokens/s
   (completion tokens over sampling seconds), held-out accuracy (avg@k at the config's eval
   temperature, jaxrlvr's evaluation for every row: same problems, sampler, seed and grader).

Output: ``OUT/loop.md`` (Markdown table) and ``OUT/loop.json`` (records, per-step times),
``--json PATH`` for a copy of the records. ``--steps 20`` is the short mode; the default is the
config's ``rl.steps`` (200 for the demo).

Left out: running rows concurrently (they would share the cores and each other's timings).
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from jaxrlvr.bench import common

SYSTEMS = ("jaxrlvr", "trl")
# The step phases, as jaxrlvr train names them (``time/<phase>_s`` in metrics.jsonl).
PHASES = ("sample", "reward", "logprobs", "shape", "update", "sync", "wait_rollouts")


@dataclasses.dataclass(frozen=True)
class Row:
    """One line of the table: ``system`` run with its own config ``overrides``."""

    label: str
    system: str
    overrides: tuple[str, ...] = ()


ROWS = (Row("jaxrlvr", "jaxrlvr"), Row("trl", "trl"))


def _cli(*argv: str) -> list[str]:
    return [sys.executable, "-m", "jaxrlvr.cli", *argv]


def _run(cmd: list[str], log_path: str, what: str) -> None:
    """Runs ``cmd`` with its output in ``log_path``; one line naming ``what`` on failure."""
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=common.worker_env())
    if proc.returncode != 0:
        with open(log_path) as f:
            tail = f.read()[-1500:]
        raise common.WorkerError(f"{what} failed (exit {proc.returncode}, {log_path}):\n{tail}")


def warm_start(config: str, sets: list[str], out: str) -> str:
    """The config's SFT phase (``jaxrlvr sft``), exported as a Hugging Face folder."""
    run_dir, hf_dir = os.path.join(out, "warm_start"), os.path.join(out, "warm_start_hf")
    overrides = [*sets, f"run.out_dir={run_dir}", "run.progress=false", "run.tensorboard=false"]
    _run(_cli("sft", config, *overrides, "--overwrite"), run_dir + ".log", "warm start (SFT)")
    _run(_cli("export", run_dir, hf_dir, "--overwrite"), hf_dir + ".log", "warm start export")
    return hf_dir


def _summary(steps: list[dict[str, float]], tokens: list[float]) -> dict[str, Any]:
    """Median seconds per phase, steps/s and rollout tokens/s from per-step records."""
    total = sum(s["step"] for s in steps)
    sample = sum(s.get("generate", s["sample"]) for s in steps)
    return {
        "median_s": {k: statistics.median(s.get(k, 0.0) for s in steps) for k in (*PHASES, "step")},
        "total_step_s": total,
        "steps_per_s": len(steps) / total,
        "steps_per_s_median": 1.0 / statistics.median(s["step"] for s in steps),
        "rollout_tokens": sum(tokens),
        "rollout_tokens_per_s": sum(tokens) / sample if sample else float("nan"),
    }


def run_jaxrlvr(
    row: Row, config: str, sets: list[str], warm: str, steps: int, out: str, eval_every: int = 0
) -> dict:
    """The real ``jaxrlvr train`` on the config from the warm start; reads its metrics.jsonl.
    ``eval_every``: held-out evaluations during the run (0: at the start and the end only); they
    run between steps, outside the step times."""
    run_dir = os.path.join(out, row.label)
    overrides = [
        *sets,
        f"model.path={warm}",
        "sft.steps=0",
        f"rl.steps={steps}",
        f"eval.every={eval_every or steps}",
        f"checkpoint.every={steps}",
        f"run.out_dir={run_dir}",
        "run.progress=false",
        "run.tensorboard=false",
        *row.overrides,
    ]
    start = time.perf_counter()
    _run(_cli("train", config, *overrides, "--overwrite"), run_dir + ".log", f"row {row.label}")
    wall = time.perf_counter() - start
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    rl = [m for m in lines if "time/update_s" in m]
    curve = [(m["step"], m["eval/accuracy"]) for m in lines if "eval/accuracy" in m]
    per_step = []
    for m in rl:
        rec = {k: float(m.get(f"time/{k}_s", 0.0)) for k in PHASES}
        rec["step"] = float(m.get("time/step_s", sum(rec.values())))
        # rl.max_staleness > 0: the generation runs on the producer thread (time/generate_s),
        # overlapped with the step; its own seconds give the rollout tokens/s.
        rec["generate"] = float(m.get("time/generate_s", rec["sample"]))
        per_step.append(rec)
    return {
        "label": row.label,
        "system": "jaxrlvr",
        "overrides": list(row.overrides),
        "steps": per_step,
        "process_wall_s": wall,
        "response_tokens": [float(m["tokens/response"]) for m in rl],
        "eval_start": summary.get("eval_accuracy_after_sft"),
        "eval_final": summary.get("eval_accuracy_final"),
        "reward_mean": [m.get("reward_mean") for m in rl],
        "eval_curve": curve,
        "run_dir": run_dir,
    }


def run_trl(
    row: Row, config: str, sets: list[str], warm: str, steps: int, out: str, eval_every: int = 0
) -> dict:
    """TRL's GRPOTrainer (``bench.trl_peer``) from the warm start, in its own process. It is
    evaluated once, at the end (``eval_every`` is the runners' common signature, unused here)."""
    run_dir = os.path.join(out, row.label)
    os.makedirs(run_dir, exist_ok=True)
    record_path = os.path.join(run_dir, "record.json")
    cmd = [sys.executable, "-m", "jaxrlvr.bench.trl_peer", config, "--model", warm]
    cmd += ["--steps", str(steps), "--out", run_dir, "--_out", record_path]
    for s in [*sets, *row.overrides]:
        cmd += ["--set", s]
    start = time.perf_counter()
    _run(cmd, run_dir + ".log", f"row {row.label} (TRL)")
    with open(record_path) as f:
        rec = json.load(f)
    rec.update(label=row.label, overrides=list(row.overrides))
    rec["process_wall_s"] = time.perf_counter() - start
    return rec


RUNNERS = {"jaxrlvr": run_jaxrlvr, "trl": run_trl}


def markdown(records: list[dict], meta: dict) -> str:
    """The table: one row per system, median seconds per phase and the headline numbers."""
    head = (
        "| row | sample | reward | old/ref logp | shape | update | sync | wait | step (median) "
        "| GRPO steps/s (all / median) | rollout tok/s | held-out acc (start -> end) |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in records:
        m = r["summary"]["median_s"]
        acc0 = r.get("eval_start")
        acc = f"{acc0:.3f} -> " if acc0 is not None else ""
        lines.append(
            f"| {r['label']} | "
            + " | ".join(f"{m[k]:.3f}" for k in (*PHASES, "step"))
            + f" | {r['summary']['steps_per_s']:.2f} / {r['summary']['steps_per_s_median']:.2f}"
            + f" | {r['summary']['rollout_tokens_per_s']:,.0f} | {acc}{r['eval_final']:.3f} |"
        )
    base = next((r for r in records if r["system"] == "trl"), None)
    if base is not None:
        for r in records:
            if r is not base:
                ratio = r["summary"]["steps_per_s"] / base["summary"]["steps_per_s"]
                med = r["summary"]["steps_per_s_median"] / base["summary"]["steps_per_s_median"]
                lines.append(
                    f"\n{r['label']} / {base['label']}: {ratio:.2f}x steps/s "
                    f"({med:.2f}x on median steps), held-out accuracy "
                    f"{r['eval_final'] - base['eval_final']:+.3f}"
                )
    lines.append(
        f"\n{meta['steps']} GRPO steps from the same warm start ({meta['warm_start']}), "
        f"config {meta['config']} {' '.join(meta['sets'])}; seconds are medians per step; "
        f"load average before/after {meta['load_before']} / {meta['load_after']}."
    )
    return "\n".join(lines) + "\n"


def _parse_row(p, text: str) -> Row:
    label, _, rest = text.partition(":")
    if not label or not rest:
        p.error(f"--row {text!r}: expected LABEL:key=value[,key=value...]")
    system = "jaxrlvr"
    overrides = tuple(x for x in rest.split(",") if x)
    if overrides and "=" not in overrides[0]:
        system, overrides = overrides[0], overrides[1:]
    if system not in SYSTEMS:
        p.error(f"--row {text!r}: system {system!r} is not one of {', '.join(SYSTEMS)}")
    return Row(label, system, overrides)


def main(argv=None) -> int:
    p = common.parser("loop", __doc__)
    p.add_argument("--config", default="configs/demo.yaml", help="jaxrlvr train config")
    p.add_argument("--steps", type=int, default=None, help="GRPO steps (default: rl.steps)")
    p.add_argument("--out", default=None, help="output directory (default: a new temp dir)")
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="override, every row"
    )
    p.add_argument("--systems", default="jaxrlvr,trl", help="comma list of the default rows")
    p.add_argument(
        "--row",
        action="append",
        default=[],
        metavar="LABEL:[SYSTEM,]KEY=VALUE,...",
        help="an extra row, e.g. k1:rl.max_staleness=1 or vllm:sampler.kind=vllm",
    )
    p.add_argument(
        "--sampler", choices=("jax", "vllm"), default=None, help="jaxrlvr rows' sampler.kind"
    )
    p.add_argument("--warm-start", default=None, help="reuse this Hugging Face warm start")
    p.add_argument(
        "--eval-every",
        type=int,
        default=0,
        help="jaxrlvr rows: held-out evaluation every N steps, for learning curves (default: "
        "start and end only)",
    )
    args = p.parse_args(argv)
    chosen = common.comma_list(p, "--systems", args.systems, SYSTEMS)
    rows = [r for r in ROWS if r.system in chosen] + [_parse_row(p, t) for t in args.row]
    if args.sampler:
        rows = [
            dataclasses.replace(r, overrides=(f"sampler.kind={args.sampler}", *r.overrides))
            if r.system == "jaxrlvr"
            else r
            for r in rows
        ]
    from jaxrlvr import config as config_lib

    cfg = config_lib.load_config(args.config, list(args.set))  # bad keys: one line, up front
    steps = args.steps or cfg.rl.steps
    if steps < 1:
        p.error(f"--steps must be >= 1, got {steps}")
    out = args.out or tempfile.mkdtemp(prefix="jaxrlvr-bench-loop-")
    os.makedirs(out, exist_ok=True)
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    warm = args.warm_start or warm_start(args.config, args.set, out)
    records = []
    for row in rows:
        print(f"[bench loop] {row.label}: {steps} steps ...", file=sys.stderr, flush=True)
        rec = RUNNERS[row.system](row, args.config, args.set, warm, steps, out, args.eval_every)
        rec["summary"] = _summary(rec["steps"], rec["response_tokens"])
        records.append(rec)
    # Every row starts from the same weights, evaluated the same way: the jaxrlvr rows' start
    # accuracy is the warm start's, and the TRL rows take it from them.
    start_acc = next((r["eval_start"] for r in records if r.get("eval_start") is not None), None)
    for rec in records:
        rec.setdefault("eval_start", start_acc)
    meta = {
        "config": args.config,
        "sets": list(args.set),
        "steps": steps,
        "warm_start": warm,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_before": load_before,
        "load_after": " ".join(f"{x:.1f}" for x in os.getloadavg()),
    }
    table = markdown(records, meta)
    with open(os.path.join(out, "loop.md"), "w") as f:
        f.write(table)
    result = {"meta": meta, "records": records}
    common.save_json(os.path.join(out, "loop.json"), result)
    common.save_json(args.json, result)
    print(table)
    print(f"[bench loop] wrote {out}/loop.md and loop.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
