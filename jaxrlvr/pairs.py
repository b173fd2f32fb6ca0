"""Preference pairs from verifiable rewards: ``jaxrlvr pairs``.

Samples ``k`` completions per training problem from a run's checkpoint (or the config's initial
model; the run opened as train and eval open theirs: ``assembly.open_run``), grades them with the
run's verifier in the grading pool, and writes, for every problem with at least one correct and one
incorrect completion, up to ``pairs_per_problem`` (correct, incorrect) pairs as jsonl rows
``{"prompt", "chosen", "rejected", "id"}``: the prompt is the rendered prompt text the policy sees,
the responses the completions' texts (the preference phase appends EOS to each, as SFT does). This
is the offline counterpart of GRPO on the same samples: ``rl.algo: dpo`` with ``pref.data`` set to
the file trains on it.

Not here: the preference losses (``algos.preference``) and the training phase (``train``).
"""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np

from jaxrlvr import assembly
from jaxrlvr import config as config_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class PairsConfig:
    """k: completions sampled per problem; pairs_per_problem: at most this many pairs per
    problem (distinct chosen and distinct rejected completions); max_problems: the first this
    many training problems (None: all); seed: the sampler's seed."""

    k: int = 8
    pairs_per_problem: int = 1
    max_problems: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.k < 2:
            raise ValueError(f"k={self.k}: a pair needs at least 2 completions per problem")
        if self.pairs_per_problem < 1:
            raise ValueError(f"pairs_per_problem={self.pairs_per_problem} must be >= 1")


def make_pairs(
    prompts: list[str],
    ids: list[str],
    texts: list[str],
    correct: np.ndarray,
    k: int,
    pairs_per_problem: int,
) -> list[dict[str, str]]:
    """Rows {"prompt", "chosen", "rejected", "id"} from ``k`` graded completions per prompt
    (``texts`` and ``correct`` [len(prompts) * k], grouped by prompt): the i-th correct with
    the i-th incorrect completion, for i < min(#correct, #incorrect, pairs_per_problem)."""
    correct = np.asarray(correct, bool).reshape(len(prompts), k)
    rows = []
    for j, (prompt, pid) in enumerate(zip(prompts, ids, strict=True)):
        group = texts[j * k : (j + 1) * k]
        good = [t for t, c in zip(group, correct[j]) if c]
        bad = [t for t, c in zip(group, correct[j]) if not c]
        for chosen, rejected in list(zip(good, bad))[:pairs_per_problem]:
            rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected, "id": pid})
    return rows


def build_pairs(
    cfg: config_lib.TrainConfig, out_path: str, pairs_cfg: PairsConfig, run_dir: str | None = None
) -> dict[str, float]:
    """Samples, grades and writes the pairs file; returns counts (problems, completions, pairs,
    accuracy of the samples, fraction of problems with a pair)."""
    k = pairs_cfg.k
    with assembly.open_run(cfg, mode="pairs", checkpoint=run_dir) as run:
        ctx = run.ctx
        problems = ctx.train_problems[: pairs_cfg.max_problems]
        texts = [ctx.render(p) for p in problems]
        _, completions, scores, _ = ctx.sample_and_grade(
            problems, k, run.cfg.sampler, seed=pairs_cfg.seed
        )
    correct = np.asarray([s["answer_reward"] >= 1.0 for s in scores])
    rows = make_pairs(
        texts,
        [str(p.id) for p in problems],
        [c.text for c in completions],
        correct,
        k,
        pairs_cfg.pairs_per_problem,
    )
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    with_pair = len({r["id"] for r in rows})
    return {
        "problems": len(problems),
        "completions": len(completions),
        "sample_accuracy": float(correct.mean()) if len(correct) else 0.0,
        "problems_with_pair": with_pair / max(len(problems), 1),
        "pairs": len(rows),
    }
