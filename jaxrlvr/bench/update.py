"""GRPO update throughput: jaxrlvr against a PyTorch reference of the same update, same weights.

Each system runs in its own subprocess (so peak RSS is per system) on identical shapes, initial
weights (one Hugging Face checkpoint written by jaxrlvr's ``save_hf``) and batch (NumPy seed):

- ``jaxrlvr``: the trainer's own path: the GRPO record that ``jaxrlvr train`` builds from its
  config (``registry.build`` on a ``TrainConfig``: rl.algo grpo, the loss and AdamW
  settings below, one epoch) compiled by ``step.CompiledAlgorithm`` (donated state, explicit
  shardings on a one-device mesh); ``prepare`` places the rollouts, the timed step is
  ``update``: microbatches by ``lax.scan``, decoder layers unrolled (``scan_layers=False``, the
  faster step; ``--scan-layers`` times the scanned stack instead). ``compile_s`` is the first
  call's excess over the fastest timed step;
- ``torch``: transformers ``Qwen2ForCausalLM`` (float32, ``attn_implementation="sdpa"``, all
  cores), the same GRPO clipped loss with the same full-batch ``seq_mean_token_mean``
  aggregation, gradient accumulation, ``clip_grad_norm_`` and ``torch.optim.AdamW``.

Reference shape (the issue's): vocab 8192, hidden 512, intermediate 1408, 8 layers, 8 heads,
2 KV heads, untied, float32 (~31M params); 16 x 256 tokens (64 prompt + 192 response) per step
in 4 microbatches of 4. ``--tiny`` runs a small shape in seconds.

MFU = model FLOPs per step / step time / peak, with model FLOPs = tokens x
``ModelConfig.flops_per_token(T)`` (the one formula every MFU figure uses: 6 x the matmul
params including the lm_head + 12 x layers x heads x head_dim x T for attention), and
peak = the best fp32 dense-matmul throughput measured in the same run (the larger of JAX's and
torch's).

``--lengths r1zero``: the same shape and number of rollouts, but response lengths drawn like
R1-Zero's, heavy-tailed: log-normal with median 1/4 of the response budget and sigma 1.0, rounded
and clipped to [8, budget] (NumPy seed 0; for the reference shape: median 48 of 192 tokens, about
8% of the draws at the budget). jaxrlvr packs the rollouts (``rollout.pack(segments=True)``) into
rows of the reference's row length (256), and fills microbatches by the reference's token budget
(at most its 4 rows x 256 positions each: ``rollout.budget_rows``), so the update computes the
real tokens plus the packing remainder; the PyTorch reference pads as TRL does: every row
right-padded to the longest sequence of the batch, the same 4 microbatches of 4 rows. Throughput
is counted in real (non-padding) tokens per second for both; ``computed`` is the positions each
system ran, padding included. MFU counts real tokens.

``--moe``: the reference shape as a Qwen3-MoE (``common.moe_ref``: 16 experts of width 352,
top-4, QK-norm; ~83M parameters, ~31M active, so the same active size and batch): jaxrlvr's
grouped dispatch (``moe_impl="auto"``, the sorted-blocks kernel on CPU) against transformers'
``Qwen3MoeForCausalLM`` (the checkpoint's config.json picks it; its experts implementation is
recorded in ``version``). MFU counts the active parameters.

``--demo``: configs/demo.yaml's model (vocab 104, hidden 128, MLP 384, 3 layers, 4/2 heads,
tied) at its GRPO step's shape (128 rows x 31 positions, one microbatch). ``--op-classes``: the
jaxrlvr worker also traces its timed steps with JAX's profiler and reports milliseconds per
XLA:CPU op class (``op_classes``: matmul fusions, scatters, gathers, sorts, zero-filling
broadcasts, copies, the layer scan's slices, while loops, elementwise). ``--demo-moe``:
configs/demo_moe.yaml's Qwen3-MoE at its GRPO step's shape (32 rows x 63 positions).

Usage: ``jaxrlvr bench update [--tiny | --demo | --demo-moe | --moe] [--op-classes]
[--lengths fixed|r1zero] [--json PATH] [--repeats N] [--systems jaxrlvr,torch]`` (or ``python
benchmarks/bench_update.py``); ``--repeats``: timed steps per system.
Not a test: timings are for the closing note and for spotting regressions.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from jaxrlvr.bench import common

if TYPE_CHECKING:
    from jaxrlvr.model import config as model_config

# Model shape (a ``common`` factory, called only where JAX is loaded anyway) and batch.
SHAPES = {
    "reference": dict(model=common.update_ref, batch=16, prompt=64, response=192, microbatches=4),
    # configs/demo.yaml's model and GRPO step: 128 packed rows of 31 positions, one microbatch.
    "demo": dict(
        model=functools.partial(
            common.qwen2,
            vocab=104,
            hidden=128,
            mlp=384,
            layers=3,
            heads=4,
            kv_heads=2,
            tie_word_embeddings=True,
        ),
        batch=128,
        prompt=15,
        response=16,
        microbatches=1,
    ),
    # configs/demo_moe.yaml's model (8 experts of 192 top-2, QK-norm, head_dim 32) at its GRPO
    # step (32 packed rows of 63 positions, one microbatch).
    "demo_moe": dict(
        model=functools.partial(
            common.qwen2,
            vocab=104,
            hidden=128,
            mlp=384,
            layers=3,
            heads=4,
            kv_heads=2,
            tie_word_embeddings=True,
            model_type="qwen3_moe",
            head_dim_override=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=192,
            norm_topk_prob=True,
        ),
        batch=32,
        prompt=15,
        response=48,
        microbatches=1,
    ),
    "moe": dict(model=common.moe_ref, batch=16, prompt=64, response=192, microbatches=4),
    "tiny": dict(
        model=functools.partial(common.tiny, tie_word_embeddings=False),
        batch=8,
        prompt=8,
        response=24,
        microbatches=2,
    ),
}
LR, CLIP_EPS, MAX_GRAD_NORM, BETAS, EPS = 1e-5, 0.2, 1.0, (0.9, 0.95), 1e-8


@dataclasses.dataclass(frozen=True, kw_only=True)
class Shape:
    model: Callable[..., model_config.ModelConfig]
    batch: int
    prompt: int
    response: int
    microbatches: int

    @property
    def seq(self) -> int:
        return self.prompt + self.response

    @property
    def tokens(self) -> int:
        return self.batch * self.seq

    @property
    def config(self) -> model_config.ModelConfig:
        return self.model(max_position_embeddings=max(512, self.seq))


def make_batch(shape: Shape, vocab_size: int, seed: int = 0) -> dict:
    """Right-padded rows: prompt, a random-length response (>= 3/4 of the budget), padding."""
    import numpy as np

    rng = np.random.default_rng(seed)
    b, t, v = shape.batch, shape.seq, vocab_size
    full = rng.integers(0, v, (b, t + 1)).astype(np.int32)
    lengths = rng.integers(3 * shape.response // 4, shape.response + 1, b)
    pos = np.arange(t)[None, :]
    attn = pos < (shape.prompt + lengths)[:, None]
    loss_mask = (pos >= shape.prompt - 1) & (pos < (shape.prompt - 1 + lengths)[:, None])
    return dict(
        input_ids=full[:, :-1],
        attention_mask=attn.astype(np.int32),
        labels=full[:, 1:],
        loss_mask=loss_mask,
        advantages=rng.normal(size=b).astype(np.float32),
    )


def r1zero_lengths(shape: Shape, seed: int = 0):
    """Response lengths like R1-Zero's: log-normal, median budget / 4, sigma 1, in [8, budget]."""
    import numpy as np

    rng = np.random.default_rng(seed)
    draws = rng.lognormal(np.log(shape.response / 4), 1.0, shape.batch)
    return np.clip(np.rint(draws), 8, shape.response).astype(int)


