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

The machine's fp32 matmul throughput (2048 x 2048, best of 10, JAX and torch, measured by this
process before the rows) is recorded beside the systems' ratio: each row's update in model
GFLOP/s (``ModelConfig.flops_per_token`` x the step's prompt + response tokens over the median
update seconds) and its fraction of its own framework's matmul GFLOP/s, so a slow machine and a
slow system read differently.

``--whole-run`` compares the whole demo instead, SFT + GRPO + held-out evaluations, each system
in a fresh process from the config's initial weights (jaxrlvr's random init from ``run.seed``,
saved as a Hugging Face folder by this process; the jaxrlvr rows build the same weights from the
seed, the TRL row loads the folder), so each pays its own imports and compiles:

- ``jaxrlvr (first run)``: ``jaxrlvr train CONFIG`` as the README runs it, with a fresh,
  empty compilation cache (``run.compile_cache=OUT/compile_cache``): every program compiled;
- ``trl``: ``bench.trl_peer --whole-run``: TRL's ``SFTTrainer`` for ``sft.steps`` on the same
  gold completions, then ``GRPOTrainer`` as in the step rows, with a held-out evaluation (HF
  ``generate``, same problems, avg@k at the same temperature) after SFT and every ``eval.every``
  GRPO steps, as jaxrlvr train evaluates; its final model is then evaluated by jaxrlvr's own
  evaluation too, outside its wall time, for the accuracy column;
- ``jaxrlvr (second run)``: the same command again, the cache now warm: no XLA compile.

