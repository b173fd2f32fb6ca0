"""Forward throughput: jaxrlvr's decoder against transformers' on the same weights and inputs.

For each shape, one random transformers model (float32; ``Qwen2ForCausalLM``, or for the
``moe`` shape, ``common.moe_ref``, ``Qwen3MoeForCausalLM`` built from its config.json) is
written with ``save_pretrained`` and loaded by ``jaxrlvr.model.load_hf``, so both sides hold
identical weights.
Then, on the same [B, T] token batch with a full attention mask:

- ``jaxrlvr``: ``jax.jit`` of the split/merge functional forward (float32), timed after a warm-up
  call that compiles it; ``block_until_ready`` ends each timing;
- ``transformers``: ``model(input_ids, attention_mask)`` under ``torch.inference_mode`` (CPU,
  float32, ``attn_implementation="sdpa"``, torch's default thread count), after one warm-up call.

Each reports the median over ``--repeats`` calls as tokens/s (B x T / seconds), next to the max
|logit difference| of the two outputs (a check that the two sides really ran the same model).

``--dispatch``: the MoE block's expert dispatch alone (``moe.grouped_experts``, both kernels,
against ``moe.dense_experts``, the one-hot reference over all experts), jitted, float32, on
random tokens, router choices and weights at ``DISPATCH`` shapes: milliseconds of the forward and
of forward + backward (the gradient of a random projection of the output with respect to the
tokens and the three expert kernels), and the max |difference| to the reference.

Usage: ``jaxrlvr bench forward [--shapes tiny,small,moe] [--dispatch] [--repeats N]
[--json PATH]`` (or ``python benchmarks/bench_forward.py``).
Not a test: numbers depend on the machine and its load.
"""

from __future__ import annotations

import os
import platform
import sys
import tempfile
import time

from jaxrlvr.bench import common

# Model shape (a ``common`` factory) and batch; "small" is issue 4's update reference shape.
SHAPES = {
    "tiny": dict(model=common.tiny, batch=4, seq=128),
    "small": dict(model=common.update_ref, batch=4, seq=256),
    "moe": dict(model=common.moe_ref, batch=4, seq=256),
}

# Dispatch shapes: tokens N, hidden D, expert width F, experts E, top-k. "moe_ref" is one
# microbatch (4 x 256 tokens) of ``common.moe_ref``'s layer; "e64_k8" has Qwen3-30B-A3B's
# ratio of experts to top-k at a CPU-sized width.
DISPATCH = {
    "moe_ref": dict(n=1024, d=512, f=352, e=16, k=4),
    "e64_k8": dict(n=1024, d=512, f=256, e=64, k=8),
}


def run_shape(name: str, spec: dict, repeats: int, seed: int = 0) -> dict:
    import jax
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from jaxrlvr import model as M

    cfg = spec["model"](max_position_embeddings=max(512, spec["seq"]))
    torch.manual_seed(seed)
    if cfg.is_moe:
        fields = cfg.to_hf_config()
        hf_cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
        torch_model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    else:
        hf_cfg = transformers.Qwen2Config(**common.hf_kwargs(cfg))
        torch_model = transformers.Qwen2ForCausalLM(hf_cfg)
    torch_model = torch_model.to(torch.float32).eval()
    torch_model.config._attn_implementation = "sdpa"
    b, t = spec["batch"], spec["seq"]
    ids = np.random.default_rng(seed).integers(0, hf_cfg.vocab_size, (b, t), dtype=np.int32)
    mask = np.ones((b, t), np.int32)

    with tempfile.TemporaryDirectory() as tmp:
        torch_model.save_pretrained(tmp)
        lm = M.load_hf(tmp)
    graphdef, params = nnx.split(lm, nnx.Param)

    @jax.jit
    def forward(params, ids, mask):
        return nnx.merge(graphdef, params)(ids, mask)

    ids_j, mask_j = jax.numpy.asarray(ids), jax.numpy.asarray(mask)
    start = time.perf_counter()
    jax_logits = np.asarray(forward(params, ids_j, mask_j))
    compile_s = time.perf_counter() - start
    jax_s = common.median_seconds(
        lambda: forward(params, ids_j, mask_j).block_until_ready(), repeats
    )

    ids_t, mask_t = torch.as_tensor(ids, dtype=torch.long), torch.as_tensor(mask)
    with torch.inference_mode():
        torch_logits = torch_model(ids_t, attention_mask=mask_t).logits.float().numpy()
        torch_s = common.median_seconds(lambda: torch_model(ids_t, attention_mask=mask_t), repeats)

    tokens = b * t
    return dict(
        shape=name,
        params=M.param_count(params),
        batch=b,
        seq=t,
        jaxrlvr_tokens_per_s=tokens / jax_s,
        transformers_tokens_per_s=tokens / torch_s,
        jaxrlvr_s=jax_s,
        transformers_s=torch_s,
        jaxrlvr_compile_s=compile_s,
        speedup=torch_s / jax_s,
        max_abs_logit_diff=float(np.abs(jax_logits - torch_logits).max()),
    )