def make_r1zero_batch(shape: Shape, vocab_size: int, *, packed: bool, seed: int = 0) -> dict:
    """The ``--lengths r1zero`` rollouts (prompt of ``shape.prompt`` tokens, response of an
    ``r1zero_lengths`` length), padded as TRL pads (right, to the batch's longest sequence) or
    packed as jaxrlvr's driver packs (rows of ``shape.seq`` positions, microbatches of at most
    ``shape.batch / shape.microbatches`` rows); adds ``num_microbatches``."""
    import numpy as np

    from jaxrlvr import rollout

    rng = np.random.default_rng(seed + 1)
    lengths = r1zero_lengths(shape, seed)
    prompts = [list(rng.integers(0, vocab_size, shape.prompt)) for _ in lengths]
    # One extra token: a sequence of prompt + response tokens occupies prompt + length positions.
    comps = [list(rng.integers(0, vocab_size, n + 1)) for n in lengths]
    adv = rng.normal(size=shape.batch).astype(np.float32)
    if packed:
        probe = rollout.pack(prompts, comps, pad_id=0, segments=True, length=shape.seq)
        rows = int(probe.attention_mask.any(axis=1).sum())
        budget = shape.seq * (shape.batch // shape.microbatches)  # the reference's positions
        batch_rows, n = rollout.budget_rows(rows, shape.seq, budget)
        p = rollout.pack(
            prompts, comps, pad_id=0, segments=True, length=shape.seq, batch_size=batch_rows
        )
    else:
        n = shape.microbatches
        p = rollout.pack(prompts, comps, pad_id=0, length=max(map(len, prompts)) + max(lengths))
    out = rollout.to_batch(p, advantages=adv)
    out = {k: np.asarray(v) for k, v in out.as_dict().items()}
    out["num_microbatches"] = n
    return out


def model_flops_per_step(shape: Shape, tokens: int | None = None, seq: int | None = None) -> float:
    """Model FLOPs of ``tokens`` (default: the shape's) in rows of ``seq`` positions."""
    seq = shape.seq if seq is None else seq
    tokens = shape.tokens if tokens is None else tokens
    return tokens * shape.config.flops_per_token(seq)


def _batch(shape: Shape, vocab_size: int, lengths: str, *, packed: bool) -> dict:
    if lengths == "r1zero":
        return make_r1zero_batch(shape, vocab_size, packed=packed)
    return {**make_batch(shape, vocab_size), "num_microbatches": shape.microbatches}


def _token_counts(raw: dict) -> dict:
    return {
        "real_tokens": int(raw["attention_mask"].sum()),
        "computed_tokens": int(raw["input_ids"].size),
        "rows": int(raw["input_ids"].shape[0]),
        "row_length": int(raw["input_ids"].shape[1]),
        "num_microbatches": int(raw["num_microbatches"]),
    }


# ---------------------------------------------------------------------------------------------
# Workers (each runs in its own process).


def _worker_init(shape: Shape, weights: str) -> dict:
    from jaxrlvr import model as M

    cfg = shape.config
    M.save_hf(M.init_model(cfg, seed=0), weights)
    return {"num_params": cfg.num_params()}


def _jax_matmul_gflops(n: int = 2048, repeats: int = 10) -> float:
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.PRNGKey(0), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, a).block_until_ready()
    best = min(common.timed_calls(lambda: f(a, a).block_until_ready(), repeats))
    return 2 * n**3 / best / 1e9