``--config configs/demo_moe.yaml`` runs the MoE demo the same way: the TRL row trains the same
Qwen3-MoE (``Qwen3MoeForCausalLM``, transformers' default experts kernel, recorded) with the
router's auxiliary loss off, as jaxrlvr's demo runs (``router_aux_loss_coef=0`` in its
``SFTConfig`` and ``GRPOConfig``; ``trl_peer.assert_no_aux_loss`` refuses to run otherwise).

Reported per row: the process's wall time (start to the end of its own work), the SFT, GRPO and
evaluation seconds, the median GRPO step, the compiles (count and seconds, jaxrlvr's
``summary.json``), and held-out accuracy after SFT and at the end; the ratios TRL / jaxrlvr
(first and second run) of wall time and of the median step, and first / second run.

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


def _run(cmd: list[str], log_path: str, what: str, *, peer: bool = False) -> None:
    """Runs ``cmd`` with its output in ``log_path``; one line naming ``what`` on failure.
    ``peer``: a peer system's process, in its users' environment (without the malloc settings
    that jaxrlvr's command line adds for itself, ``cli.MALLOC_ENV``)."""
    from jaxrlvr import cli

    env = cli.without_malloc_env(common.worker_env()) if peer else common.worker_env()
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
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
    _run(cmd, run_dir + ".log", f"row {row.label} (TRL)", peer=True)
    with open(record_path) as f:
        rec = json.load(f)
    rec.update(label=row.label, overrides=list(row.overrides))
    rec["process_wall_s"] = time.perf_counter() - start
    return rec


RUNNERS = {"jaxrlvr": run_jaxrlvr, "trl": run_trl}


def matmul_gflops(n: int = 2048, repeats: int = 10) -> dict[str, float]:
    """The machine's fp32 dense-matmul GFLOP/s, JAX's and torch's (best of ``repeats``)."""
    import jax
    import jax.numpy as jnp

    out = {}
    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    out["jax"] = 2 * n**3 / min(common.timed_calls(lambda: f(a, a).block_until_ready(), repeats))
    try:
        import torch
    except ImportError:  # the TRL peer's extra is not installed: JAX's figure only
        return {k: v / 1e9 for k, v in out.items()}
    b = torch.randn(n, n)
    torch.mm(b, b)
    out["torch"] = 2 * n**3 / min(common.timed_calls(lambda: torch.mm(b, b), repeats))
    return {k: v / 1e9 for k, v in out.items()}


def update_gflop(config: str, sets: list[str]) -> dict[str, float]:
    """What one GRPO update of the config computes, for ``_flops_rate``: the rollouts per step,
    the mean rendered prompt tokens, and ``flops_per_token`` at rows of prompt + max_tokens
    (``scaling.rollout_shape``, which ``jaxrlvr plot --fit`` counts compute with)."""
    from jaxrlvr import config as config_lib
    from jaxrlvr import scaling

    return scaling.rollout_shape(config_lib.load_config(config, list(sets)))


def _flops_rate(rec: dict, shape: dict, gflops: dict[str, float]) -> None:
    """Adds the update's model GFLOP/s and its fraction of the framework's matmul GFLOP/s."""
    resp = rec["response_tokens"]
    rollouts = shape["rollouts"]
    mean_resp = statistics.fmean(resp) / rollouts if resp else 0.0
    flop = rollouts * (shape["prompt_tokens"] + mean_resp) * shape["flops_per_token"]
    upd = rec["summary"]["median_s"]["update"]
    rec["update_gflops"] = flop / upd / 1e9 if upd > 0 else float("nan")
    peak = gflops.get("torch" if rec["system"] == "trl" else "jax")
    rec["update_fraction_of_matmul"] = rec["update_gflops"] / peak if peak else float("nan")


def init_weights(config: str, sets: list[str], out: str) -> str:
    """The config's initial model (the random init ``jaxrlvr train`` builds from ``run.seed``, or
    ``model.path``'s weights) as a Hugging Face folder with the tokenizer."""
    from jaxrlvr import builders
    from jaxrlvr import config as config_lib
    from jaxrlvr import model as model_lib

    cfg = config_lib.load_config(config, list(sets))
    tokenizer = builders.build_tokenizer(cfg.model)
    import jax

    # One device: the values do not depend on the mesh (a test process may show 8 CPU devices).
    model = builders.build_model(
        cfg.model, tokenizer, model_lib.make_mesh(None, jax.devices()[:1]), seed=cfg.run.seed
    )
    path = os.path.join(out, "init_hf")
    model_lib.save_hf(model, path, tokenizer_src=tokenizer)
    return path


def _whole_jaxrlvr(label: str, config: str, sets: list[str], out: str, cache: str) -> dict:
    """``jaxrlvr train CONFIG`` as the README runs it, in its own process, compiling into (or
    loading from) the compile cache ``cache``."""
    run_dir = os.path.join(out, label)
    overrides = [*sets, f"run.out_dir={run_dir}", "run.progress=false"]
    overrides.append(f"run.compile_cache={cache}")
    start = time.perf_counter()
    _run(_cli("train", config, *overrides, "--overwrite"), run_dir + ".log", f"row {label}")
    wall = time.perf_counter() - start
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    rl = [m for m in lines if "time/update_s" in m]
    sft = [m["time/step_s"] for m in lines if "time/step_s" in m and "time/update_s" not in m]
    rl_steps = [float(m["time/step_s"]) for m in rl]
    phases = {k: statistics.median(float(m.get(f"time/{k}_s", 0.0)) for m in rl) for k in PHASES}
    return {
        "phase_median_s": phases,
        "label": label,
        "system": "jaxrlvr",
        "wall_s": wall,
        "sft_s": sum(sft),
        "grpo_s": sum(rl_steps),
        "eval_s": None,  # inside wall_s; jaxrlvr logs no eval time of its own
        "step_median_s": statistics.median(rl_steps),
        "first_grpo_step_s": rl_steps[0],
        "first_sft_step_s": sft[0] if sft else None,
        "compile": summary.get("compile"),
        "eval_after_sft": summary.get("eval_accuracy_after_sft"),
        "eval_final": summary.get("eval_accuracy_final"),
        "run_dir": run_dir,
    }


def _whole_trl(config: str, sets: list[str], init: str, out: str) -> dict:
    """TRL's SFT + GRPO + evaluations (``trl_peer --whole-run``) in a fresh process."""
    from jaxrlvr import config as config_lib

    steps = config_lib.load_config(config, list(sets)).rl.steps
    run_dir = os.path.join(out, "trl")
    os.makedirs(run_dir, exist_ok=True)
    record_path = os.path.join(run_dir, "record.json")
    cmd = [sys.executable, "-m", "jaxrlvr.bench.trl_peer", config, "--model", init, "--whole-run"]
    cmd += ["--steps", str(steps), "--out", run_dir, "--_out", record_path]
    for x in sets:
        cmd += ["--set", x]
    start = time.time()
    _run(cmd, run_dir + ".log", "row trl (whole run)", peer=True)
    with open(record_path) as f:
        rec = json.load(f)
    own = rec.get("own_evals", [])
    phases = {k: statistics.median(x.get(k, 0.0) for x in rec["steps"]) for k in PHASES}
    return {
        "phase_median_s": phases,
        "label": "trl",
        "system": "trl",
        "wall_s": rec["work_end"] - start,
        "sft_s": rec["phases_s"].get("sft", 0.0),
        "grpo_s": sum(x["step"] for x in rec["steps"]),
        "eval_s": rec["phases_s"].get("eval", 0.0),
        "step_median_s": rec["median_step_s"],
        "first_grpo_step_s": rec["steps"][0]["step"],
        "first_sft_step_s": None,
        "compile": None,
        "eval_after_sft": next((e["accuracy"] for e in own if e["phase"] == "sft"), None),
        "eval_final": rec["eval_final"],  # jaxrlvr's evaluation of TRL's final model
        "eval_final_own": own[-1]["accuracy"] if own else None,
        # A MoE config: transformers' experts kernel, and the aux loss (off, checked by the peer)
        "experts_implementation": rec.get("experts_implementation"),
        "router_aux_loss": rec.get("router_aux_loss"),
        "run_dir": run_dir,
    }


def whole_run(config: str, sets: list[str], out: str) -> tuple[list[dict], dict]:
    """jaxrlvr (fresh compile cache), TRL, jaxrlvr again (warm cache): the whole demo each."""
    init = init_weights(config, sets, out)
    cache = os.path.join(out, "compile_cache")
    if os.path.exists(cache):
        raise common.WorkerError(f"{cache} exists: the first run needs an empty compile cache")
    records = []
    for label in ("jaxrlvr_first", "trl", "jaxrlvr_second"):
        print(f"[bench loop --whole-run] {label} ...", file=sys.stderr, flush=True)
        if label == "trl":
            records.append(_whole_trl(config, sets, init, out))
        else:
            records.append(_whole_jaxrlvr(label, config, sets, out, cache))
    first, trl, second = records
    ratios = {
        "trl_over_first_wall": trl["wall_s"] / first["wall_s"],
        "trl_over_second_wall": trl["wall_s"] / second["wall_s"],
        "first_over_second_wall": first["wall_s"] / second["wall_s"],
        "trl_over_first_median_step": trl["step_median_s"] / first["step_median_s"],
        "trl_over_second_median_step": trl["step_median_s"] / second["step_median_s"],
        "accuracy_first_minus_trl": first["eval_final"] - trl["eval_final"],
        "accuracy_second_minus_trl": second["eval_final"] - trl["eval_final"],
    }
    return records, {"init": init, "ratios": ratios}


def whole_markdown(records: list[dict], meta: dict) -> str:
    """The whole-run table and its ratios."""
    fmt = lambda x, f=".1f": "-" if x is None else format(x, f)
    lines = [
        "| row | wall (s) | SFT (s) | GRPO steps (s) | evals (s) | GRPO step median (s) "
        "| first GRPO step (s) | XLA compiles (n / s) | cache loads (n / s) "
        "| held-out acc after SFT -> final |",
        "|" + "---|" * 10,
    ]
    for r in records:
        c = r.get("compile") or {}
        comp = f"{c['compiles']} / {c['compile_s']:.1f}" if c else "-"
        hits = f"{c['cache_hits']} / {c['cache_load_s']:.1f}" if c else "-"
        lines.append(
            f"| {r['label']} | {r['wall_s']:.1f} | {r['sft_s']:.1f} | {r['grpo_s']:.1f} "
            f"| {fmt(r['eval_s'])} | {r['step_median_s']:.3f} | {r['first_grpo_step_s']:.2f} "
            f"| {comp} | {hits} | {fmt(r['eval_after_sft'], '.3f')} -> "
            f"{r['eval_final']:.3f} |"
        )
    lines += [
        "\nGRPO steps, median seconds per phase:\n",
        "| row | " + " | ".join(PHASES) + " | step |",
        "|" + "---|" * (len(PHASES) + 2),
    ]
    for r in records:
        m = r["phase_median_s"]
        lines.append(
            f"| {r['label']} | "
            + " | ".join(f"{m[k]:.3f}" for k in PHASES)
            + f" | {r['step_median_s']:.3f} |"
        )
    q = meta["ratios"]
    lines.append(
        f"\nWhole run, TRL / jaxrlvr: {q['trl_over_first_wall']:.2f}x (first run), "
        f"{q['trl_over_second_wall']:.2f}x (second run); median GRPO step "
        f"{q['trl_over_first_median_step']:.2f}x / {q['trl_over_second_median_step']:.2f}x; "
        f"first / second run {q['first_over_second_wall']:.2f}x; held-out accuracy "
        f"jaxrlvr - TRL {q['accuracy_first_minus_trl']:+.3f} / "
        f"{q['accuracy_second_minus_trl']:+.3f}."
    )
    trl = next((r for r in records if r["system"] == "trl"), {})
    if trl.get("experts_implementation"):
        lines.append(
            f"\nTRL's Qwen3-MoE: transformers experts_implementation="
            f"{trl['experts_implementation']}, router aux loss "
            f"{'on' if trl['router_aux_loss'] else 'off'} (router_aux_loss_coef=0 in its "
            "SFTConfig and GRPOConfig, checked by the peer)."
        )
    g = meta["matmul_gflops"]
    lines.append(
        "\nMachine fp32 matmul (2048^2): "
        + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in g.items())
        + f"; config {meta['config']} {' '.join(meta['sets'])}; {meta['machine']}; load average "
        f"before/after {meta['load_before']} / {meta['load_after']}. TRL's wall ends with its "
        "own work (its final model's jaxrlvr evaluation for the accuracy column runs after); "
        "TRL's evals column is its HF-generate evaluations, jaxrlvr's are inside its wall."
    )
    return "\n".join(lines) + "\n"


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
    g = meta.get("matmul_gflops") or {}
    if g:
        lines.append(
            "\nMachine fp32 matmul (2048^2): "
            + ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in g.items())
            + "; update model GFLOP/s (fraction of its framework's matmul): "
            + ", ".join(
                f"{r['label']} {r['update_gflops']:.0f} ({r['update_fraction_of_matmul']:.2f})"
                for r in records
                if "update_gflops" in r
            )
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
    p.add_argument(
        "--whole-run",
        action="store_true",
        help="the whole demo (SFT + GRPO + evals) of jaxrlvr (fresh compile cache), TRL, and "
        "jaxrlvr again (warm cache), each in a fresh process from the same initial weights",
    )
    args = p.parse_args(argv)
    if args.whole_run:
        return _main_whole(p, args)
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
    gflops = matmul_gflops()
    shape = update_gflop(args.config, args.set)
    warm = args.warm_start or warm_start(args.config, args.set, out)
    records = []
    for row in rows:
        print(f"[bench loop] {row.label}: {steps} steps ...", file=sys.stderr, flush=True)
        rec = RUNNERS[row.system](row, args.config, args.set, warm, steps, out, args.eval_every)
        rec["summary"] = _summary(rec["steps"], rec["response_tokens"])
        _flops_rate(rec, shape, gflops)
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
        "matmul_gflops": gflops,
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


