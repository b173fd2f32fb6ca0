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

LoRA (``--lora-ranks 16,64``): for each shape, two servers (a plain one and one started with
LoRA, ``VLLMServer(lora_rank=max rank)``) and, interleaved in one loop (full, rank a, rank b,
full, ...), the full sync against the adapter sync of a LoRA model of each rank on every
projection (``VLLMSampler``'s LoRA route: PEFT export, ``/v1/load_lora_adapter``, unload of the
previous adapter). Each record adds ``first_generate_s``, the median of a 1-token generation
right after each sync (vLLM activates a new adapter on its first request), and ``bytes_written``.

Usage: ``jaxrlvr bench sync [--json PATH] [--vllm-python PATH] [--shapes ref,50m] [--repeats N]
[--lora-ranks 16,64]`` (or ``python benchmarks/bench_sync.py``); ``--vllm-python`` defaults to env
JAXRLVR_VLLM_PYTHON.
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


def _perturbed(params, seed: int, only=None):
    """``params`` + 1e-3 noise (every leaf, or only the leaves of the sub-state ``only``)."""
    import jax
    from flax import nnx

    target = params if only is None else only
    leaves, treedef = jax.tree.flatten(target)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noise = [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    new = jax.tree.unflatten(treedef, [x + 1e-3 * e for x, e in zip(leaves, noise)])
    if only is not None:
        new = nnx.merge_state(params, new)
    return jax.block_until_ready(new)  # time the sync, not the perturbation


def bench_lora(name: str, ranks: list[int], python: str, repeats: int, workdir: str) -> list:
    """Full sync vs adapter sync at each rank, interleaved (module docstring)."""
    from flax import nnx

    from jaxrlvr import model as jmodel
    from jaxrlvr.model import lora, weights
    from jaxrlvr.sampling import base, vllm_sampler, vllm_server

    cfg = SHAPES[name]()
    graphdef, params = nnx.split(jmodel.init_model(cfg, seed=0), nnx.Param)
    model_dir = os.path.join(workdir, name)
    jmodel.save_hf(nnx.merge(graphdef, params), model_dir, tokenizer_src=_tokenizer(model_dir))
    systems = {"full": (cfg, params)}
    for r in ranks:
        lcfg = cfg.replace(lora=lora.LoRAConfig(rank=r, alpha=2.0 * r))
        adapters = weights.init_adapters(lcfg, seed=r)
        systems[f"lora-r{r}"] = (lcfg, nnx.merge_state(params, adapters))
    servers, starts = {}, {}
    one = base.SamplingParams(max_tokens=1, seed=0)
    try:
        for kind, rank in (("plain", None), ("lora", max(ranks))):
            t0 = time.perf_counter()
            servers[kind] = vllm_server.VLLMServer(
                model_dir,
                python=python,
                max_model_len=256,
                log_path=os.path.join(workdir, f"{name}-{kind}.log"),
                lora_rank=rank,
            )
            starts[kind] = time.perf_counter() - t0
        samplers = {
            key: vllm_sampler.VLLMSampler(
                c, servers["plain" if key == "full" else "lora"], export_dir=None
            )
            for key, (c, _) in systems.items()
        }
        first = {}
        for key, s in samplers.items():
            t0 = time.perf_counter()
            s.generate([[1, 2, 3]], 1, one)
            first[key] = time.perf_counter() - t0
        runs = {key: [] for key in systems}
        for i in range(repeats):
            for key, (c, p) in systems.items():  # interleaved: full, r_a, r_b, full, ...
                new = _perturbed(p, 100 + i, None if c.lora is None else lora.adapters(p))
                timing = samplers[key].update_weights(new, version=i + 1)
                t0 = time.perf_counter()
                samplers[key].generate([[1, 2, 3]], 1, one)
                timing["first_generate_s"] = time.perf_counter() - t0
                runs[key].append(timing)
        for key, s in samplers.items():
            assert s.live_versions() == [str(repeats)], (key, s.live_versions())
            s.close()
    finally:
        for server in servers.values():
            server.stop()
    records = []
    for key, (c, p) in systems.items():
        rs = runs[key]
        parts = [k for k in rs[0] if k.endswith("_s")]
        rec = {
            "benchmark": "sync",
            "system": f"vllm-{key}",
            "shape": name,
            "num_params": c.num_params(),
            "lora_rank": None if c.lora is None else c.lora.rank,
            "adapter_params": lora.num_adapter_params(p),
            "repeats": repeats,
            "startup_s": starts["plain" if key == "full" else "lora"],
            "first_request_s": first[key],
            "bytes_written": rs[-1]["bytes_written"],
        }
        for part in parts:
            rec[part] = statistics.median(r[part] for r in rs)
        rec["all_total_s"] = [r["total_s"] for r in rs]
        rec["all_first_generate_s"] = [r["first_generate_s"] for r in rs]
        records.append(rec)
    return records


def main(argv=None) -> int:
    parser = common.parser("sync", __doc__)
    common.add_vllm_python(parser, " (required)")
    parser.add_argument("--shapes", default="ref,50m", help=f"comma list of {', '.join(SHAPES)}")
    common.add_repeats(parser, 5, "timed syncs per shape")
    parser.add_argument(
        "--lora-ranks",
        default="",
        help="comma list of LoRA ranks: compare adapter syncs with the full sync (interleaved)",
    )
    args = parser.parse_args(argv)
    if not args.vllm_python:
        parser.error(
            f"need --vllm-python or env {common.VLLM_PYTHON_ENV} (see scripts/setup_vllm.sh)"
        )
    shapes = common.comma_list(parser, "--shapes", args.shapes, tuple(SHAPES))
    try:
        ranks = [int(r) for r in args.lora_ranks.split(",") if r]
    except ValueError:
        parser.error(f"--lora-ranks: expected a comma list of integers, got {args.lora_ranks!r}")
    records = []
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as workdir:
        for name in shapes if ranks else ():
            recs = bench_lora(name, ranks, args.vllm_python, args.repeats, workdir)
            records.extend(recs)
            for rec in recs:
                print(
                    f"{name:>4} {rec['system']:>16} {rec['bytes_written'] / 2**20:8.1f} MiB: "
                    f"total={rec['total_s'] * 1e3:.1f}ms export={rec['export_s'] * 1e3:.1f}ms "
                    f"first_generate={rec['first_generate_s'] * 1e3:.1f}ms "
                    f"all_total={[round(x, 3) for x in rec['all_total_s']]}",
                    flush=True,
                )
        for name in shapes if not ranks else ():
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
