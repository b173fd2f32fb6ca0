"""PPO pieces (jaxrlvr.algos.gae): GAE scan vs loop, token rewards, clipped value loss."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrlvr.algos import gae

# float32 scan vs float64 loop over <= 10 steps with |r|, |V| <= ~3: 1e-5 relative/absolute
RTOL, ATOL = 1e-5, 1e-5


def _loop_gae(r, v, m, gamma, lam):
    """Textbook GAE over the valid tokens of each row (cleanrl-style reverse loop)."""
    adv = np.zeros_like(r, dtype=np.float64)
    for b in range(r.shape[0]):
        idx = [t for t in range(r.shape[1]) if m[b, t]]
        last_adv, next_v = 0.0, 0.0
        for t in reversed(idx):
            delta = r[b, t] + gamma * next_v - v[b, t]
            last_adv = delta + gamma * lam * last_adv
            adv[b, t] = last_adv
            next_v = v[b, t]
    return adv, np.where(m, adv + v, 0.0)


# gamma and lam traced: one compilation for all examples (eager scan recompiles every call).
_gae_jit = jax.jit(gae.compute_gae)


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.floats(0.0, 1.0),
    st.floats(0.0, 1.0),
    st.booleans(),  # interior holes in the mask (masked tool-output tokens)
)
def test_scan_matches_loop(seed, gamma, lam, holes):
    rng = np.random.default_rng(seed)
    b, t = 3, 10
    r = rng.normal(size=(b, t)).astype(np.float32)
    v = rng.normal(size=(b, t)).astype(np.float32)
    lengths = rng.integers(0, t + 1, size=b)
    m = np.arange(t)[None, :] < lengths[:, None]
    if holes:
        m &= rng.random((b, t)) > 0.3
    adv, ret = _gae_jit(r, v, m, gamma, lam)
    want_adv, want_ret = _loop_gae(r, v, m, gamma, lam)
    np.testing.assert_allclose(adv, want_adv, RTOL, ATOL)
    np.testing.assert_allclose(ret, want_ret, RTOL, ATOL)


def test_gamma_lam_one_gives_return_minus_value():
    # Sparse terminal reward, gamma = lam = 1: A_t = R - V_t for every valid token.
    v = np.array([[0.1, 0.2, 0.3, 9.0]], np.float32)
    m = np.array([[1, 1, 1, 0]], bool)
    r = np.array([[0.0, 0.0, 1.0, 5.0]], np.float32)  # the padded reward must be ignored
    adv, ret = gae.compute_gae(r, v, m, 1.0, 1.0)
    np.testing.assert_allclose(adv, [[0.9, 0.8, 0.7, 0.0]], atol=1e-6)
    np.testing.assert_allclose(ret, [[1.0, 1.0, 1.0, 0.0]], atol=1e-6)


def test_ppo_token_rewards_match_loop():
    rng = np.random.default_rng(1)
    kl = rng.uniform(0, 1, size=(4, 6)).astype(np.float32)
    m = np.array(
        [[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0], [1, 0, 1, 1, 0, 0]], bool
    )
    task = np.array([1.0, 0.0, 1.0, 0.5], np.float32)
    got = np.asarray(gae.ppo_token_rewards(task, kl, m, 0.1))
    want = np.zeros((4, 6))
    for b in range(4):
        idx = [t for t in range(6) if m[b, t]]
        for t in idx:
            want[b, t] = -0.1 * kl[b, t]
        if idx:
            want[b, idx[-1]] += task[b]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)


def test_value_loss_matches_numpy_and_zero_grad_when_clipped():
    v = np.array([[0.0, 1.0, 2.0, 0.5]], np.float32)
    old = np.array([[0.0, 0.0, 0.0, 0.0]], np.float32)
    ret = np.array([[1.0, -1.0, 0.0, 3.0]], np.float32)
    m = np.array([[1, 1, 1, 0]], np.float32)
    clip = 0.2
    loss, metrics = gae.value_loss(v, old, ret, m, clip, denominator=3.0)
    vc = old + np.clip(v - old, -clip, clip)
    per = 0.5 * np.maximum((v - ret) ** 2, (vc - ret) ** 2)
    assert float(loss) == pytest.approx((per * m).sum() / 3.0, rel=1e-6)
    grad = np.asarray(
        jax.grad(lambda x: gae.value_loss(x, old, ret, m, clip, denominator=3.0)[0])(v)
    )
    # token 0: unclipped error (0-1)^2=1 vs clipped (0-1)^2=1 -> tie, plain branch: grad -1/3.
    # token 1: v=1 moved away from R=-1; clipped error (0.2+1)^2 < (1+1)^2 -> unclipped wins.
    # token 2: v=2, R=0: clipped (0.2)^2 < 4 -> unclipped wins.
    np.testing.assert_allclose(grad[0, :3], (v - ret)[0, :3] / 3.0, rtol=1e-6)
    assert grad[0, 3] == 0.0
    # A clipped case: v overshoots R from old; clipped error larger -> constant -> zero grad.
    v2 = np.array([[1.0]], np.float32)
    g2 = jax.grad(
        lambda x: gae.value_loss(
            x, np.zeros((1, 1)), np.full((1, 1), 0.9), np.ones((1, 1)), 0.2, denominator=1.0
        )[0]  # fmt: skip
    )(v2)
    assert float(g2[0, 0]) == 0.0
    assert float(metrics["vf_clip_frac_sum"]) == 0.0
    unclipped, _ = gae.value_loss(v, old, ret, m, None, denominator=3.0)
    assert float(unclipped) == pytest.approx((0.5 * (v - ret) ** 2 * m).sum() / 3.0, rel=1e-6)


class GAEVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        rng = np.random.default_rng(2)
        r, v = rng.normal(size=(2, 3, 7)).astype(np.float32)
        m = rng.random((3, 7)) > 0.2
        kl = np.abs(r)

        def fn(r, v, m, kl):
            adv, ret = gae.compute_gae(r, v, m, 0.99, 0.95)
            loss, met = gae.value_loss(v + 0.1, v, ret, m, 0.2, denominator=jnp.sum(m))
            return adv, ret, loss, met, gae.ppo_token_rewards(r[:, 0], kl, m, 0.05)

        # scan and <= 21-term reductions in float32: a few ulps at most
        chex.assert_trees_all_close(
            self.variant(fn)(r, v, m, kl), fn(r, v, m, kl), rtol=1e-6, atol=1e-7
        )
