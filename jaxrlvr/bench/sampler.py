"""Rollout throughput: JaxSampler vs transformers `generate` vs a vLLM server, same weights.

``jaxrlvr bench sampler [--json PATH] [--vllm-python PATH]`` (or ``python -m
jaxrlvr.bench.sampler``) builds the issue's reference model (random Qwen2: vocab 8192, hidden 256,
intermediate 704, 4 layers, 4 heads, 2 KV heads, untied, float32, ~7M parameters), writes it once
with a word-level tokenizer that names every id, and runs each system in its own subprocess (so
that ``peak_rss_mib`` is that system's own) on two cases of 8192 new tokens each:

- ``64x1``: 64 prompts of 32 random ids, 128 new tokens each;
- ``16x4``: 16 prompts, n=4 samples each.

Sampling: temperature 1.0, top-p 1.0, no top-k, EOS ignored, logprobs of the sampled tokens
returned by every system. Records (one per system and case): ``system`` ("jaxrlvr", "hf",
"vllm"), ``case``, ``tokens_per_s`` (new tokens / median wall time of the timed repeats),
``compile_s`` (jaxrlvr: first call minus a steady call) or ``startup_s`` (hf: model load; vllm:
server start plus first request), ``peak_rss_mib``.

Not a test: numbers depend on the machine and its load; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence

from jaxrlvr.bench import common

CASES = {"64x1": (64, 1), "16x4": (16, 4)}
PROMPT_LEN = 32
NEW_TOKENS = 128
SYSTEMS = ("jaxrlvr", "hf", "vllm")


def write_model(path: str, seed: int = 0) -> None:
    """The reference model (transformers random init) and a tokenizer naming every id."""
    import tokenizers
    import torch
    import transformers

    cfg = common.sampler_ref()
    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**common.hf_kwargs(cfg), eos_token_id=0, bos_token_id=0)
    transformers.Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="t0", pad_token="t0"
    )
    fast.save_pretrained(path)


def prompts(num: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``PROMPT_LEN`` random ids in [1, vocab_size) (0 is EOS)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(1, vocab_size, (num, PROMPT_LEN)).tolist()


def run_jaxrlvr(model_dir: str, case: str, repeats: int) -> dict:
    from jaxrlvr import model as M
    from jaxrlvr.sampling import base, jax_sampler

    num, n = CASES[case]
    lm = M.load_hf(model_dir)
    sampler = jax_sampler.JaxSampler(lm, eos_token_ids=())
    params = base.SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, seed=0, logprobs=True
    )
    ps = prompts(num, lm.config.vocab_size)

    def go():
        out = sampler.generate(ps, n, params)
        assert sum(len(c.token_ids) for c in out) == num * n * NEW_TOKENS
        assert all(len(c.logprobs) == NEW_TOKENS for c in out)

    start = time.perf_counter()
    go()
    first = time.perf_counter() - start
    steady = common.median_seconds(go, repeats)
    return dict(
        tokens_per_s=num * n * NEW_TOKENS / steady,
        compile_s=max(first - steady, 0.0),
        seconds=steady,
        peak_rss_mib=common.peak_rss_mib(),
    )


def run_hf(model_dir: str, case: str, repeats: int) -> dict:
    import torch
    import transformers

    num, n = CASES[case]
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    startup = time.perf_counter() - start
    ids = torch.tensor(prompts(num, model.config.vocab_size))

    def go():
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,  # EOS ignored
                num_return_sequences=n,
                return_dict_in_generate=True,
                output_scores=True,
                pad_token_id=0,
            )
            logp = model.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
        assert logp.shape == (num * n, NEW_TOKENS)

    go()  # warm-up
    steady = common.median_seconds(go, repeats)
    return dict(
        tokens_per_s=num * n * NEW_TOKENS / steady,
        startup_s=startup,
        seconds=steady,
        peak_rss_mib=common.peak_rss_mib(),
    )


def run_vllm(model_dir: str, case: str, repeats: int, python: str) -> dict:
    import psutil

    from jaxrlvr import model as M
    from jaxrlvr.sampling import base, vllm_sampler, vllm_server

    num, n = CASES[case]
    start = time.perf_counter()
    server = vllm_server.VLLMServer(model_dir, python=python, max_model_len=512)
    try:
        cfg = M.ModelConfig.from_json(model_dir)
        sampler = vllm_sampler.VLLMSampler(cfg, server, model_dir)
        params = base.SamplingParams(
            temperature=1.0, top_p=1.0, max_tokens=NEW_TOKENS, ignore_eos=True, seed=0
        )
        ps = prompts(num, cfg.vocab_size)
        peak = [0.0]

        def go():
            out = sampler.generate(ps, n, params)
            assert sum(len(c.token_ids) for c in out) == num * n * NEW_TOKENS
            tree = psutil.Process(server.pid)
            rss = sum(p.memory_info().rss for p in [tree, *tree.children(recursive=True)])
            peak[0] = max(peak[0], rss / 2**20)

        go()  # the first request after start is slow (DESIGN.md): part of startup
        startup = time.perf_counter() - start
        steady = common.median_seconds(go, repeats)
        sampler.close()
    finally:
        server.stop()
    return dict(
        tokens_per_s=num * n * NEW_TOKENS / steady,
        startup_s=startup,
        seconds=steady,
        peak_rss_mib=peak[0],
    )


def _worker(args) -> int:
    if args.worker == "jaxrlvr":
        rec = run_jaxrlvr(args.model_dir, args.case, args.repeats)
    elif args.worker == "hf":
        rec = run_hf(args.model_dir, args.case, args.repeats)
    else:
        rec = run_vllm(args.model_dir, args.case, args.repeats, args.vllm_python)
    common.save_json(args._out, dict(system=args.worker, case=args.case, **rec))
    return 0


def _spawn(system: str, case: str, model_dir: str, args) -> dict:
    argv = ["--worker", system, "--case", case, "--model-dir", model_dir]
    argv += ["--repeats", str(args.repeats)]
    if args.vllm_python:
        argv += ["--vllm-python", args.vllm_python]
    try:
        return common.run_worker("jaxrlvr.bench.sampler", argv, capture_output=True)
    except common.WorkerError as e:
        return dict(system=system, case=case, error=str(e))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="jaxrlvr bench sampler", description=__doc__.split("\n")[0])
    ap.add_argument("--json", help="write the records to this file")
    ap.add_argument("--systems", default="jaxrlvr,hf", help="comma list of " + ",".join(SYSTEMS))
    ap.add_argument("--cases", default=",".join(CASES), help="comma list of " + ",".join(CASES))
    ap.add_argument("--vllm-python", help="python of a vLLM environment; adds system vllm")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ap.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    ap.add_argument("--case", choices=tuple(CASES), help=argparse.SUPPRESS)
    ap.add_argument("--_out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return _worker(args)

    systems = [s for s in args.systems.split(",") if s]
    if args.vllm_python and "vllm" not in systems:
        systems.append("vllm")
    for s in systems:
        if s not in SYSTEMS:
            raise SystemExit(f"--systems: {s!r} is not one of {SYSTEMS}")
    if "vllm" in systems and not args.vllm_python:
        raise SystemExit("--systems vllm needs --vllm-python PATH")
    cases = [c for c in args.cases.split(",") if c]
    for c in cases:
        if c not in CASES:
            raise SystemExit(f"--cases: {c!r} is not one of {tuple(CASES)}")

    records = []
    with tempfile.TemporaryDirectory(prefix="jaxrlvr-bench-sampler-") as model_dir:
        write_model(model_dir)
        for case in cases:
            for system in systems:
                rec = _spawn(system, case, model_dir, args)
                records.append(rec)
                print(json.dumps(rec), flush=True)
    common.save_json(args.json, records)
    _print_table(records)
    return 0


def _print_table(records: list[dict]) -> None:
    print(f"{'case':6} {'system':8} {'tokens/s':>9} {'compile/startup s':>18} {'peak RSS MiB':>13}")
    for r in records:
        if "error" in r:
            print(f"{r['case']:6} {r['system']:8} ERROR {r['error'][:200]}")
            continue
        setup = r.get("compile_s", r.get("startup_s", float("nan")))
        print(
            f"{r['case']:6} {r['system']:8} {r['tokens_per_s']:9.0f} {setup:18.1f} "
            f"{r['peak_rss_mib']:13.0f}"
        )


if __name__ == "__main__":
    sys.exit(main())
