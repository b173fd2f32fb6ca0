"""KL estimators (jaxrlvr.algos.kl): formulas, k3 >= 0, and exact expectations."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrlvr.algos import kl


def _pair(seed, scale=2.0, shape=(3, 5)):
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0, 5, size=shape).astype(np.float32)
    return lp, (lp + rng.normal(scale=scale, size=shape)).astype(np.float32)


def test_formulas_match_numpy():
    lp, ref = _pair(0)
    log_r = ref.astype(np.float64) - lp
    want = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}
    for name, value in want.items():
        # float32 exp of |log r| <= ~6: relative error ~1e-6
        np.testing.assert_allclose(kl.kl_estimate(lp, ref, name), value, rtol=1e-5, atol=1e-6)


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.floats(1e-8, 60.0))
def test_k3_nonnegative_and_zero_when_equal(seed, scale):
    lp, ref = _pair(seed, scale)
    k3 = np.asarray(kl.kl_estimate(lp, ref, "k3"))
    assert np.all(k3 >= 0) and np.all(np.isfinite(k3))
    np.testing.assert_array_equal(kl.kl_estimate(lp, lp, "k3"), 0.0)
    np.testing.assert_array_equal(kl.kl_estimate(lp, lp, "k2"), 0.0)


def test_k1_and_k3_are_unbiased_under_exact_expectation():
    # E_{x~pi}[k] over a categorical, computed exactly (no sampling), equals KL(pi || ref).
    rng = np.random.default_rng(1)
    logits_p, logits_q = rng.normal(size=(2, 16))
    lp = jax.nn.log_softmax(jnp.asarray(logits_p, jnp.float32))
    ref = jax.nn.log_softmax(jnp.asarray(logits_q, jnp.float32))
    true_kl = float(jnp.sum(jnp.exp(lp) * (lp - ref)))
    for name in ("k1", "k3"):
        est = float(jnp.sum(jnp.exp(lp) * kl.kl_estimate(lp, ref, name)))
        assert est == pytest.approx(true_kl, rel=1e-4)  # float32 sums of 16 terms
    # k2 is biased (it is the f-divergence with f = (log x)^2 / 2): not equal in general.
    est2 = float(jnp.sum(jnp.exp(lp) * kl.kl_estimate(lp, ref, "k2")))
    assert abs(est2 - true_kl) > 1e-3


def test_large_gaps_are_finite_and_clamped():
    lp = jnp.array([[-60.0, -1.0, -1.0]])
    ref = jnp.array([[-10.0, -51.0, -1.0]])  # log r = +50, -50, 0
    for name in ("k1", "k2", "k3"):
        out = kl.kl_estimate(lp, ref, name)
        assert np.all(np.isfinite(out))
        g = jax.grad(lambda x, name=name: kl.kl_estimate(x, ref, name).sum())(lp)
        assert np.all(np.isfinite(g))
    np.testing.assert_allclose(kl.kl_estimate(lp, ref, "k1"), [[-20.0, 20.0, 0.0]])
    k3 = kl.kl_estimate(lp, ref, "k3")
    np.testing.assert_allclose(k3[0, 0], np.expm1(20.0) - 20.0, rtol=1e-6)


def test_bad_estimator():
    lp, ref = _pair(2)
    with pytest.raises(ValueError, match="estimator must be one of"):
        kl.kl_estimate(lp, ref, "k4")


class KLVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        lp, ref = _pair(3)
        for name in ("k1", "k2", "k3"):
            fn = self.variant(lambda a, b, name=name: kl.kl_estimate(a, b, name))
            # elementwise only: at most an ulp from expm1/exp fusion
            chex.assert_trees_all_close(
                fn(lp, ref), kl.kl_estimate(lp, ref, name), rtol=1e-6, atol=0
            )


def test_k3_at_float32_level_mismatch_is_never_negative():
    # log r of a few float32 ulps: exp(d) - 1 - d cancels to a negative in float32 (the bug this
    # guards against); expm1(d) - d clamped at 0 never does.
    d = np.arange(-64, 65, dtype=np.float32) * np.float32(1e-6)
    dj = jnp.asarray(d)
    naive = np.asarray(jnp.exp(dj) - 1.0 - dj)
    assert np.any(naive < 0)  # the old formula really goes negative here in XLA's float32
    got = np.asarray(kl.k3(jnp.asarray(d)))
    assert np.all(got >= 0)
    # true k3 = d^2/2 + O(d^3) <= 1e-14 here: float32 resolves it to within its rounding
    np.testing.assert_allclose(got, 0.5 * d.astype(np.float64) ** 2, atol=1e-7)


@pytest.mark.parametrize("name", ["k1", "k2", "k3"])
def test_nan_reference_on_padding_gives_finite_value_and_gradient(name):
    lp, ref = _pair(3)
    mask = np.ones_like(lp)
    mask[:, -2:] = 0
    ref = ref.copy()
    ref[:, -2:] = np.nan  # reference log-probs never computed on padding

    def total(lp_):
        est = kl.kl_estimate(lp_, jnp.asarray(ref), name, mask_bt=jnp.asarray(mask))
        return jnp.sum(est * mask)

    value, grad = jax.value_and_grad(total)(jnp.asarray(lp))
    assert np.isfinite(float(value))
    g = np.asarray(grad)
    assert np.all(np.isfinite(g)) and np.all(g[:, -2:] == 0)
    # on the valid tokens: the unmasked estimator's value and gradient
    clean = np.where(mask > 0, ref, lp)
    v2, g2 = jax.value_and_grad(lambda x: jnp.sum(kl.kl_estimate(x, clean, name) * mask))(lp)
    np.testing.assert_allclose(float(value), float(v2), rtol=1e-6)
    np.testing.assert_allclose(g[:, :-2], np.asarray(g2)[:, :-2], rtol=1e-6)
    if name != "k1":  # k1 is linear in log r: its gradient never reads the NaN
        # without the mask argument the NaN reaches the gradient (what the argument is for)
        g3 = jax.grad(lambda x: jnp.sum(kl.kl_estimate(x, jnp.asarray(ref), name) * mask))(lp)
        assert not np.all(np.isfinite(np.asarray(g3)))
