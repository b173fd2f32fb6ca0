"""What the policy answers with its thinking cut off (docs/experiments/nocot_filter.md).

The no-CoT filter of ``jaxrlvr curate`` keeps only each problem's pass rate. This script samples
the same forced-answer completions (the curation YAML's policy, sampler, forced text, k and
seed, as ``jaxrlvr.curate.PolicyPassRates`` does) over the training pool and prints how often
each answer value is written, against how often it is the gold answer: whether the filter's
"solved without CoT" follows the arithmetic or the model's preferred answers.

    python docs/experiments/nocot_filter_answers.py runs/nocot/filter.yaml model.path=... \
        data.synthetic_eval_size=200
"""

from __future__ import annotations

import collections
import dataclasses
import re
import sys

from jaxrlvr import builders, curate, prompts
from jaxrlvr.data import filters

ANSWER = re.compile(r"^\s*(-?\d+)\s*</answer>")


def main(argv):
    path, overrides = argv[0], argv[1:]
    cfg, ccfg = curate.load(path, overrides)
    train, _ = builders.load_splits(cfg)
    policy = curate.PolicyPassRates(cfg, ccfg)
    ctx, c = policy.ctx, ccfg.no_cot
    forced = c.forced_text if c.forced_text is not None else filters.FORCED_TEXT[cfg.data.template]
    base = prompts.sampling_params(cfg.sampler, ctx.tokenizer)
    params = dataclasses.replace(base, max_tokens=c.max_tokens or base.max_tokens)
    written, right = collections.Counter(), collections.Counter()
    per_problem = collections.Counter()
    try:
        for start in range(0, len(train), ccfg.batch_size):
            chunk = train[start : start + ccfg.batch_size]
            ids = prompts.encode_many(ctx.tokenizer, [ctx.render(p) + forced for p in chunk])
            outs = ctx.sampler.generate(
                ids, c.k, dataclasses.replace(params, seed=c.seed * 1_000_003 + start)
            )
            for j, out in enumerate(outs):
                m = ANSWER.match(out.text)
                value = m.group(1) if m else "(none)"
                written[value] += 1
                right[value] += value == chunk[j // c.k].answer
                per_problem[start + j // c.k] += value == chunk[j // c.k].answer
    finally:
        policy.close()
    gold = collections.Counter(p.answer for p in train)
    n = sum(written.values())
    drops = sum(r / c.k >= c.threshold for r in per_problem.values())
    print(
        f"{n} forced-answer samples of {len(train)} problems (k={c.k}), "
        f"{sum(right.values()) / n:.3f} right; {drops} problems right in a share >= "
        f"{c.threshold} of their samples (the filter's drops)"
    )
    print("| answer | share of samples | share of gold answers | samples right |")
    print("|---|---|---|---|")
    keys = sorted(set(written) | set(gold), key=lambda v: (not v.lstrip("-").isdigit(), v.zfill(4)))
    for v in keys:
        w = written[v]
        print(
            f"| {v} | {w / n:.3f} | {gold[v] / len(train):.3f} | "
            f"{right[v] / w if w else float('nan'):.2f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