# Trace events that are the host's spans, not XLA ops: Python frames ("$..."), the executor's
# own spans and the waits around a call ("np.asarray(jax.Array)" lasts as long as the step it
# waits for; counted as an op it made "elementwise" look like two thirds of the step).
HOST_SPANS = (
    "$",
    "ThunkExecutor",
    "np.asarray",
    "PjitFunction",
    "SlinkyThreadPool",
    "CommonPjRt",
    "ParseArguments",
    "end: ",
)


def op_kind(name: str) -> str | None:
    """The op class of one XLA:CPU trace event's name; None for the host's spans."""
    if name.startswith(HOST_SPANS):
        return None
    if name.startswith(("ynn_fusion", "xnn_fusion")) or "dot" in name:
        return "matmul"
    if "scatter" in name:
        return "scatter"
    if "gather" in name:
        return "gather"
    if "sort" in name:
        return "sort"
    if "broadcast" in name:
        return "broadcast"
    if name.startswith("copy"):
        return "copy"
    if "dynamic" in name:
        return "scan_slices"
    if name.startswith("while"):
        return "while"
    return "elementwise"


def classify(events: list[dict], steps: int) -> dict[str, float]:
    """Milliseconds per step by op class of a Chrome-trace event list (complete events only)."""
    out: dict[str, float] = {}
    for e in events:
        kind = op_kind(e.get("name", "")) if e.get("ph") == "X" else None
        if kind is not None:
            out[kind] = out.get(kind, 0.0) + e["dur"] / 1000 / steps
    return out


