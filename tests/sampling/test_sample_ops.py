"""Sampling ops: drawn frequencies against NumPy-computed target distributions (chi-square),
returned logprobs in both modes, greedy, and that filtered tokens are never drawn."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxrlvr.sampling import sample_ops

LOGITS = np.array([2.0, 1.5, 1.2, 0.3, 0.0, -0.4, -1.0, -2.5], np.float32)
NUM_DRAWS = 40_000
# With a fixed seed the draws are deterministic; a correct sampler gives an unremarkable p-value,
# a wrong distribution (see test_chi_square_has_power) gives one below 1e-30.
P_MIN = 1e-3


def numpy_target(logits, temperature, top_k=0, top_p=1.0):
    """The distribution vLLM samples from, written independently in NumPy."""
    z = np.asarray(logits, np.float64) / temperature
    keep = np.ones_like(z, bool)
    if top_k:
        kth = np.sort(z)[::-1][top_k - 1]
        keep &= z >= kth
    probs = np.where(keep, np.exp(z - z.max()), 0.0)
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        before = np.cumsum(probs[order]) - probs[order]
        kept = np.zeros_like(keep)
        kept[order[before < top_p]] = True
        probs = np.where(kept, probs, 0.0)
        probs /= probs.sum()
    return probs


def draw(temperature, top_k=0, top_p=1.0, mode="processed", seed=0):
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (NUM_DRAWS, LOGITS.size))
    fn = jax.jit(
        lambda lg, key: sample_ops.sample(
            lg,
            key,
            greedy=False,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            use_top_p=top_p < 1.0,
            logprobs_mode=mode,
        )
    )
    tokens, logp = fn(logits, jax.random.PRNGKey(seed))
    return np.asarray(tokens), np.asarray(logp)


def chi_square_p(tokens, target):
    counts = np.bincount(tokens, minlength=target.size)
    support = target > 0
    assert counts[~support].sum() == 0, "drew a token outside the filtered support"
    expected = target[support] * len(tokens)
    return stats.chisquare(counts[support], expected).pvalue


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.3, 3, 1.0), (1.0, 0, 0.7), (0.8, 5, 0.8)],
)
def test_frequencies_match_target(temperature, top_k, top_p):
    tokens, _ = draw(temperature, top_k, top_p)
    target = numpy_target(LOGITS, temperature, top_k, top_p)
    assert chi_square_p(tokens, target) > P_MIN


def test_chi_square_has_power():
    # The same test rejects the unfiltered distribution when top-p is on: it can tell them apart.
    tokens, _ = draw(1.0, 0, 0.7)
    wrong = numpy_target(LOGITS, 1.0)
    counts = np.bincount(tokens, minlength=LOGITS.size)
    assert stats.chisquare(counts, wrong * len(tokens)).pvalue < 1e-30


def test_logprobs_modes():
    temperature, top_k, top_p = 0.8, 5, 0.8
    tokens, processed = draw(temperature, top_k, top_p, mode="processed")
    tokens2, tempered = draw(temperature, top_k, top_p, mode="temperature")
    np.testing.assert_array_equal(tokens, tokens2)  # the mode changes only the reported number
    target = numpy_target(LOGITS, temperature, top_k, top_p)
    scaled = LOGITS.astype(np.float64) / temperature
    log_softmax = scaled - np.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()
    # float32 log-softmax over 8 entries: errors ~1e-7; 1e-5 leaves room without hiding a bug
    # (the two modes differ by log(kept mass) ~ 0.2 here).
    np.testing.assert_allclose(processed, np.log(target[tokens]), atol=1e-5)
    np.testing.assert_allclose(tempered, log_softmax[tokens], atol=1e-5)
    assert np.abs(processed - tempered).max() > 0.1


def test_greedy_and_top_k_one():
    logits = jax.random.normal(jax.random.PRNGKey(3), (16, 50)) * 3
    tokens, logp = sample_ops.sample(logits, jax.random.PRNGKey(0), greedy=True)
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    expected = jax.nn.log_softmax(logits)[jnp.arange(16), tokens]
    np.testing.assert_allclose(logp, expected, atol=1e-6)
    # top-k = 1 leaves one token of probability 1: argmax, logprob 0 under "processed".
    tokens, logp = sample_ops.sample(
        logits, jax.random.PRNGKey(0), greedy=False, temperature=0.9, top_k=1
    )
    np.testing.assert_array_equal(tokens, np.argmax(logits, -1))
    np.testing.assert_allclose(logp, 0.0, atol=1e-6)


def test_deterministic_for_a_key():
    a, _ = draw(1.0, seed=5)
    b, _ = draw(1.0, seed=5)
    c, _ = draw(1.0, seed=6)
    np.testing.assert_array_equal(a, b)
    assert (a != c).mean() > 0.3


def test_bad_logprobs_mode():
    with pytest.raises(ValueError, match="logprobs_mode='raw'.*processed"):
        sample_ops.check_logprobs_mode("raw")
