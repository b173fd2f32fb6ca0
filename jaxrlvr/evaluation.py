"""Held-out evaluation: sample the first ``eval.max_problems`` problems, grade, reduce.

A task mixture (``data.mixture``: problems of several domains) is evaluated as each task alone
would be: the first ``eval.max_problems`` of each domain's held-out problems, with
``eval/<domain>/accuracy`` beside the pooled metrics.

``evaluate`` is what the training loop's evaluation hook runs (on the run's live sampler);
``evaluate_only`` (``jaxrlvr eval``) opens the run for a run's newest checkpoint or for the
config's initial model (``assembly.open_run``, mode "eval") and does the same.
"""

from __future__ import annotations

import numpy as np

from jaxrlvr import assembly, distributed
from jaxrlvr import config as config_lib
from jaxrlvr import metrics as metrics_lib
from jaxrlvr.data import loading
from jaxrlvr.envs import multi_turn
from jaxrlvr.phases import base


def evaluate(
    ctx: base.RunContext,
    eval_cfg: config_lib.EvalSection,
    sampler_cfg: config_lib.SamplerSection,
    *,
    seed: int,
) -> dict[str, float]:
    """Held-out metrics of the first ``eval.max_problems`` problems of ``ctx.eval_problems`` on
    ``ctx.sampler`` (``seed``: ``run.seed``). In a multi-process job (``ctx.row_block``: this
    process's row block of ``step.process_row_block``) each process samples and grades its
    contiguous share and the metrics are reduced over the processes."""
    block = ctx.row_block
    problems = loading.held_out_share(ctx.eval_problems, eval_cfg.max_problems)
    if not problems:
        return {}
    domains = [p.domain for p in problems]
    first = 0
    if block[1] > 1:
        first = len(problems) * block[0] // block[1]
        problems = problems[first : len(problems) * (block[0] + 1) // block[1]]
    n = eval_cfg.samples_per_problem
    _, completions, scores, _ = ctx.sample_and_grade(
        problems, n, sampler_cfg, seed=seed + 7919, first=first, eval_mode=True
    )
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
        **accuracy_by_domain(domains, scores, n),
        "eval/n": len(scores) // n,
        "eval/samples_per_problem": n,
        # Tool-use rollouts (``env.tools``): turns, tool calls and errors, how rollouts ended.
        # One process's share in a multi-process job: left out there.
        **(
            multi_turn.trajectory_metrics(completions, prefix="eval/tool/") if block[1] == 1 else {}
        ),
    }


def accuracy_by_domain(domains: list, scores: list[dict], n: int) -> dict[str, float]:
    """``eval/<domain>/accuracy`` and ``eval/<domain>/n`` per domain when there are several
    (``scores`` holds ``n`` completions per problem, problem by problem)."""
    if len(set(domains)) <= 1:
        return {}
    out = {}
    for d in dict.fromkeys(domains):
        rows = [s for i, s in enumerate(scores) if domains[i // n] == d]
        out[f"eval/{d}/accuracy"] = float(np.mean([s["answer_reward"] for s in rows]))
        out[f"eval/{d}/n"] = len(rows) // n
    return out


def evaluate_only(cfg: config_lib.TrainConfig, run_dir: str | None = None) -> dict[str, float]:
    """Held-out evaluation of a run's newest checkpoint (``run_dir``), or of the config's
    initial model when ``run_dir`` is None."""
    with assembly.open_run(cfg, mode="eval", checkpoint=run_dir) as run:
        return evaluate(run.ctx, run.cfg.eval, run.cfg.sampler, seed=run.cfg.run.seed)