def op_classes(fn: Callable[[], Any], steps: int) -> dict[str, float]:
    """Milliseconds per call of ``fn`` by XLA:CPU op class, from JAX's profiler trace of
    ``steps`` calls (``jax.profiler.trace``, one event per executed thunk; threads summed, so the
    classes add up to more than the wall time when both cores work). Classes: matmul fusions
    (XNNPACK/YNN dot fusions, ``dot``), ``broadcast`` (zero-filled buffers: the layer scan's
    stacked residuals and accumulators), copies, the scan's dynamic(-update)-slices, while loops,
    the rest (elementwise and reduction fusions); the host's own spans (``HOST_SPANS``) are left
    out."""
    import glob
    import gzip
    import json

    import jax

    with tempfile.TemporaryDirectory(prefix="bench-update-trace-") as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                fn()
        (path,) = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
        with gzip.open(path) as f:
            events = json.load(f)["traceEvents"]
    return classify(events, steps)


def train_overrides(microbatches: int) -> list[str]:
    """The ``jaxrlvr train`` config of the timed GRPO step: the reference update's loss and AdamW
    settings, one epoch on fresh rollouts (as the torch reference)."""
    return [
        "rl.algo=grpo",
        f"rl.microbatches={microbatches}",
        "rl.loss.aggregation=seq_mean_token_mean",
        f"rl.loss.clip_eps_low={CLIP_EPS}",
        f"rl.loss.clip_eps_high={CLIP_EPS}",
        f"optim.learning_rate={LR}",
        f"optim.max_grad_norm={MAX_GRAD_NORM}",
        f"optim.b1={BETAS[0]}",
        f"optim.b2={BETAS[1]}",
        f"optim.eps={EPS}",
    ]


def _worker_jax(
    shape: Shape,
    weights: str,
    steps: int,
    remat: bool,
    scan_layers: bool,
    lengths: str,
    profile: bool = False,
) -> dict:
    import jax
    import numpy as np
    from flax import nnx

    from jaxrlvr import model as M
    from jaxrlvr.algos import batch as batch_lib

    mesh = M.make_mesh(M.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    lm = M.load_hf(
        weights,
        dtype="float32",
        param_dtype="float32",
        mesh=mesh,
        remat=remat,
        scan_layers=scan_layers,
    )
    graphdef, params = nnx.split(lm, nnx.Param)
    raw = _batch(shape, lm.config.vocab_size, lengths, packed=True)
    counts = _token_counts(raw)
    n = raw.pop("num_microbatches")
    # The trainer's path: the record of ``jaxrlvr train``'s config, compiled by
    # step.CompiledAlgorithm; prepare places the host rollouts, update is the timed step.
    cfg = common.train_config(train_overrides(shape.microbatches))
    params_shape = jax.eval_shape(lambda p: p, params)
    algo, compiled, shardings = common.trainer_step(
        cfg, graphdef, params_shape, mesh, microbatches=n
    )
    holder = {"state": jax.device_put(algo.init(params, 0), shardings)}
    del params, lm
    rollouts = batch_lib.Batch(**{k: np.asarray(v) for k, v in raw.items()})
    t0 = time.perf_counter()
    batch, _ = compiled.prepare(holder["state"], rollouts)
    jax.block_until_ready(batch)
    prepare_first_s = time.perf_counter() - t0

    def run():
        holder["state"], metrics = compiled.update(holder["state"], batch)
        holder["loss"] = float(metrics["loss"])  # blocks until the step is done

    t0 = time.perf_counter()
    run()  # warmup: compiles
    first_s = time.perf_counter() - t0
    times = common.timed_calls(run, steps)
    classes = op_classes(run, steps) if profile else None
    return {
        "step_times_s": times,
        "op_classes_ms": classes,
        # The first call compiles and runs one step: its excess over a steady step.
        "compile_s": max(first_s - min(times), 0.0),
        "prepare_first_s": prepare_first_s,
        "matmul_gflops": _jax_matmul_gflops(),
        "peak_rss_mib": common.peak_rss_mib(),
        "final_loss": holder["loss"],
        "version": f"jax {jax.__version__}",
        **counts,
    }


def _worker_torch(shape: Shape, weights: str, steps: int, threads: int, lengths: str) -> dict:
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        weights, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)
    raw = _batch(shape, model.config.vocab_size, lengths, packed=False)
    counts = _token_counts(raw)
    raw.pop("num_microbatches")
    b = {k: torch.from_numpy(v) for k, v in raw.items()}
    ids, attn, labels = b["input_ids"].long(), b["attention_mask"].long(), b["labels"].long()
    mask, adv = b["loss_mask"].float(), b["advantages"].float()
    n, bsz = shape.microbatches, shape.batch
    rows = [torch.arange(j, bsz, n) for j in range(n)]  # same strided split as jaxrlvr

    def logp_of(idx):
        logits = model(input_ids=ids[idx], attention_mask=attn[idx]).logits.float()
        lse = torch.logsumexp(logits, dim=-1)
        return torch.gather(logits, -1, labels[idx].unsqueeze(-1)).squeeze(-1) - lse

    with torch.no_grad():
        old = torch.zeros(ids.shape)
        for idx in rows:
            old[idx] = logp_of(idx)

    def run():
        opt.zero_grad(set_to_none=True)
        for idx in rows:
            lp, m = logp_of(idx), mask[idx]
            ratio = torch.exp(lp - old[idx])
            a = adv[idx][:, None]
            pg = -torch.minimum(ratio * a, torch.clamp(ratio, 1 - CLIP_EPS, 1 + CLIP_EPS) * a)
            per_row = (pg * m).sum(-1) / m.sum(-1).clamp(min=1.0)
            (per_row.sum() / bsz).backward()  # full-batch seq_mean_token_mean denominator
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        opt.step()

    t0 = time.perf_counter()
    run()  # warmup (torch has no compile step; this is its first-step overhead)
    first_s = time.perf_counter() - t0
    times = common.timed_calls(run, steps)
    a = torch.randn(2048, 2048)
    best = min(common.timed_calls(lambda: torch.mm(a, a), 10))
    experts = getattr(model.config, "_experts_implementation", None)
    return {
        "step_times_s": times,
        "compile_s": 0.0,
        "first_step_s": first_s,
        "matmul_gflops": 2 * 2048**3 / best / 1e9,
        "peak_rss_mib": common.peak_rss_mib(),
        "version": f"torch {torch.__version__}, transformers {transformers.__version__}"
        + (f", experts_implementation={experts}" if experts else ""),
        **counts,
    }


