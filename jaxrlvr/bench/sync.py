"""Weight-sync benchmark: export + reload time of `VLLMSampler.update_weights` against model size.

For each shape, a random jaxrlvr Qwen2 is saved with `save_hf`, a CPU vLLM server is started on it,
and the params are perturbed and synced `--repeats` times (each sync sends different weights, so
nothing is skipped). Reports the median of each part (export, pause, reload, reset, resume,
confirm, total) and checks after the last sync that the server reports the new version and still
generates. The first sync writes a new file; later ones overwrite its tensors in place
(``weight_export``'s ``in_place``), so ``all_in_place`` and the per-sync ``all_*`` lists show
both, and ``bytes_written`` counts the untied ``lm_head`` copy that ``bytes`` (the parameters)
does not. Shapes: "ref" is the issue's reference shape (vocab 8192, hidden 256, intermediate 704,
4 layers, 4 heads, 2 KV heads, untied, float32, ~7M params); "50m" is a ~50M-param random model.

Usage: ``jaxrlvr bench sync [--json PATH] [--vllm-python PATH] [--shapes ref,50m] [--repeats N]``
(or ``python benchmarks/bench_sync.py``); ``--vllm-python`` defaults to env JAXRLVR_VLLM_PYTHON.
Not a test: numbers are for the closing note and for spotting regressions by eye.
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import tempfile
import time

from jaxrlvr.bench import common
from jaxrlvr.model import config as model_config

# Model shapes as ``common`` factories (float32, untied, 512 positions).
SHAPES = {
    "ref": common.sampler_ref,
    "50m": functools.partial(
        common.qwen2, vocab=8192, hidden=640, mlp=1728, layers=10, heads=10, kv_heads=2
    ),
    "0.5b": lambda: model_config.ModelConfig.qwen2_5_0_5b(max_position_embeddings=512),
}
PARTS = (
    "to_host_s",
    "write_s",
    "export_s",
    "pause_s",
    "reload_s",
    "reset_s",
    "resume_s",
    "confirm_s",
    "total_s",
)


def _tokenizer(directory: str):
    """A small byte-level BPE tokenizer trained locally (vLLM needs tokenizer files)."""
    import tokenizers
    import transformers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 50, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(directory)
    return fast


def bench_shape(name: str, python: str, repeats: int, workdir: str) -> dict:
    import jax
    from flax import nnx

    from jaxrlvr import model as jmodel
    from jaxrlvr.sampling import base, vllm_sampler, vllm_server

    cfg = SHAPES[name]()
    graphdef, params = nnx.split(jmodel.init_model(cfg, seed=0), nnx.Param)
    model_dir = os.path.join(workdir, name)
    jmodel.save_hf(nnx.merge(graphdef, params), model_dir, tokenizer_src=_tokenizer(model_dir))

    t0 = time.perf_counter()
    server = vllm_server.VLLMServer(
        model_dir, python=python, max_model_len=256, log_path=os.path.join(workdir, f"{name}.log")
    )
    startup_s = time.perf_counter() - t0
    try:
        with vllm_sampler.VLLMSampler(cfg, server) as sampler:
            t0 = time.perf_counter()
            sampler.generate([[1, 2, 3]], 1, base.SamplingParams(max_tokens=4, seed=0))
            first_request_s = time.perf_counter() - t0
            runs = []
            for i in range(repeats):
                key = jax.random.key(100 + i)
                leaves, treedef = jax.tree.flatten(params)
                keys = jax.random.split(key, len(leaves))
                noise = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
                new = jax.tree.unflatten(treedef, [x + 1e-3 * e for x, e in zip(leaves, noise)])
                jax.block_until_ready(new)  # time the sync, not the perturbation
                runs.append(sampler.update_weights(new))
            versions = sampler.live_versions()
            out = sampler.generate([[1, 2, 3]], 2, base.SamplingParams(max_tokens=4, seed=0))
            assert versions == [str(repeats)] and len(out) == 2, (versions, out)
    finally:
        server.stop()
    record = {
        "benchmark": "sync",
        "system": "vllm",
        "shape": name,
        "num_params": cfg.num_params(),
        "bytes": 4 * cfg.num_params(),  # float32 parameters (the CPU server's dtype)
        "repeats": repeats,
        "startup_s": startup_s,
        "first_request_s": first_request_s,
    }
    for part in PARTS:
        record[part] = statistics.median(r[part] for r in runs)
    record["export_plus_reload_s"] = statistics.median(r["export_s"] + r["reload_s"] for r in runs)
    record["all_total_s"] = [r["total_s"] for r in runs]
    record["all_export_plus_reload_s"] = [r["export_s"] + r["reload_s"] for r in runs]
    record["all_in_place"] = [bool(r["in_place"]) for r in runs]
    record["bytes_written"] = runs[-1]["bytes_written"] if runs else 0.0
    return record


def main(argv=None) -> int:
    parser = common.parser("sync", __doc__)
    common.add_vllm_python(parser, " (required)")
    parser.add_argument("--shapes", default="ref,50m", help=f"comma list of {', '.join(SHAPES)}")
    common.add_repeats(parser, 5, "timed syncs per shape")
    args = parser.parse_args(argv)
    if not args.vllm_python:
        parser.error(
            f"need --vllm-python or env {common.VLLM_PYTHON_ENV} (see scripts/setup_vllm.sh)"
        )
    shapes = common.comma_list(parser, "--shapes", args.shapes, tuple(SHAPES))
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as workdir:
        for name in shapes:
            rec = bench_shape(name, args.vllm_python, args.repeats, workdir)
            records.append(rec)
            print(
                f"{name:>4} {rec['num_params'] / 1e6:6.1f}M params: "
                + " ".join(f"{p}={rec[p] * 1e3:.1f}ms" for p in PARTS)
                + f" | export+reload={rec['export_plus_reload_s'] * 1e3:.1f}ms"
                f" | startup {rec['startup_s']:.0f}s, first request {rec['first_request_s']:.1f}s",
                flush=True,
            )
    common.save_json(args.json, records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