def _main_whole(p, args) -> int:
    """``--whole-run``: the three whole-demo rows, their table and ratios."""
    if args.row or args.warm_start or args.steps or args.sampler or args.eval_every:
        p.error("--whole-run runs the config as it is: no --row, --warm-start, --steps, "
                "--sampler or --eval-every (use --set)")  # fmt: skip
    from jaxrlvr import config as config_lib

    config_lib.load_config(args.config, list(args.set))  # bad keys: one line, up front
    out = args.out or tempfile.mkdtemp(prefix="jaxrlvr-bench-whole-")
    os.makedirs(out, exist_ok=True)
    load_before = " ".join(f"{x:.1f}" for x in os.getloadavg())
    gflops = matmul_gflops()
    records, meta = whole_run(args.config, list(args.set), out)
    meta.update(
        config=args.config,
        sets=list(args.set),
        machine=f"{platform.machine()}, {os.cpu_count()} cores",
        load_before=load_before,
        load_after=" ".join(f"{x:.1f}" for x in os.getloadavg()),
        matmul_gflops=gflops,
    )
    table = whole_markdown(records, meta)
    with open(os.path.join(out, "whole_run.md"), "w") as f:
        f.write(table)
    result = {"meta": meta, "records": records}
    common.save_json(os.path.join(out, "whole_run.json"), result)
    common.save_json(args.json, result)
    print(table)
    print(f"[bench loop] wrote {out}/whole_run.md and whole_run.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
