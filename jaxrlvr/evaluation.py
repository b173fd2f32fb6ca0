"""Held-out evaluation: sample the first ``eval.max_problems`` problems, grade, reduce.

A task mixture (``data.mixture``: problems of several domains) is evaluated as each task alone
would be: the first ``eval.max_problems`` of each domain's held-out problems, with
``eval/<domain>/accuracy`` beside the pooled metrics.

``evaluate`` is what the training loop's evaluation hook runs (on the run's live sampler);
``evaluate_only`` (``jaxrlvr eval``) opens the run for a run's newest checkpoint or for the
config's initial model (``assembly.open_run``, mode "eval") and does the same.

With ``eval.pass_k`` / ``eval.maj_k`` the metrics also hold the unbiased ``eval/pass@k`` and the
majority vote ``eval/maj@k`` (``jaxrlvr.passk``; votes by ``rewards.votes.vote_key``), each with
``_se`` (standard error over problems) and per domain for a mixture. ``evaluate_detailed`` also
returns one row per problem; ``write_report`` is ``jaxrlvr eval --report``'s JSON
(docs/evaluation.md).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os

import numpy as np

from jaxrlvr import assembly, distributed, passk
from jaxrlvr import config as config_lib
from jaxrlvr import metrics as metrics_lib
from jaxrlvr.data import loading
from jaxrlvr.envs import multi_turn
from jaxrlvr.phases import base
from jaxrlvr.rewards import votes as votes_lib


def evaluate(
    ctx: base.RunContext,
    eval_cfg: config_lib.EvalSection,
    sampler_cfg: config_lib.SamplerSection,
    *,
    seed: int,
    reward_names: dict | None = None,
) -> dict[str, float]:
    """Held-out metrics of the first ``eval.max_problems`` problems of ``ctx.eval_problems`` on
    ``ctx.sampler`` (``seed``: ``run.seed``). In a multi-process job (``ctx.row_block``: this
    process's row block of ``step.process_row_block``) each process samples and grades its
    contiguous share and the metrics are reduced over the processes. ``reward_names``
    (``reward_names(cfg)``) tells ``eval.maj_k``'s votes how to read an answer."""
    return evaluate_detailed(ctx, eval_cfg, sampler_cfg, seed=seed, reward_names=reward_names)[0]


def reward_names(cfg: config_lib.TrainConfig) -> dict[str | None, str]:
    """Each domain's verifier name (``reward.fn``; a mixture's ``data.mixture[i].reward.fn``);
    the key None stands for every domain of a run without a mixture."""
    if cfg.data.mixture:
        return {m.domain: m.reward.fn for m in cfg.data.mixture}
    return {None: cfg.reward.fn}


def _generate(ctx, prompt_ids, n, params, *, chunk: int | None, progress: bool):
    """``ctx.sampler.generate`` over all prompts at once, or ``chunk`` prompts per call behind a
    tqdm bar; a chunk's seed is offset by its first prompt (vLLM seeds prompt i with seed + i, so
    it samples the same as in one call; the JAX sampler draws each chunk from its own seed)."""
    if chunk is None or chunk >= len(prompt_ids):
        chunk = len(prompt_ids)
    from tqdm import tqdm

    out = []
    bar = tqdm(total=len(prompt_ids), desc="eval", unit="problem", disable=not progress)
    with bar:
        for start in range(0, len(prompt_ids), chunk):
            part = prompt_ids[start : start + chunk]
            chunk_params = dataclasses.replace(params, seed=params.seed + start)
            out.extend(ctx.sampler.generate(part, n, chunk_params))
            bar.update(len(part))
    return out


def evaluate_detailed(
    ctx: base.RunContext,
    eval_cfg: config_lib.EvalSection,
    sampler_cfg: config_lib.SamplerSection,
    *,
    seed: int,
    reward_names: dict | None = None,
    chunk: int | None = None,
    progress: bool = False,
) -> tuple[dict[str, float], list[dict]]:
    """``evaluate``'s metrics and one row per problem (id, domain, answer, rewards, votes,
    pass@k / maj@k / avg@n). ``chunk``: prompts per sampler call (None: all in one) behind a
    progress bar when ``progress``."""
    block = ctx.row_block
    problems = loading.held_out_share(ctx.eval_problems, eval_cfg.max_problems)
    if not problems:
        return {}, []
    all_problems = problems
    domains = [p.domain for p in problems]
    first = 0
    if block[1] > 1:
        first = len(problems) * block[0] // block[1]
        problems = problems[first : len(problems) * (block[0] + 1) // block[1]]
    n = eval_cfg.samples_per_problem
    _, completions, scores, _ = ctx.sample_and_grade(
        problems,
        n,
        sampler_cfg,
        seed=seed + 7919,
        first=first,
        eval_mode=True,
        generate=lambda _problems, prompt_ids, n_, params: _generate(
            ctx, prompt_ids, n_, params, chunk=chunk, progress=progress and block[0] == 0
        ),
    )
    texts = [c.text for c in completions]
    lengths = [len(c.token_ids) for c in completions]
    names = reward_names or {}
    votes = [
        votes_lib.vote_key(_name_of(names, problems[i // n].domain), t, s) if names else None
        for i, (t, s) in enumerate(zip(texts, scores))
    ]
    if block[1] > 1:  # every share's per-completion values, one share per block, in order
        keys = ("answer_reward", "format_reward", "reward")
        mine = [block[0], [[s[k] for k in keys] for s in scores], lengths, votes]
        parts = {b: (rows, lens, v) for b, rows, lens, v in distributed.allgather_json(mine)}
        scores = [dict(zip(keys, row)) for b in sorted(parts) for row in parts[b][0]]
        lengths = [x for b in sorted(parts) for x in parts[b][1]]
        votes = [x for b in sorted(parts) for x in parts[b][2]]
    rows, sample_metrics = sample_metrics_of(
        all_problems, scores, votes, n, eval_cfg.pass_k, eval_cfg.maj_k if names else ()
    )
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
        **sample_metrics,
    }, rows


def _name_of(names: dict, domain) -> str:
    return names[domain] if domain in names else names[None]


def sample_metrics_of(
    problems: list, scores: list[dict], votes: list, n: int, ks, maj_ks
) -> tuple[list[dict], dict[str, float]]:
    """(one row per problem, ``eval/pass@k`` / ``eval/maj@k`` / ``eval/avg@n`` with ``_se`` and
    per domain) from ``n`` graded samples per problem, problem-major; a sample is correct when
    its ``answer_reward`` is 1 (every test passes, for code)."""
    correct = [[scores[p * n + i]["answer_reward"] for i in range(n)] for p in range(len(problems))]
    vote_rows = [votes[p * n : (p + 1) * n] for p in range(len(problems))]
    per_problem, agg = passk.summarize(
        correct, vote_rows, ks, maj_ks, domains=[p.domain for p in problems]
    )
    rows = [
        {
            "id": p.id,
            "domain": p.domain,
            "answer": p.answer,
            "correct": int(sum(x >= 1.0 for x in c)),
            "answer_rewards": c,
            "votes": v,
            **m,
        }
        for p, c, v, m in zip(problems, correct, vote_rows, per_problem)
    ]
    return rows, {f"eval/{k}": v for k, v in agg.items()}


def pass_curve(rows: list[dict], n: int) -> dict[str, list[float]]:
    """The pass@k curve for k = 1, 2, 4, ... up to ``n`` (and ``n``): ``{"k", "pass", "se"}``,
    the mean over problems and its standard error."""
    ks = sorted({2**i for i in range(int(math.log2(n)) + 1)} | {n})
    values = [[passk.pass_at_k(n, r["correct"], k) for r in rows] for k in ks]
    return {
        "k": ks,
        "pass": [float(np.mean(v)) for v in values],
        "se": [passk.standard_error(v) for v in values],
    }


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def write_report(path: str, metrics: dict, rows: list[dict], *, meta: dict) -> dict:
    """Writes ``jaxrlvr eval``'s JSON report (``meta``: what was evaluated and how; the
    aggregate ``metrics``; the pass@k ``curve``; one row per problem); non-finite numbers (a
    standard error over one problem) become null. Returns the report."""
    n = meta["samples_per_problem"]
    report = {
        **meta,
        "aggregate": metrics,
        "curve": pass_curve(rows, n) if rows else {},
        "problems": rows,
    }
    report = _json_safe(report)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return report


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
    return evaluate_only_detailed(cfg, run_dir)[0]


def evaluate_only_detailed(
    cfg: config_lib.TrainConfig,
    run_dir: str | None = None,
    *,
    chunk: int | None = None,
    progress: bool = False,
    problems: list[loading.Problem] | None = None,
) -> tuple[dict[str, float], list[dict]]:
    """``evaluate_only`` with ``evaluate_detailed``'s rows per problem (``jaxrlvr eval``);
    ``problems`` (a benchmark's, ``data.benchmarks``) replace the config's held-out problems."""
    with assembly.open_run(cfg, mode="eval", checkpoint=run_dir) as run:
        if problems is not None:
            run.ctx.eval_problems = problems
        return evaluate_detailed(
            run.ctx,
            run.cfg.eval,
            run.cfg.sampler,
            seed=run.cfg.run.seed,
            reward_names=reward_names(run.cfg),
            chunk=chunk,
            progress=progress,
        )