def _run_worker(kind: str, args: argparse.Namespace, weights: str) -> dict:
    argv = ["--_worker", kind, "--_weights", weights]
    argv += ["--repeats", str(args.repeats), "--threads", str(args.threads)]
    argv += ["--lengths", args.lengths]
    flags = (("--tiny", args.tiny), ("--remat", args.remat), ("--scan-layers", args.scan_layers))
    flags += (("--demo", args.demo), ("--moe", args.moe), ("--op-classes", args.op_classes))
    flags += (("--demo-moe", args.demo_moe),)
    argv += [flag for flag, on in flags if on]
    return common.run_worker("jaxrlvr.bench.update", argv)


def main(argv=None) -> int:
    p = common.parser("update", __doc__)
    p.add_argument("--tiny", action="store_true", help="small shape for a quick run")
    p.add_argument(
        "--demo",
        action="store_true",
        help="configs/demo.yaml's model and GRPO step shape (128 x 31 positions, 0.6M params)",
    )
    p.add_argument(
        "--demo-moe",
        action="store_true",
        help="configs/demo_moe.yaml's model and GRPO step shape (32 x 63 positions)",
    )
    p.add_argument(
        "--moe",
        action="store_true",
        help="the reference shape as a Qwen3-MoE (16 experts top-4, ~31M of ~83M params active)",
    )
    p.add_argument(
        "--op-classes",
        action="store_true",
        help="jaxrlvr: also trace the timed steps and report milliseconds per XLA:CPU op class",
    )
    common.add_repeats(p, 5, "timed steps per system, after 1 warm-up step")
    p.add_argument("--systems", default="jaxrlvr,torch", help="comma list of jaxrlvr, torch")
    p.add_argument(
        "--lengths",
        choices=("fixed", "r1zero"),
        default="fixed",
        help="response lengths: fixed (>= 3/4 of the budget, padded rows) or r1zero (heavy-tailed; "
        "jaxrlvr packs, torch pads as TRL)",
    )
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads")
    p.add_argument("--remat", action="store_true", help="jaxrlvr: rematerialise each layer")
    p.add_argument(
        "--scan-layers",
        action="store_true",
        help="jaxrlvr: lax.scan over the layers (faster compile) instead of the unrolled loop",
    )
    p.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_weights", default=None, help=argparse.SUPPRESS)
    p.add_argument("--_out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.tiny + args.demo + args.moe + args.demo_moe > 1:
        p.error("--tiny, --demo, --demo-moe and --moe are shapes: choose one")
    name = "tiny" if args.tiny else "demo" if args.demo else "moe" if args.moe else "reference"
    name = "demo_moe" if args.demo_moe else name
    shape = Shape(**SHAPES[name])

    if args._worker is not None:
        if args._worker == "init":
            rec = _worker_init(shape, args._weights)
        elif args._worker == "jaxrlvr":
            rec = _worker_jax(
                shape,
                args._weights,
                args.repeats,
                args.remat,
                args.scan_layers,
                args.lengths,
                args.op_classes,
            )
        else:
            rec = _worker_torch(shape, args._weights, args.repeats, args.threads, args.lengths)
        common.save_json(args._out, rec)
        return 0

    systems = common.comma_list(p, "--systems", args.systems, ("jaxrlvr", "torch"))
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-update-") as tmp:
        weights = os.path.join(tmp, "weights")
        info = _run_worker("init", args, weights)
        for s in systems:
            results[s] = _run_worker(s, args, weights)
    peak = max(r["matmul_gflops"] for r in results.values()) * 1e9
    records = []
    for s, r in results.items():
        step_s = statistics.median(r["step_times_s"])
        tokens = r["real_tokens"] if args.lengths == "r1zero" else r["computed_tokens"]
        flops = model_flops_per_step(shape, tokens, r["row_length"])
        records.append(
            {
                "benchmark": "update",
                "system": s,
                "shape": name,
                "num_params": info["num_params"],
                "lengths": args.lengths,
                # fixed: every position counts (as before r1zero existed); r1zero: real tokens.
                "tokens_per_step": tokens,
                "computed_tokens_per_step": r["computed_tokens"],
                "rows": r["rows"],
                "row_length": r["row_length"],
                "microbatches": r["num_microbatches"],
                "remat": bool(args.remat) if s == "jaxrlvr" else False,
                "scan_layers": bool(args.scan_layers) if s == "jaxrlvr" else False,
                "tokens_per_s": tokens / step_s,
                "step_s": step_s,
                "step_times_s": r["step_times_s"],
                "mfu": flops / step_s / peak,
                "model_flops_per_step": flops,
                "peak_matmul_gflops": peak / 1e9,
                "matmul_gflops": r["matmul_gflops"],
                "peak_rss_mib": r["peak_rss_mib"],
                "compile_s": r["compile_s"],
                "op_classes_ms": r.get("op_classes_ms"),
                "version": r["version"],
            }
        )
    print(f"shape={name} lengths={args.lengths} params={info['num_params'] / 1e6:.1f}M "
          f"peak fp32 matmul={peak / 1e9:.0f} GFLOP/s")  # fmt: skip
    print(
        f"{'system':>8} {'real_tok/s':>10} {'real':>6} {'computed':>8} {'rows x T':>9} {'mb':>3} "
        f"{'step_s':>7} {'mfu':>5} {'rss_MiB':>8} {'compile_s':>9}"
    )
    for r in records:
        print(
            f"{r['system']:>8} {r['tokens_per_s']:10.1f} {r['tokens_per_step']:6d} "
            f"{r['computed_tokens_per_step']:8d} {r['rows']:>4}x{r['row_length']:<4d} "
            f"{r['microbatches']:3d} {r['step_s']:7.3f} {r['mfu']:5.2f} "
            f"{r['peak_rss_mib']:8.0f} {r['compile_s']:9.2f}"
        )
    if "jaxrlvr" in results and "torch" in results:
        j, t = (next(r for r in records if r["system"] == s) for s in ("jaxrlvr", "torch"))
        print(f"jaxrlvr / torch real tokens/s: {j['tokens_per_s'] / t['tokens_per_s']:.2f}x")
    for r in records:
        if r.get("op_classes_ms"):
            total = sum(r["op_classes_ms"].values())
            parts = sorted(r["op_classes_ms"].items(), key=lambda kv: -kv[1])
            print(
                f"{r['system']} op classes, ms per step (threads summed, {total:.1f} in all): "
                + ", ".join(f"{k} {v:.1f} ({v / total:.0%})" for k, v in parts)
            )
    common.save_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
