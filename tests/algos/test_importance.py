"""Truncated importance sampling weights (jaxrlvr.algos.importance)."""

import chex
import jax
import numpy as np
import pytest

from jaxrlvr.algos import importance


def _data(seed=0):
    rng = np.random.default_rng(seed)
    old = -rng.uniform(0.1, 3, size=(3, 4)).astype(np.float32)
    sampler = (old + rng.normal(scale=0.5, size=(3, 4))).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]], np.float32)
    return old, sampler, mask


def test_token_and_sequence_weights_match_numpy():
    old, sampler, mask = _data()
    diff = (old - sampler).astype(np.float64)
    w, trunc = importance.tis_weights(old, sampler, mask, "token", 1.3)
    # masked positions get exp(0) = 1 (they are excluded from the loss by the mask anyway)
    want = np.where(mask > 0, np.minimum(np.exp(diff), 1.3), 1.0)
    np.testing.assert_allclose(w, want, rtol=1e-6)  # one exp in float32
    np.testing.assert_array_equal(trunc, (mask > 0) & (np.exp(diff) > 1.3))
    w, trunc = importance.tis_weights(old, sampler, mask, "sequence", 1.3)
    seq = np.exp((diff * mask).sum(-1, keepdims=True))
    np.testing.assert_allclose(w, np.broadcast_to(np.minimum(seq, 1.3), w.shape), rtol=1e-5)
    np.testing.assert_array_equal(trunc, np.broadcast_to(seq > 1.3, w.shape))
    w, trunc = importance.tis_weights(old, sampler, mask, "none", 1.3)
    assert np.all(np.asarray(w) == 1.0) and np.all(np.asarray(trunc) == 0.0)
    with pytest.raises(ValueError, match="level must be one of"):
        importance.tis_weights(old, sampler, mask, "batch", 1.3)


def test_weights_have_no_gradient_and_are_finite_for_large_gaps():
    old, sampler, mask = _data(1)
    g = jax.grad(lambda o: importance.tis_weights(o, sampler - 50, mask, "sequence", 2.0)[0].sum())
    assert np.all(np.asarray(g(old)) == 0.0)
    w, _ = importance.tis_weights(old, old + 50, mask, "sequence", 2.0)
    assert np.all(np.isfinite(np.asarray(w)))


def test_metrics():
    old, sampler, mask = _data(2)
    w, trunc = importance.tis_weights(old, sampler, mask, "token", 1.1)
    m = importance.tis_metrics(old, sampler, mask, w, trunc)
    valid = mask > 0
    diff = np.abs(old - sampler)[valid]
    assert float(m["logp_diff_abs_max"]) == pytest.approx(diff.max(), rel=1e-6)
    assert float(m["logp_diff_abs_sum"]) == pytest.approx(diff.sum(), rel=1e-5)
    assert float(m["tis_weight_sum"]) == pytest.approx(np.asarray(w)[valid].sum(), rel=1e-5)
    assert float(m["tis_truncated_sum"]) == np.asarray(trunc)[valid].sum()


class ImportanceVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        old, sampler, mask = _data(3)
        for level in ("token", "sequence"):

            def fn(o, s, m, level=level):
                w, t = importance.tis_weights(o, s, m, level, 1.5)
                return w, t, importance.tis_metrics(o, s, m, w, t)

            # <= 12-term float32 reductions; XLA may reorder under jit
            chex.assert_trees_all_close(
                self.variant(fn)(old, sampler, mask), fn(old, sampler, mask), rtol=1e-6, atol=1e-7
            )
