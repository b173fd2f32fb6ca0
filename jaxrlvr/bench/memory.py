"""Per-device memory of the GRPO update at real sizes, from XLA's own analysis: compiled, never run.

For every configuration, a fresh worker process (with
``XLA_FLAGS=--xla_force_host_platform_device_count=N`` set before JAX starts) builds the
Qwen2.5-Math-1.5B architecture as abstract parameters (``nnx.eval_shape``: no weights, no
memory) and the GRPO record that ``jaxrlvr train`` builds from
configs/r1_zero_qwen2.5_math_1.5b.yaml (bf16 compute, float32 master weights and AdamW
moments, remat, scanned layers, ``seq_mean_token_mean``, clip 0.2, lr 1e-5, grad clip 1.0;
``registry.build`` via ``bench.common.trainer_step``), compiles it with
``step.CompiledAlgorithm`` (explicit shardings, donation), lowers the compiled update
(``CompiledAlgorithm.lower_update``) on ``ShapeDtypeStruct`` arguments (the batch: ``prepare``'s
output for the case's rollouts) and compiles it. It reports ``compiled.memory_analysis()`` per
device (arguments, outputs, temporaries, aliased bytes, and total = arguments + outputs +
temporaries - aliased), the compile time, and every "Involuntary full rematerialization" line
XLA printed (the worker's stderr is captured).

Shape: 256 rollouts x 1,280 tokens (256 prompt + 1,024 response budget) per step; each microbatch
holds ``--rows-per-device`` rows per batch shard (2: 128 microbatches on one device, 16 on 8).
Configurations: ``--fsdp 1,8`` (mesh data=1, fsdp=N on N fake CPU devices) x ``--chunk off,on``
(``rl.logprob_chunk_size`` None or ``--chunk-size``) x ``--packing off,on`` ("on" adds the packed
batch's ``segment_ids``/``positions``; the per-microbatch shape is the same, packing only needs
fewer microbatches for the same rollouts).
``--lora off,f32,bf16`` adds LoRA cases (``model.lora``, rank ``--lora-rank`` on every
projection, alpha 2 x rank): the base frozen in float32 or in bfloat16 storage, the float32
adapters and their AdamW moments the only trained state (the engine differentiates the adapters
only, so the in-place accumulation of ``model.grad_sink`` is not used: the adapters' gradients
are small).
``--model`` picks the architecture (abstract parameters from the checkpoints' config.json
shapes, ``ModelConfig`` presets): ``qwen2.5-math-1.5b`` (default), ``qwen3-1.7b`` (tied) or
``qwen3-30b-a3b`` (48 layers of 128 experts, top-8; its experts stacked ``[E, ...]`` and sharded
over ``fsdp`` by the rules table, the MoE kernel ``--moe-impl``, default ``ragged_dot`` as on a
TPU). XLA:CPU lowers ``ragged_dot`` densely (every row against every expert of the group's
shard: [E, slots, D]-sized temporaries that a TPU's grouped GEMMs do not allocate), so the
MoE's CPU temporaries overstate a TPU's; ``--moe-impl sorted_blocks`` (gathered weights per
block of rows) is the kernel GPUs and CPUs run (measured on an H200: docs/gpu/README.md).
Every record carries the floor: float32 weights + two AdamW moments + one gradient accumulator,
16 bytes a parameter, divided by the devices (``floor`` in bytes, ``total / floor`` printed).
``--attention-chunk N`` runs attention over blocks of N query positions
(``model.attention_query_chunk``: one block's float32 scores live at a time, in place of every
layer's [heads, T, T]).
``--tiny`` compiles a ~0.1M-parameter model at a small shape in seconds (the smoke test).

Usage: ``jaxrlvr bench memory [--fsdp 1,8] [--chunk off,on] [--packing off] [--json PATH]``.
Compiling the 1.5B update takes ~5-10 s per configuration on a 2-core CPU (plus ~5 s to start the
worker); not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time

from jaxrlvr.bench import common

GIB = 1024**3
REMAT_WARNING = "Involuntary full rematerialization"
ROLLOUTS, PROMPT, RESPONSE = 256, 256, 1024
CONFIG = "configs/r1_zero_qwen2.5_math_1.5b.yaml"
# ``model.config.MoEImpl`` but "auto" (the platform's choice: not the TPU's on this host); not
# imported from there, so the command line parses without importing JAX.
MOE_IMPLS = ("ragged_dot", "sorted_blocks", "block_loop", "dense")


def qwen25_math_1_5b(**overrides):
    """The Qwen2.5-Math-1.5B architecture (config.json of the checkpoint), bf16 compute, float32
    storage, remat, scanned layers."""
    from jaxrlvr.model import config as model_config

    fields = dict(dtype="bfloat16", param_dtype="float32", remat=True, scan_layers=True)
    return model_config.ModelConfig.qwen2_5_math_1_5b(**{**fields, **overrides})


MODELS = ("qwen2.5-math-1.5b", "qwen3-1.7b", "qwen3-30b-a3b")


def real_model(name: str, moe_impl: str = "ragged_dot", **overrides):
    """The ``--model`` architecture (``ModelConfig`` presets of the checkpoints' config.json),
    bf16 compute, float32 storage, remat, scanned layers; the MoE on the grouped-matmul kernel
    of the accelerators (``ragged_dot``: the CPU block kernel gathers weights per block)."""
    from jaxrlvr.model import config as model_config

    fields = dict(dtype="bfloat16", param_dtype="float32", remat=True, scan_layers=True)
    if name == "qwen2.5-math-1.5b":
        return qwen25_math_1_5b(**overrides)
    if name == "qwen3-1.7b":
        return model_config.ModelConfig.qwen3_1_7b(**{**fields, **overrides})
    if name == "qwen3-30b-a3b":
        fields["moe_impl"] = moe_impl
        return model_config.ModelConfig.qwen3_30b_a3b(**{**fields, **overrides})
    raise ValueError(f"--model {name!r}: expected one of {', '.join(MODELS)}")


def tiny_model(**overrides):
    return common.tiny(**{"dtype": "bfloat16", "remat": True, **overrides})


LORA_CHOICES = ("off", "f32", "bf16")


def model_overrides(lora: str, rank: int) -> dict:
    """ModelConfig fields of a ``--lora`` choice: none, or LoRA on a float32 / bfloat16 base."""
    if lora == "off":
        return {}
    from jaxrlvr.model import lora as lora_lib

    dtype = {"f32": "float32", "bf16": "bfloat16"}[lora]
    return dict(param_dtype=dtype, lora=lora_lib.LoRAConfig(rank=rank, alpha=2.0 * rank))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Case:
    fsdp: int
    chunk_size: int | None
    packing: bool
    rows_per_device: int
    rollouts: int
    seq: int
    tiny: bool
    lora: str = "off"
    lora_rank: int = 16
    model: str = "qwen2.5-math-1.5b"
    moe_impl: str = "ragged_dot"
    expert: int = 1  # the mesh's expert axis (of the ``fsdp`` devices; the rest is fsdp)
    attention_chunk: int | None = None  # ``model.attention_query_chunk``

    @property
    def rows_per_microbatch(self) -> int:
        return self.rows_per_device * self.fsdp

    @property
    def microbatches(self) -> int:
        return self.rollouts // self.rows_per_microbatch

    def argv(self) -> list[str]:
        return ["--_case", json.dumps(dataclasses.asdict(self))]


def _rollouts_shape(case: Case):
    """The host rollouts of ``case`` as shapes: padded rows, or packed rows (segment ids,
    positions and per-token advantages) with ``--packing on``."""
    import jax
    import jax.numpy as jnp

    from jaxrlvr.algos import batch as batch_lib

    b, t = case.rollouts, case.seq
    i32, f32 = jnp.int32, jnp.float32
    fields = dict(
        input_ids=jax.ShapeDtypeStruct((b, t), i32),
        attention_mask=jax.ShapeDtypeStruct((b, t), i32),
        labels=jax.ShapeDtypeStruct((b, t), i32),
        loss_mask=jax.ShapeDtypeStruct((b, t), f32),
        advantages=jax.ShapeDtypeStruct((b,), f32),
    )
    if case.packing:
        fields["segment_ids"] = jax.ShapeDtypeStruct((b, t), i32)
        fields["positions"] = jax.ShapeDtypeStruct((b, t), i32)
        fields["advantages"] = jax.ShapeDtypeStruct((b, t), f32)  # per token when packed
    return batch_lib.Batch(**fields)


def train_config(case: Case):
    """The ``TrainConfig`` whose RL phase is measured: configs/r1_zero_qwen2.5_math_1.5b.yaml with
    the case's chunking (the model comes from ``qwen25_math_1_5b`` / ``tiny_model``, no weights)."""
    chunk = "null" if case.chunk_size is None else str(case.chunk_size)
    return common.train_config(
        [f"rl.logprob_chunk_size={chunk}", f"rl.microbatches={case.microbatches}"],
        path=CONFIG,
    )


def measure(case: Case) -> dict:
    """Lower and compile the GRPO update of ``case`` in this process (its devices must already
    be the case's fake CPU devices); the memory analysis in bytes and the compile seconds."""
    import jax
    from flax import nnx

    from jaxrlvr import model as model_lib
    from jaxrlvr.algos import step

    overrides = model_overrides(case.lora, case.lora_rank)
    overrides["attention_query_chunk"] = case.attention_chunk
    cfg = (
        tiny_model(**overrides) if case.tiny else real_model(case.model, case.moe_impl, **overrides)
    )
    mesh = model_lib.make_mesh(
        model_lib.MeshConfig(data=1, fsdp=case.fsdp // case.expert, expert=case.expert, tensor=1),
        jax.devices()[: case.fsdp],
    )
    abstract = nnx.eval_shape(lambda: model_lib.Qwen2ForCausalLM(cfg, mesh=mesh))
    graphdef, params_shape = nnx.split(abstract, nnx.Param)
    # The trainer's record, state shardings and compiled update (bench.common.trainer_step).
    algo, compiled, _ = common.trainer_step(
        train_config(case), graphdef, params_shape, mesh, microbatches=case.microbatches
    )
    state_shape = jax.eval_shape(lambda p: algo.init(p, 0), params_shape)
    step.check_microbatch_split(case.rollouts, case.microbatches, mesh)
    # The batch the update receives: prepare's output for these rollouts, as shapes.
    batch, _ = jax.eval_shape(algo.prepare, state_shape, _rollouts_shape(case))
    start = time.perf_counter()
    lowered = compiled.lower_update(state_shape, batch)
    lower_s = time.perf_counter() - start
    start = time.perf_counter()
    program = lowered.compile()
    compile_s = time.perf_counter() - start
    m = program.memory_analysis()
    out = dict(
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        temporaries=m.temp_size_in_bytes,
        aliased=m.alias_size_in_bytes,
        code=m.generated_code_size_in_bytes,
    )
    out["total"] = out["arguments"] + out["outputs"] + out["temporaries"] - out["aliased"]
    from jaxrlvr.model import lora as lora_lib

    trained = sum(x.size for x in jax.tree.leaves(lora_lib.trainable(params_shape)))
    params = sum(x.size for x in jax.tree.leaves(params_shape))
    storage = cfg.storage_dtype.itemsize
    # Floor: the stored weights, plus float32 moments (2) and gradient accumulator of the trained.
    floor = (params * storage + trained * 3 * 4) / case.fsdp
    return dict(
        bytes=out,
        floor=floor,
        lower_s=lower_s,
        compile_s=compile_s,
        params=cfg.num_params(),
        trained_params=trained,
        devices=len(jax.devices()),
    )


def run_case(case: Case, timeout_s: float | None = None) -> dict:
    """``measure(case)`` in a fresh process on ``case.fsdp`` fake CPU devices; its record plus
    the "Involuntary full rematerialization" lines of its stderr."""
    env = common.worker_env()
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={case.fsdp}"
    with tempfile.TemporaryDirectory(prefix="jaxrlvr-bench-memory-") as tmp:
        path = os.path.join(tmp, "record.json")
        cmd = [sys.executable, "-m", "jaxrlvr.bench.memory", *case.argv(), "--_out", path]
        start = time.perf_counter()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return dict(case=dataclasses.asdict(case), error=f"timed out after {timeout_s} s")
        wall = time.perf_counter() - start
        err = proc.stderr or ""
        warnings = [line.strip() for line in err.splitlines() if REMAT_WARNING in line]
        if proc.returncode != 0 or not os.path.exists(path):
            tail = err.strip().splitlines()[-3:]
            return dict(case=dataclasses.asdict(case), error=f"exit {proc.returncode}: {tail}")
        with open(path) as f:
            record = json.load(f)
    record.update(
        case=dataclasses.asdict(case),
        wall_s=wall,
        remat_warnings=len(warnings),
        remat_warning_lines=warnings[:3],
    )
    return record


def _row(r: dict) -> str:
    c = r["case"]
    chunk = "off" if c["chunk_size"] is None else str(c["chunk_size"])
    lora = c.get("lora", "off")
    lora = lora if lora == "off" else f"r{c['lora_rank']}/{lora}"
    head = (
        f"{c['fsdp']:>4} {c['microbatches'] if 'microbatches' in c else '':>5}"
        f" {c['rows_per_device'] * c['fsdp']:>4} {chunk:>5} {'on' if c['packing'] else 'off':>4}"
        f" {lora:>8}"
    )
    if "error" in r:
        return f"{head}  error: {r['error']}"
    b = {k: v / GIB for k, v in r["bytes"].items()}
    return (
        f"{head} {b['arguments']:>7.2f} {b['outputs']:>7.2f} {b['temporaries']:>7.2f}"
        f" {b['aliased']:>7.2f} {b['total']:>7.2f} {r['floor'] / GIB:>7.2f}"
        f" {r['bytes']['total'] / r['floor']:>6.2f} {r['compile_s']:>8.1f} {r['remat_warnings']:>6}"
    )


HEADER = (
    "fsdp   mbs rows chunk pack     lora    args    outs   temps   alias   total   floor"
    "  /floor  compile  remat\n"
    "                                         (GiB per device)                             "
    "              (s)  warns"
)


def _flags(text: str, flag: str, p: argparse.ArgumentParser) -> list[bool]:
    return [item == "on" for item in common.comma_list(p, flag, text, ("off", "on"))]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--_case" in argv:
        return _worker(argv)
    p = common.parser("memory", __doc__)
    p.add_argument("--fsdp", default="1,8", help="comma list of fsdp sizes (fake CPU devices)")
    p.add_argument("--chunk", default="off,on", help="chunked log-probs: off,on")
    p.add_argument("--chunk-size", type=int, default=256, help="positions per chunk when on")
    p.add_argument("--packing", default="off", help="packed batch fields: off,on")
    p.add_argument("--rows-per-device", type=int, default=2, help="rows per device per microbatch")
    p.add_argument(
        "--lora", default="off", help="comma list: off (full), f32 / bf16 (LoRA on such a base)"
    )
    p.add_argument("--lora-rank", type=int, default=16, help="LoRA rank of the lora cases")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per configuration")
    p.add_argument("--tiny", action="store_true", help="a tiny model at a small shape (seconds)")
    p.add_argument(
        "--moe-impl",
        default="ragged_dot",
        choices=MOE_IMPLS,
        help="the MoE's grouped-matmul kernel (qwen3-30b-a3b; model.moe_impl)",
    )
    p.add_argument(
        "--expert",
        type=int,
        default=1,
        help="expert parallelism: the mesh's expert axis (of each --fsdp device count; MoE, "
        "with --moe-impl sorted_blocks: the ring dispatch, the one XLA:CPU compiles)",
    )
    p.add_argument(
        "--attention-chunk",
        type=int,
        default=None,
        help="attention over blocks of this many query positions "
        "(model.attention_query_chunk; default: all at once)",
    )
    p.add_argument(
        "--model", default=MODELS[0], help=f"comma list of architectures: {', '.join(MODELS)}"
    )
    args = p.parse_args(argv)
    try:
        sizes = [int(s) for s in args.fsdp.split(",") if s]
    except ValueError:
        p.error(f"--fsdp: expected a comma list of integers, got {args.fsdp!r}")
    models = common.comma_list(p, "--model", args.model, MODELS)
    if args.attention_chunk is not None and args.attention_chunk < 1:
        p.error(f"--attention-chunk={args.attention_chunk}: must be a positive integer")
    if args.expert < 1 or any(n % args.expert for n in sizes):
        p.error(f"--expert={args.expert}: must be a positive divisor of every --fsdp size")
    rollouts, seq = (16, 64) if args.tiny else (ROLLOUTS, PROMPT + RESPONSE)
    records = []
    print(HEADER, flush=True)
    loras = common.comma_list(p, "--lora", args.lora, LORA_CHOICES)
    for model, fsdp in [(m, n) for m in models for n in sizes]:
        if not args.tiny:
            ep = f" (expert={args.expert} x fsdp={fsdp // args.expert})" if args.expert > 1 else ""
            if args.attention_chunk:
                ep += f", attention in blocks of {args.attention_chunk} queries"
            print(f"-- {model}, {fsdp} devices{ep}", flush=True)
        for chunk in _flags(args.chunk, "--chunk", p):
            for packing in _flags(args.packing, "--packing", p):
                for lora in loras:
                    case = Case(
                        fsdp=fsdp,
                        chunk_size=(16 if args.tiny else args.chunk_size) if chunk else None,
                        packing=packing,
                        rows_per_device=args.rows_per_device,
                        rollouts=rollouts,
                        seq=seq,
                        tiny=args.tiny,
                        lora=lora,
                        lora_rank=args.lora_rank,
                        model=model,
                        moe_impl=args.moe_impl,
                        expert=args.expert,
                        attention_chunk=args.attention_chunk,
                    )
                    record = run_case(case, args.timeout)
                    record["case"]["microbatches"] = case.microbatches
                    records.append(record)
                    print(_row(record), flush=True)
    common.save_json(args.json, records)
    return 0 if all("error" not in r for r in records) else 1


def _worker(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="jaxrlvr bench memory (worker)")
    p.add_argument("--_case", required=True)
    p.add_argument("--_out", required=True)
    args = p.parse_args(argv)
    case = Case(**json.loads(args._case))
    common.save_json(args._out, measure(case))
    return 0


if __name__ == "__main__":
    sys.exit(main())