def run_dispatch(name: str, spec: dict, repeats: int, seed: int = 0) -> list[dict]:
    """Milliseconds of the expert dispatch kernels at one ``DISPATCH`` shape (module docstring)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxrlvr.model import moe

    n, d, f, e, k = (spec[x] for x in "ndfek")
    keys = jax.random.split(jax.random.PRNGKey(seed), 6)
    x = jax.random.normal(keys[0], (n, d), jnp.float32)
    probs = jax.nn.softmax(jax.random.normal(keys[1], (n, e), jnp.float32), axis=-1)
    ids, weights = moe.select_experts(probs, k, True)
    gate, up = (jax.random.normal(kk, (e, d, f), jnp.float32) / d**0.5 for kk in keys[2:4])
    down = jax.random.normal(keys[4], (e, f, d), jnp.float32) / f**0.5
    proj = jax.random.normal(keys[5], (n, d), jnp.float32)
    kernels = {
        "grouped/sorted_blocks": lambda *a: moe.grouped_experts(*a, impl="sorted_blocks"),
        "grouped/ragged_dot": lambda *a: moe.grouped_experts(*a, impl="ragged_dot"),
        "dense (reference)": moe.dense_experts,
    }
    rows, outs = [], []
    for kernel, fn in kernels.items():
        fwd = jax.jit(lambda x, g, u, dn, fn=fn: fn(x, ids, weights, g, u, dn))
        loss = lambda x, g, u, dn, fn=fn: jnp.sum(fn(x, ids, weights, g, u, dn) * proj)  # noqa: E731
        bwd = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
        out = np.asarray(fwd(x, gate, up, down))
        jax.block_until_ready(bwd(x, gate, up, down))
        outs.append(out)
        fwd_s = common.median_seconds(
            lambda fwd=fwd: fwd(x, gate, up, down).block_until_ready(), repeats
        )
        bwd_s = common.median_seconds(
            lambda bwd=bwd: jax.block_until_ready(bwd(x, gate, up, down)), repeats
        )
        rows.append(
            dict(
                shape=name,
                **spec,
                kernel=kernel,
                forward_ms=fwd_s * 1e3,
                forward_backward_ms=bwd_s * 1e3,
            )
        )
    dense = rows[-1]
    for r, out in zip(rows, outs):
        r["max_abs_diff"] = float(np.abs(out - outs[-1]).max())
        r["forward_speedup_vs_dense"] = dense["forward_ms"] / r["forward_ms"]
        r["forward_backward_speedup_vs_dense"] = (
            dense["forward_backward_ms"] / r["forward_backward_ms"]
        )
    return rows


def format_dispatch(rows: list[dict]) -> str:
    head = (
        f"{'shape':<8} {'N x D -> F, E top-k':>22} {'kernel':<22} {'fwd ms':>8} {'fwd+bwd ms':>10}"
        f" {'vs dense':>13} {'max|diff|':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        dims = f"{r['n']}x{r['d']}->{r['f']}, {r['e']} top-{r['k']}"
        lines.append(
            f"{r['shape']:<8} {dims:>22} {r['kernel']:<22} {r['forward_ms']:>8.1f}"
            f" {r['forward_backward_ms']:>10.1f} {r['forward_speedup_vs_dense']:>5.1f}x/"
            f"{r['forward_backward_speedup_vs_dense']:>5.1f}x {r['max_abs_diff']:>9.1e}"
        )
    return "\n".join(lines)


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'shape':<6} {'params':>11} {'B x T':>9} {'jaxrlvr tok/s':>14} "
        f"{'transformers tok/s':>19} {'jax/torch':>9} {'max|dlogit|':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['shape']:<6} {r['params']:>11,} {str(r['batch']) + ' x ' + str(r['seq']):>9} "
            f"{r['jaxrlvr_tokens_per_s']:>14,.0f} {r['transformers_tokens_per_s']:>19,.0f} "
            f"{r['speedup']:>8.2f}x {r['max_abs_logit_diff']:>11.1e}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = common.parser("forward", __doc__)
    parser.add_argument(
        "--shapes", default="tiny,small", help=f"comma list of {', '.join(sorted(SHAPES))}"
    )
    parser.add_argument(
        "--dispatch",
        action="store_true",
        help="also time the MoE dispatch kernels against the dense reference (DISPATCH shapes)",
    )
    common.add_repeats(parser, 5, "timed calls per system")
    args = parser.parse_args(argv)
    names = common.comma_list(parser, "--shapes", args.shapes, tuple(sorted(SHAPES)))

    import jax
    import torch

    rows = [run_shape(n, SHAPES[n], args.repeats) for n in names]
    print(format_table(rows))
    dispatch = []
    if args.dispatch:
        for n, spec in DISPATCH.items():
            dispatch += run_dispatch(n, spec, args.repeats)
        print(format_dispatch(dispatch))
    if args.json:
        env = dict(
            machine=platform.machine(),
            cpu_count=os.cpu_count(),
            load_avg_1m=os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            jax=jax.__version__,
            jax_backend=jax.default_backend(),
            torch=torch.__version__,
            torch_threads=torch.get_num_threads(),
        )
        common.save_json(
            args.json, dict(benchmark="forward", env=env, results=rows, dispatch=dispatch)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
