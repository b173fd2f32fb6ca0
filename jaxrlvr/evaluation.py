"""Held-out evaluation: sample the first ``eval.max_problems`` problems, grade, reduce.

``evaluate`` is what the training loop's evaluation hook runs (on the live sampler);
``evaluate_only`` (``jaxrlvr eval``) does the same for a run's newest checkpoint or for the
config's initial model, building only what evaluation needs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxrlvr import builders, compile_cache, distributed, export, placement, preflight
from jaxrlvr import config as config_lib
from jaxrlvr import metrics as metrics_lib
from jaxrlvr import model as model_lib
from jaxrlvr.envs import rollout as envs_rollout


def evaluate(
    cfg, sampler, tokenizer, problems, pool, reward_fn, *, block=(0, 1)
) -> dict[str, float]:
    """Held-out metrics of the first ``eval.max_problems`` problems. In a multi-process job
    (``block``: this process's row block of ``step.process_row_block``) each process samples and
    grades its contiguous share and the metrics are reduced over the processes."""
    problems = problems[: cfg.eval.max_problems]
    if not problems:
        return {}
    first = 0
    if block[1] > 1:
        first = len(problems) * block[0] // block[1]
        problems = problems[first : len(problems) * (block[0] + 1) // block[1]]
    n = cfg.eval.samples_per_problem
    texts = [builders.render(cfg, p, tokenizer) for p in problems]
    prompts = builders.encode_many(tokenizer, texts)
    # vLLM seeds prompt i with seed + i: offset by the share's first prompt (the JAX sampler
    # runs one program over all processes' rows, with one seed).
    offset = first if cfg.sampler.kind != "jax" else 0
    params = builders.sampling_params(
        cfg, tokenizer, eval_mode=True, seed=cfg.run.seed + 7919 + offset
    )
    completions = sampler.generate(prompts, n, params)
    truths = [p.answer for p in problems for _ in range(n)]
    scores, _ = pool.grade(reward_fn, [c.text for c in completions], truths)
    lengths = [len(c.token_ids) for c in completions]
    if block[1] > 1:  # every share's per-completion values, one share per block, in order
        keys = ("answer_reward", "format_reward", "reward")
        mine = [block[0], [[s[k] for k in keys] for s in scores], lengths]
        parts = {b: (rows, lens) for b, rows, lens in distributed.allgather_json(mine)}
        scores = [dict(zip(keys, row)) for b in sorted(parts) for row in parts[b][0]]
        lengths = [x for b in sorted(parts) for x in parts[b][1]]
    return {
        "eval/accuracy": float(np.mean([s["answer_reward"] for s in scores])),
        "eval/format_rate": float(np.mean([s["format_reward"] for s in scores])),
        "eval/reward_mean": float(np.mean([s["reward"] for s in scores])),
        "eval/response_length_mean": float(np.mean(lengths)),
        **metrics_lib.length_by_outcome(
            lengths, [s["answer_reward"] for s in scores], prefix="eval/"
        ),
        "eval/n": len(scores) // n,
        "eval/samples_per_problem": n,
        # Tool-use rollouts (``env.tools``): turns, tool calls and errors, how rollouts ended.
        # One process's share in a multi-process job: left out there.
        **(
            envs_rollout.trajectory_metrics(completions, prefix="eval/tool/")
            if block[1] == 1
            else {}
        ),
    }


def evaluate_only(cfg: config_lib.TrainConfig, run_dir: str | None = None) -> dict[str, float]:
    """Held-out evaluation of a run's newest checkpoint (``run_dir``), or of the config's
    initial model when ``run_dir`` is None."""
    if run_dir is not None:
        cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=run_dir))
    compile_cache.enable(cfg.run.compile_cache)  # before anything is compiled
    cfg = preflight.check(cfg, mode="eval", checkpoint=run_dir)
    placement.check_jax_devices(placement.place_trainer(cfg.sampler))  # vLLM's GPUs stay free
    mesh = model_lib.make_mesh(cfg.mesh)
    tokenizer = builders.build_tokenizer(cfg)
    model = export.load_policy(cfg, run_dir, mesh, tokenizer, purpose="evaluating")
    _, problems = builders.load_splits(cfg, train=False)
    positions = model.config.max_position_embeddings
    held_out = problems[: cfg.eval.max_problems]
    builders.check_lengths(cfg, tokenizer, positions, {"data.eval": held_out})
    reward_fn, pool = builders.build_grader(cfg)
    sampler = None
    try:
        sampler = builders.build_sampler(cfg, model, tokenizer, mesh, cfg.run.out_dir)
        return evaluate(cfg, sampler, tokenizer, problems, pool, reward_fn)
    finally:
        if sampler is not None:
            sampler.close()
        pool.close()
