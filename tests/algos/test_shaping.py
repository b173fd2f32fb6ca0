"""Reward shaping (jaxrlvr.algos.shaping): Kimi length reward, DAPO overlong, truncation mask."""

import chex
import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrlvr.algos import loss_config, shaping


def _kimi_loop(lengths, correct, g):
    out = []
    for k in range(0, len(lengths), g):
        grp = lengths[k : k + g]
        lo, hi = min(grp), max(grp)
        for i in range(g):
            lam = 0.0 if hi == lo else 0.5 - (grp[i] - lo) / (hi - lo)
            out.append(lam if correct[k + i] else min(0.0, lam))
    return np.asarray(out)


# jitted once per group size: eager dispatch would compile every op for every shape.
_kimi_jit = jax.jit(shaping.kimi_length_reward, static_argnums=2)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from([1, 2, 3, 4, 6, 12]))
def test_kimi_matches_loop(seed, g):
    # N fixed at 12 so that eager op compilation is shared across examples.
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 6, size=12).astype(np.int32)
    correct = rng.random(12) > 0.5
    got = np.asarray(_kimi_jit(lengths, correct, g))
    # (len - min)/(max - min) with small integers in float32: exact to ~1 ulp
    np.testing.assert_allclose(got, _kimi_loop(lengths.tolist(), correct, g), atol=1e-6)
    assert np.all(np.isfinite(got))


def test_kimi_hand_example_and_weight():
    lengths = np.array([10, 20, 30, 15, 15, 15], np.int32)
    correct = np.array([1, 1, 0, 1, 0, 1])
    np.testing.assert_allclose(
        shaping.kimi_length_reward(lengths, correct, 3), [0.5, 0.0, -0.5, 0, 0, 0]
    )
    wrong_short = shaping.kimi_length_reward(np.array([10, 30]), np.array([0, 1]), 2)
    np.testing.assert_allclose(wrong_short, [0.0, -0.5])  # incorrect never gains
    weighted = shaping.kimi_length_reward(
        lengths, correct, 3, loss_config.LengthRewardConfig(weight=0.2)
    )
    np.testing.assert_allclose(weighted, [0.1, 0.0, -0.1, 0, 0, 0], atol=1e-7)


def test_dapo_overlong_piecewise():
    lengths = np.array([0, 80, 81, 90, 100, 101, 500], np.int32)
    got = shaping.dapo_overlong_penalty(lengths, max_len=100, cache_len=20)
    np.testing.assert_allclose(got, [0, 0, -1 / 20, -0.5, -1.0, -1.0, -1.0], atol=1e-7)
    cfg = loss_config.OverlongConfig(max_len=100, cache_len=20, weight=0.5)
    np.testing.assert_allclose(shaping.overlong_reward(lengths, cfg), 0.5 * np.asarray(got))
    with pytest.raises(ValueError, match="cache_len"):
        shaping.dapo_overlong_penalty(lengths, max_len=10, cache_len=20)


def test_mask_truncated_completions():
    mask = np.array([[1, 1, 0], [1, 1, 1], [1, 0, 0]], np.float32)
    out = shaping.mask_truncated_completions(mask, np.array([False, True, False]))
    np.testing.assert_array_equal(out, [[1, 1, 0], [0, 0, 0], [1, 0, 0]])
    assert out.dtype == mask.dtype
    out_bool = shaping.mask_truncated_completions(mask.astype(bool), np.array([1, 0, 1]))
    np.testing.assert_array_equal(out_bool, [[0, 0, 0], [1, 1, 1], [0, 0, 0]])


class ShapingVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        lengths = np.array([3, 9, 5, 5, 7, 2], np.int32)
        correct = np.array([1, 0, 1, 1, 0, 1], bool)
        mask = np.ones((6, 4), bool)

        def fn(n, c, m):
            return (
                shaping.kimi_length_reward(n, c, 3),
                shaping.dapo_overlong_penalty(n, 8, 4),
                shaping.mask_truncated_completions(m, n > 6),
            )

        # XLA may turn the division into a reciprocal-multiply under jit: a couple of ulps
        chex.assert_trees_all_close(
            self.variant(fn)(lengths, correct, mask), fn(lengths, correct, mask), rtol=1e-6
        )
