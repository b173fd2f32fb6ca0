"""The GPU check: one table of what jaxrlvr does on the accelerator at hand, in minutes.

Runs from a plain checkout with whatever JAX is installed (``scripts/gpu_check.sh`` sets
``PYTHONPATH``; no pip, no network, no vLLM, datasets or math-verify needed). Each part runs in
its own process, one after the other, so each has the whole device and its own peak memory:

- ``matmul``: bf16 8192^3 matmul TFLOP/s (the MFU denominator) and the HBM bandwidth of a large
  elementwise copy (read + write; the decode bound's denominator);
- ``update``: the Qwen2.5-1.5B architecture (random weights; bf16 compute, fp32 master weights,
  remat, scanned layers), a GRPO step through the trainer's own path (the record
  ``registry.build`` builds for a GRPO ``TrainConfig`` with asynchronous rollouts, so
  that ``prepare`` runs the old log-prob pass, compiled by ``step.CompiledAlgorithm``;
  ``bench.common.trainer_step``) on 8 rows x 1,024 tokens (256 prompt + 768 response) in 4
  microbatches: the forward (``prepare``: old log-probs) and the update, each with tokens/s, MFU
  against the measured matmul peak, and peak device memory;
- ``moe``: Qwen3-30B-A3B's routed expert block (D 2,048, 128 experts of width 768, top-8) on
  4,096 tokens: forward + backward of each grouped kernel (``ragged_dot``, the platform's
  choice; ``sorted_blocks``; the CPU's ``block_loop``; the one-hot ``dense``) and of the
  expert-parallel ``ragged_all_to_all`` dispatch on a one-device ``expert`` axis, each checked
  against the one-hot reference ``moe.dense_experts`` in float32 at highest matmul precision
  (output and gradients, max |diff| / max |ref|); then the GRPO update and forward of the
  Qwen3-30B-A3B architecture cut to 4 layers (the same trainer path and batch as ``update``),
  MFU counted on the active parameters;
- ``sampler``: ``JaxSampler`` at that architecture (bf16 weights), 64 prompts of 128 tokens x 256
  new tokens, tokens/s against the HBM-bandwidth bound of decode at that batch (every step reads
  the weights once and the KV cache so far);
- ``demo``: ``configs/demo.yaml`` (SFT warm start, then GRPO with the JAX sampler) for 20 RL
  steps; wall time, the median RL step and held-out accuracy.

MFU counts model FLOPs only (``ModelConfig.flops_per_token``, the formula ``bench update`` uses
too): 2 x (non-embedding params + lm_head) per token forward, plus attention 4 x layers x heads
x head_dim x T, three times that for forward + backward; the remat recompute is not counted (so
it is MFU, not hardware FLOP utilisation).

``--cpu-smoke``: tiny shapes (and a 2-step demo) on the CPU in well under two minutes, so that CI
keeps this script working. The table goes to stdout; with ``$OUT`` set (or ``--out DIR``) it is
also written to ``DIR/gpu_check.txt`` with the numbers in ``DIR/gpu_check.json``.

Not here: vLLM (not installed on the check machine) and multi-GPU layouts (README "Running on
GPUs").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

PARTS = ("matmul", "update", "moe", "sampler", "demo")
# Per-part limits (seconds) for the full check, 2-4x what each took on an H200 and 1.3x for the
# moe part (docs/gpu/README.md: matmul 9, update 23, moe 218, sampler 25, demo 55): together
# under the device tool's 10 minutes per command; each part's record is written as soon as it
# ends, so a cut run keeps the rest.
TIMEOUT_S = {"matmul": 30, "update": 90, "moe": 280, "sampler": 70, "demo": 110}

SHAPES = {
    # rows, prompt, response, microbatches; sampler prompts, prompt len, new tokens; matmul n
    "full": dict(rows=8, prompt=256, response=768, micro=4, sp=64, sp_len=128, new=256, n=8192),
    "smoke": dict(rows=4, prompt=16, response=48, micro=2, sp=4, sp_len=8, new=8, n=256),
}
# The MoE part's expert block: tokens, hidden, expert width, experts, top-k; and the layers of
# its cut Qwen3-30B-A3B (4 of 48: ~3.1B parameters, 50 GB of float32 weights + Adam + grads).
MOE_SHAPES = {
    "full": dict(n=4096, d=2048, f=768, e=128, k=8, layers=4),
    "smoke": dict(n=64, d=64, f=32, e=16, k=4, layers=2),
}
DEMO_OVERRIDES = {
    "full": ["rl.steps=20", "eval.every=20", "checkpoint.every=20"],
    "smoke": [
        "rl.steps=2",
        "sft.steps=0",
        "eval.at_start=false",
        "rl.prompts_per_step=4",
        "rl.group_size=2",
        "data.synthetic_train_size=40",
        "data.synthetic_eval_size=8",
        "eval.max_problems=4",
        "eval.samples_per_problem=1",
        "eval.every=100",
        "checkpoint.every=100",
        "reward.num_workers=1",
    ],
}


def model_config(smoke: bool, moe: bool = False, **overrides):
    from jaxrlvr.model import config as model_config

    if moe:
        m = MOE_SHAPES["smoke" if smoke else "full"]
        if smoke:
            moe_fields = dict(num_experts=m["e"], num_experts_per_tok=m["k"])
            return model_config.ModelConfig.tiny(
                vocab_size=512, max_position_embeddings=2048, model_type="qwen3_moe",
                moe_intermediate_size=m["f"], norm_topk_prob=True, **moe_fields, **overrides
            )  # fmt: skip
        return model_config.ModelConfig.qwen3_30b_a3b(
            num_hidden_layers=m["layers"], max_position_embeddings=2048, **overrides
        )
    if smoke:  # the tiny preset, vocabulary 512
        return model_config.ModelConfig.tiny(
            vocab_size=512, max_position_embeddings=2048, **overrides
        )
    # Qwen2.5-1.5B (and -Math-1.5B): the architecture of the course's leaderboard model.
    return model_config.ModelConfig.qwen2_5_1_5b(max_position_embeddings=2048, **overrides)


def _device_info() -> dict:
    import jax

    d = jax.local_devices()[0]
    return {
        "platform": d.platform,
        "device_kind": getattr(d, "device_kind", d.platform),
        "num_devices": jax.local_device_count(),
        "jax": jax.__version__,
    }


def _peak_memory_gib() -> float | None:
    """Peak device memory of this process (GPU/TPU allocator stats); None where unavailable."""
    import jax

    stats = jax.local_devices()[0].memory_stats() or {}
    peak = stats.get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def _log(msg: str) -> None:
    """A progress line on stderr (the driver shows a part's last lines when it fails or times
    out)."""
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---------------------------------------------------------------------------------------------
# Workers (each in its own process)


def part_matmul(smoke: bool) -> dict:
    import jax
    import jax.numpy as jnp

    n = SHAPES["smoke" if smoke else "full"]["n"]
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = (jax.random.normal(kb, (n, n), jnp.float32) / n**0.5).astype(jnp.bfloat16)
    chain = 10  # back-to-back matmuls per timed call, so launch overhead does not count

    @jax.jit
    def mm(a, b):
        # A chain x <- x @ b (b scaled to keep x's norm), so no product can be hoisted out of
        # the loop or skipped.
        return jax.lax.fori_loop(0, chain, lambda i, x: x @ b, a)

    mm(a, b).block_until_ready()
    s = _timed(lambda: mm(a, b).block_until_ready(), 5)
    numel = (2**31 if not smoke else 2**22) // 2  # 2 GiB of bf16 (4 MiB in the smoke)
    x = jnp.ones((numel,), jnp.bfloat16)
    copy = jax.jit(lambda x: x * 2)
    copy(x).block_until_ready()
    c = _timed(lambda: copy(x).block_until_ready(), 5)
    return {
        **_device_info(),
        "matmul_n": n,
        "matmul_tflops": chain * 2 * n**3 / s / 1e12,
        "hbm_gbs": 2 * x.nbytes / c / 1e9,
    }


def part_update(smoke: bool) -> dict:
    cfg = model_config(smoke, dtype="bfloat16", param_dtype="float32", remat=True)
    return _grpo_step(cfg, smoke)


def _grpo_step(cfg, smoke: bool) -> dict:
    """The GRPO forward (old log-probs) and update of ``cfg`` on the check's batch, through the
    trainer's own path: tokens/s, compile and step seconds, peak device memory."""
    import jax
    import numpy as np
    from flax import nnx

    from jaxrlvr import model as M
    from jaxrlvr.algos import batch as batch_lib
    from jaxrlvr.bench import common

    sh = SHAPES["smoke" if smoke else "full"]
    mesh = M.make_mesh(M.MeshConfig(data=1, fsdp=-1, tensor=1))
    t0 = time.perf_counter()
    graphdef, params = nnx.split(M.init_model(cfg, seed=0, mesh=mesh), nnx.Param)
    # What ``jaxrlvr train`` compiles for a GRPO config: its record (registry.build),
    # state shardings and step.CompiledAlgorithm.
    # rl.max_staleness=1: rollouts may be stale, so prepare runs the old log-prob pass (the
    # forward timed below); without a correction the update does the synchronous one's work.
    train_cfg = common.train_config(
        [
            "rl.algo=grpo",
            f"rl.microbatches={sh['micro']}",
            "rl.max_staleness=1",
            "rl.off_policy_correction=false",
            "optim.learning_rate=1e-6",
        ]
    )
    algo, compiled, shardings = common.trainer_step(
        train_cfg, graphdef, jax.eval_shape(lambda p: p, params), mesh
    )
    state = jax.device_put(algo.init(params, 0), shardings)
    del params
    init_s = time.perf_counter() - t0
    _log(f"step: state initialised in {init_s:.0f} s; compiling the forward")

    rows, prompt, seq = sh["rows"], sh["prompt"], sh["prompt"] + sh["response"]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (rows, seq + 1)).astype(np.int32)
    pos = np.arange(seq)[None, :].repeat(rows, 0)
    rollouts = batch_lib.Batch(
        input_ids=ids[:, :-1],
        attention_mask=np.ones((rows, seq), np.int32),
        labels=ids[:, 1:],
        loss_mask=pos >= prompt - 1,
        advantages=rng.normal(size=rows).astype(np.float32),
    )
    holder = {"state": state}  # the update donates the state: only the holder keeps it
    del state
    t0 = time.perf_counter()
    batch, _ = compiled.prepare(holder["state"], rollouts)
    jax.block_until_ready(batch)
    prepare_compile_s = time.perf_counter() - t0
    forward_s = _timed(
        lambda: jax.block_until_ready(compiled.prepare(holder["state"], rollouts)), 3
    )
    forward_peak = _peak_memory_gib()

    _log("step: forward timed; compiling the update")

    def update():
        holder["state"], metrics = compiled.update(holder["state"], batch)
        holder["loss"] = float(metrics["loss"])  # blocks until the step is done

    t0 = time.perf_counter()
    update()
    update_compile_s = time.perf_counter() - t0
    update_s = _timed(update, 2 if smoke else 5)
    tokens = rows * seq
    return {
        **_device_info(),
        "num_params": cfg.num_params(),
        "active_params": cfg.num_params(active=True),
        "tokens_per_step": tokens,
        "microbatches": sh["micro"],
        "init_s": init_s,
        "forward_compile_s": prepare_compile_s,
        "forward_s": forward_s,
        "forward_tokens_per_s": tokens / forward_s,
        "forward_flops": tokens * cfg.flops_per_token(seq, training=False),
        "forward_peak_gib": forward_peak,
        "update_compile_s": update_compile_s,
        "update_s": update_s,
        "update_tokens_per_s": tokens / update_s,
        "update_flops": tokens * cfg.flops_per_token(seq),
        "update_peak_gib": _peak_memory_gib(),
        "final_loss": holder["loss"],
    }


