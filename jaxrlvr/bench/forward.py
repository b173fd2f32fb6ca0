"""Forward throughput: jaxrlvr's Qwen2 against transformers' on the same weights and inputs.

For each shape, one random transformers ``Qwen2ForCausalLM`` (float32) is written with
``save_pretrained`` and loaded by ``jaxrlvr.model.load_hf``, so both sides hold identical weights.
Then, on the same [B, T] token batch with a full attention mask:

- ``jaxrlvr``: ``jax.jit`` of the split/merge functional forward (float32), timed after a warm-up
  call that compiles it; ``block_until_ready`` ends each timing;
- ``transformers``: ``model(input_ids, attention_mask)`` under ``torch.inference_mode`` (CPU,
  float32, ``attn_implementation="sdpa"``, torch's default thread count), after one warm-up call.

Each reports the median over ``--repeats`` calls as tokens/s (B x T / seconds), next to the max
|logit difference| of the two outputs (a check that the two sides really ran the same model).

Usage: ``jaxrlvr bench forward [--shapes tiny,small] [--repeats N] [--json PATH]`` (or
``python benchmarks/bench_forward.py``).
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
}


def run_shape(name: str, spec: dict, repeats: int, seed: int = 0) -> dict:
    import jax
    import numpy as np
    import torch
    import transformers
    from flax import nnx

    from jaxrlvr import model as M

    cfg = spec["model"](max_position_embeddings=max(512, spec["seq"]))
    hf_cfg = transformers.Qwen2Config(**common.hf_kwargs(cfg))
    torch.manual_seed(seed)
    torch_model = transformers.Qwen2ForCausalLM(hf_cfg).to(torch.float32).eval()
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
    common.add_repeats(parser, 5, "timed calls per system")
    args = parser.parse_args(argv)
    names = common.comma_list(parser, "--shapes", args.shapes, tuple(sorted(SHAPES)))

    import jax
    import torch

    rows = [run_shape(n, SHAPES[n], args.repeats) for n in names]
    print(format_table(rows))
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
        common.save_json(args.json, dict(benchmark="forward", env=env, results=rows))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