def part_moe(smoke: bool) -> dict:
    """Qwen3-30B-A3B's expert block on every grouped kernel, then its GRPO step (4 layers) on
    ``$JAXRLVR_GPU_CHECK_MOE_IMPL`` (``--moe-impl``; default auto, the platform's choice)."""
    kernels = _moe_kernels(smoke)
    impl = os.environ.get("JAXRLVR_GPU_CHECK_MOE_IMPL", "auto")
    _log(f"moe GRPO step (moe_impl {impl}) ...")
    cfg = model_config(
        smoke, True, dtype="bfloat16", param_dtype="float32", remat=True, moe_impl=impl
    )
    from jaxrlvr.model import moe

    record = _grpo_step(cfg, smoke)
    sh = SHAPES["smoke" if smoke else "full"]
    tokens = sh["rows"] * (sh["prompt"] + sh["response"]) // sh["micro"]  # one microbatch's
    return {
        **record,
        "layers": cfg.num_hidden_layers,
        "moe_impl": moe.resolve_impl(impl, tokens, cfg.num_experts, cfg.num_experts_per_tok),
        "kernels": kernels,
    }


def _moe_kernels(smoke: bool) -> dict:
    """Per kernel: forward + backward milliseconds in bf16, and the float32 (highest precision)
    output and gradients against ``moe.dense_experts``, as max |diff| / max |ref|."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec

    from jaxrlvr.model import expert_parallel, moe

    m = MOE_SHAPES["smoke" if smoke else "full"]
    n, d, f, e, k = m["n"], m["d"], m["f"], m["e"], m["k"]
    keys = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(keys[0], (n, d), jnp.float32)
    router = jax.random.normal(keys[1], (d, e), jnp.float32) / d**0.5
    gate = jax.random.normal(keys[2], (e, d, f), jnp.float32) / d**0.5
    up = jax.random.normal(keys[3], (e, d, f), jnp.float32) / d**0.5
    down = jax.random.normal(keys[4], (e, f, d), jnp.float32) / f**0.5
    ids, weights = moe.select_experts(jax.nn.softmax(x @ router, axis=-1), k, True)
    counts = np.bincount(np.asarray(ids).reshape(-1), minlength=e)
    mesh = jax.make_mesh((1,), (expert_parallel.AXIS,))

    def ep_ragged(x, ids, w, g, u, dn):
        # The expert-parallel dispatch itself (two ragged all-to-alls) on a one-device axis.
        spec = PartitionSpec()
        fn = functools.partial(expert_parallel.ragged_dispatch, ep=1)
        return jax.shard_map(fn, mesh=mesh, in_specs=(spec,) * 6, out_specs=spec)(
            x, ids, w, g, u, dn
        )

    impls = {
        "ragged_dot": functools.partial(moe.grouped_experts, impl="ragged_dot"),
        "sorted_blocks": functools.partial(moe.grouped_experts, impl="sorted_blocks"),
        "block_loop": functools.partial(moe.grouped_experts, impl="block_loop"),
        "dense": functools.partial(moe.grouped_experts, impl="dense"),
        "ep_ragged_a2a": ep_ragged,
    }

    def loss_grad(fn):
        def loss(x, w, g, u, dn):
            y = fn(x, ids, w, g, u, dn)
            return jnp.sum(y.astype(jnp.float32) * ct), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))

    ct = jax.random.normal(jax.random.PRNGKey(1), (n, d), jnp.float32)
    args32 = (x, weights, gate, up, down)
    with jax.default_matmul_precision("highest"):
        (_, ref_y), ref_g = loss_grad(moe.dense_experts)(*args32)
    out: dict = dict(tokens=n, hidden=d, expert_width=f, experts=e, top_k=k)
    out.update(max_expert_load=int(counts.max()), min_expert_load=int(counts.min()))
    bf16 = tuple(a.astype(jnp.bfloat16) for a in args32)
    for name, fn in impls.items():
        _log(f"moe kernel {name} ...")
        rec: dict = {}
        if name == "ep_ragged_a2a" and jax.default_backend() == "cpu":
            out[name] = {"skipped": "XLA:CPU cannot compile ragged-all-to-all (jax-ml/jax#34755)"}
            continue
        try:
            with jax.default_matmul_precision("highest"):
                (_, y), grads = loss_grad(fn)(*args32)
            rel = lambda a, b: float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))  # noqa: E731
            rec["rel_err_out"] = rel(y, ref_y)
            rec["rel_err_grad"] = max(rel(a, b) for a, b in zip(grads, ref_g, strict=True))
            run = functools.partial(lambda step: jax.block_until_ready(step(*bf16)), loss_grad(fn))
            run()
            rec["fwd_bwd_ms"] = 1e3 * _timed(run, 5)
            fwd = jax.jit(lambda x, w, g, u, dn, fn=fn: fn(x, ids, w, g, u, dn))
            run = functools.partial(lambda fwd: jax.block_until_ready(fwd(*bf16)), fwd)
            run()
            rec["fwd_ms"] = 1e3 * _timed(run, 5)
        except Exception as exc:  # one kernel failing must not hide the others
            rec["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        out[name] = rec
    # The routed work (3 matmuls of 2 D F FLOPs per slot, x3 for forward + backward).
    out["routed_flops"] = 3 * 3 * 2 * n * k * d * f
    return out


def part_sampler(smoke: bool) -> dict:
    import numpy as np

    from jaxrlvr import model as M
    from jaxrlvr.sampling import base, jax_sampler

    sh = SHAPES["smoke" if smoke else "full"]
    cfg = model_config(smoke, dtype="bfloat16", param_dtype="bfloat16")
    mesh = M.make_mesh(M.MeshConfig(data=1, fsdp=-1, tensor=1))
    model = M.init_model(cfg, seed=0, mesh=mesh)
    sampler = jax_sampler.JaxSampler(model, None, mesh=mesh, eos_token_ids=())
    params = base.SamplingParams(
        temperature=1.0, max_tokens=sh["new"], ignore_eos=True, seed=0, logprobs=True
    )
    rng = np.random.default_rng(0)
    prompts = [
        [int(t) for t in rng.integers(0, cfg.vocab_size, sh["sp_len"])] for _ in range(sh["sp"])
    ]
    t0 = time.perf_counter()
    out = sampler.generate(prompts, 1, params)
    first_s = time.perf_counter() - t0
    new_tokens = sum(len(c.token_ids) for c in out)
    assert new_tokens == sh["sp"] * sh["new"], new_tokens
    s = _timed(lambda: sampler.generate(prompts, 1, params), 2)
    # Bytes one decode step reads: every weight once (bf16; a tied embedding is one matrix) and
    # the KV cache of every row, on average half-way through the generation.
    weight_bytes = 2 * cfg.num_params()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 2
    kv_bytes = sh["sp"] * (sh["sp_len"] + sh["new"] / 2) * kv_per_token
    return {
        **_device_info(),
        "prompts": sh["sp"],
        "prompt_len": sh["sp_len"],
        "new_tokens": sh["new"],
        "first_call_s": first_s,
        "generate_s": s,
        "tokens_per_s": new_tokens / s,
        "decode_step_bytes": weight_bytes + kv_bytes,
        "peak_gib": _peak_memory_gib(),
    }


def part_demo(smoke: bool) -> dict:
    from jaxrlvr import config as config_lib
    from jaxrlvr import train

    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    with tempfile.TemporaryDirectory(prefix="jaxrlvr-gpu-check-demo-") as tmp:
        overrides = [
            f"run.out_dir={tmp}/run",
            "run.progress=false",
            "run.tensorboard=false",
            *DEMO_OVERRIDES["smoke" if smoke else "full"],
        ]
        cfg = config_lib.load_config(os.path.join(repo, "configs", "demo.yaml"), overrides)
        t0 = time.perf_counter()
        summary = train.run(cfg)
        wall = time.perf_counter() - t0
        rl_steps = []
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            for line in f:
                m = json.loads(line)
                if "reward_mean" in m:
                    rl_steps.append(sum(v for k, v in m.items() if k.startswith("time/")))
    return {
        **_device_info(),
        "wall_s": wall,
        "rl_steps": summary["rl_steps"],
        "sft_steps": summary["sft_steps"],
        "rl_step_s": statistics.median(rl_steps[1:] or rl_steps) if rl_steps else None,
        "accuracy_after_sft": summary["eval_accuracy_after_sft"],
        "accuracy_final": summary["eval_accuracy_final"],
    }


WORKERS = {
    "matmul": part_matmul,
    "update": part_update,
    "moe": part_moe,
    "sampler": part_sampler,
    "demo": part_demo,
}


# ---------------------------------------------------------------------------------------------
# Driver


def run_part(part: str, smoke: bool, timeout_s: float) -> dict:
    """Runs one part in a fresh process; a failure or timeout becomes ``{"error": one line}``."""
    with tempfile.TemporaryDirectory(prefix="jaxrlvr-gpu-check-") as tmp:
        out = os.path.join(tmp, "record.json")
        cmd = [sys.executable, "-m", "jaxrlvr.bench.gpu_check", "--_worker", part, "--_out", out]
        cmd += ["--cpu-smoke"] if smoke else []
        t0 = time.perf_counter()
        # The worker dumps every thread's stack shortly before its deadline (faulthandler).
        env = dict(os.environ, JAXRLVR_GPU_CHECK_DEADLINE_S=str(max(1.0, timeout_s - 5)))
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr or b""
            err = err.decode(errors="replace") if isinstance(err, bytes) else err
            lines = [ln for ln in err.splitlines() if ln.strip()]
            sys.stderr.write(f"gpu_check: part {part} timed out; its output ends with:\n")
            sys.stderr.write("\n".join(lines[-40:]) + "\n")
            return {"error": f"timed out after {timeout_s:.0f} s"}
        record = {"part_s": time.perf_counter() - t0}
        if proc.returncode == 0 and os.path.exists(out):
            with open(out) as f:
                return {**json.load(f), **record}
    lines = [ln for ln in (proc.stderr or proc.stdout or "").splitlines() if ln.strip()]
    sys.stderr.write(f"gpu_check: part {part} failed; its output ends with:\n")
    sys.stderr.write("\n".join(lines[-30:]) + "\n")
    return {"error": f"exit {proc.returncode}: {lines[-1] if lines else 'no output'}"[:300]}


def _fmt(x, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def _gib(x) -> str:
    return "n/a (CPU)" if x is None else f"{x:.1f} GiB"


def _step_rows(rec: dict, prefix: str, peak, err) -> list[tuple[str, str, str]]:
    """The forward and update rows of a GRPO step record (``_grpo_step``), MFU against the
    measured bf16 matmul peak."""
    rows = []
    for name, key in (("forward (old logp)", "forward"), ("GRPO update", "update")):
        if "error" in rec or not rec:
            rows.append((prefix + name, err(rec) or "not run", ""))
            continue
        s = rec[f"{key}_s"]
        mfu = rec[f"{key}_flops"] / s / (peak * 1e12) if peak else None
        rows.append(
            (
                prefix + name,
                f"{rec[f'{key}_tokens_per_s']:,.0f} tok/s",
                f"MFU {_fmt(mfu and 100 * mfu, '.1f')}%, peak mem "
                f"{_gib(rec[f'{key}_peak_gib'])}, step {s:.3f} s, compile "
                f"{rec[f'{key}_compile_s']:.0f} s",
            )
        )
    return rows


def table(results: dict) -> str:
    """The one table: a row per measurement, with its unit and what it is compared with."""
    rows = []
    mm, up, mo, sa, de = (results.get(p, {}) for p in PARTS)
    peak = mm.get("matmul_tflops")
    bw = mm.get("hbm_gbs")
    dev = next((r for r in (mm, up, mo, sa, de) if "device_kind" in r), {})
    head = (
        f"jaxrlvr GPU check: {dev.get('device_kind', '?')} x{dev.get('num_devices', '?')}, "
        f"jax {dev.get('jax', '?')}{' (--cpu-smoke)' if results.get('smoke') else ''}"
    )

    def err(r):
        return f"FAILED: {r['error']}" if "error" in r else None

    rows.append(
        ("bf16 matmul", err(mm) or f"{_fmt(peak, '.1f')} TFLOP/s", f"n={mm.get('matmul_n')}")
    )
    rows.append(("HBM copy", err(mm) or f"{_fmt(bw, '.0f')} GB/s", "read + write"))
    rows += _step_rows(up, "", peak, err)
    kern = mo.get("kernels", {})
    for name in ("ragged_dot", "sorted_blocks", "block_loop", "dense", "ep_ragged_a2a"):
        if "error" in mo or not mo:
            rows.append((f"MoE kernel {name}", err(mo) or "not run", ""))
            break
        r = kern.get(name, {})
        if "fwd_bwd_ms" not in r and "error" not in r and "skipped" not in r:
            rows.append((f"MoE kernel {name}", "not run", ""))
            continue
        if "skipped" in r:
            rows.append((f"MoE kernel {name}", "skipped", r["skipped"]))
            continue
        if "error" in r:
            rows.append((f"MoE kernel {name}", f"FAILED: {r['error']}", ""))
            continue
        tflops = kern["routed_flops"] / (r["fwd_bwd_ms"] / 1e3) / 1e12
        rows.append(
            (
                f"MoE kernel {name}",
                f"{r['fwd_bwd_ms']:.2f} ms",
                f"fwd+bwd (fwd {_fmt(r.get('fwd_ms'), '.2f')} ms), {kern['tokens']} tok x "
                f"top-{kern['top_k']} of {kern['experts']}: "
                f"{tflops:.1f} routed TFLOP/s; f32 vs one-hot: out {r['rel_err_out']:.1e}, "
                f"grad {r['rel_err_grad']:.1e}",
            )
        )
    if "update_s" in mo:
        label = f"MoE ({mo['layers']}-layer 30B-A3B, {mo.get('moe_impl', '?')}) "
        rows += _step_rows(mo, label, peak, err)
    if "error" in sa or not sa:
        rows.append(("JaxSampler", err(sa) or "not run", ""))
    else:
        bound = sa["prompts"] / (sa["decode_step_bytes"] / (bw * 1e9)) if bw else None
        ratio = bound / sa["tokens_per_s"] if bound else None
        rows.append(
            (
                "JaxSampler",
                f"{sa['tokens_per_s']:,.0f} tok/s",
                f"{sa['prompts']} x {sa['new_tokens']} new; HBM bound {_fmt(bound, ',.0f')} tok/s "
                f"({_fmt(ratio, '.1f')}x below it); peak mem {_gib(sa['peak_gib'])}",
            )
        )
    if "error" in de or not de:
        rows.append(("demo config", err(de) or "not run", ""))
    else:
        rows.append(
            (
                f"demo ({de['rl_steps']} RL steps)",
                f"{de['wall_s']:.0f} s",
                f"RL step {_fmt(de['rl_step_s'], '.2f')} s; held-out accuracy "
                f"{_fmt(de['accuracy_after_sft'], '.3f')} after SFT -> "
                f"{_fmt(de['accuracy_final'], '.3f')}",
            )
        )
    w0 = max(len(r[0]) for r in rows)
    w1 = max(len(r[1]) for r in rows)
    lines = [head, "-" * len(head)]
    lines += [f"{a:<{w0}}  {b:>{w1}}  {c}".rstrip() for a, b, c in rows]
    return "\n".join(lines)


def _write(out: str, text: str, results: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_check.txt"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(out, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=2)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="scripts/gpu_check.sh", description=__doc__.splitlines()[0]
    )  # fmt: skip
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, for CI on the CPU")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--out", default=os.environ.get("OUT"), help="directory for the table + JSON")
    p.add_argument("--timeout", type=float, default=None, help="seconds a part may take")
    p.add_argument("--moe-impl", default=None, help="the moe part's GRPO step kernel (auto)")
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.moe_impl:  # read by the moe worker (a process of its own)
        os.environ["JAXRLVR_GPU_CHECK_MOE_IMPL"] = args.moe_impl
    if args._worker is not None:
        deadline = os.environ.get("JAXRLVR_GPU_CHECK_DEADLINE_S")
        if deadline:
            import faulthandler

            faulthandler.dump_traceback_later(float(deadline))
        try:
            record = WORKERS[args._worker](args.cpu_smoke)
        except BaseException:
            traceback.print_exc()
            return 1
        with open(args._out, "w") as f:
            json.dump(record, f, indent=2)
        return 0

    parts = [x.strip() for x in args.parts.split(",") if x.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        p.error(f"--parts: unknown {unknown}; choose from {list(PARTS)}")
    results: dict = {"smoke": args.cpu_smoke}
    t0 = time.perf_counter()
    text = table(results)
    for part in parts:
        print(f"gpu_check: {part} ...", file=sys.stderr, flush=True)
        limit = 300 if args.cpu_smoke else TIMEOUT_S[part]  # smoke: CI machines are shared
        limit = args.timeout or limit
        results[part] = run_part(part, args.cpu_smoke, limit)
        results["total_s"] = time.perf_counter() - t0
        text = table(results) + f"\n(total {results['total_s']:.0f} s)"
        if args.out:  # after every part, so that a run cut short keeps what it measured
            _write(args.out, text, results)
    print(text, flush=True)
    return 0 if all("error" not in results[q] for q in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
