"""Group advantages (jaxrlvr.algos.advantages) against explicit Python loops."""

import chex
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrlvr.algos import advantages, loss_config

# float32 vs float64 loops over <= 8 rewards of size <= 10, divided by std + eps >= ~1e-6 only
# for all-equal groups (then the numerator is exactly 0): 1e-4 relative is generous and tight.
RTOL, ATOL = 1e-4, 1e-5

# 12 rewards in groups of 2, 3, 4, 6 or 12: few distinct shapes keep eager compilation cached.
rewards_strategy = st.sampled_from([2, 3, 4, 6, 12]).flatmap(
    lambda g: st.tuples(
        st.just(g),  # group size
        st.just(12 // g),  # groups
        st.integers(min_value=0, max_value=2**31 - 1),  # seed
        st.booleans(),  # binary (RLVR) or continuous rewards
    )
)


def _rewards(g, p, seed, binary):
    rng = np.random.default_rng(seed)
    if binary:
        return rng.integers(0, 2, size=g * p).astype(np.float32)
    return rng.normal(scale=3.0, size=g * p).astype(np.float32)


def _loop_reference(r, g, baseline, scale, eps):
    r = r.astype(np.float64)
    out = np.zeros_like(r)
    batch_std = np.std(r, ddof=1)
    for k in range(0, len(r), g):
        grp = r[k : k + g]
        for i in range(g):
            if baseline == "mean":
                a = grp[i] - sum(grp) / g
            elif baseline == "rloo":
                others = [grp[j] for j in range(g) if j != i]
                a = grp[i] - sum(others) / len(others)
            else:
                a = grp[i]
            if scale == "group_std":
                a /= np.std(grp, ddof=1) + eps
            elif scale == "batch_std":
                a /= batch_std + eps
            out[k + i] = a
    return out


@settings(max_examples=25, deadline=None)
@given(rewards_strategy, st.sampled_from(["mean", "rloo", "none"]))
def test_matches_loop_and_centres_groups(params, baseline):
    g, p, seed, binary = params
    r = _rewards(g, p, seed, binary)
    for scale in ("group_std", "batch_std", "none"):
        cfg = loss_config.AdvantageConfig(baseline=baseline, scale=scale)
        adv = np.asarray(advantages.group_advantages(r, g, cfg))
        assert np.all(np.isfinite(adv))
        np.testing.assert_allclose(adv, _loop_reference(r, g, baseline, scale, cfg.eps), RTOL, ATOL)
        if baseline != "none":
            # zero mean within every group (both the mean and the leave-one-out baseline);
            # |adv| can reach ~1/eps-scale only when the group is constant, where it is exactly 0.
            np.testing.assert_allclose(adv.reshape(p, g).mean(-1), 0.0, atol=1e-4)


def test_rloo_is_scaled_mean_baseline():
    r = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 1.0], np.float32)
    rloo = advantages.group_advantages(
        r, 3, loss_config.AdvantageConfig(baseline="rloo", scale="none")
    )
    mean = advantages.group_advantages(
        r, 3, loss_config.AdvantageConfig(baseline="mean", scale="none")
    )
    np.testing.assert_allclose(rloo, 1.5 * np.asarray(mean), rtol=1e-6)  # G/(G-1) = 3/2
    np.testing.assert_allclose(rloo, [1.0, -0.5, -0.5, 0, 0, 0], atol=1e-6)


def test_two_dim_input_matches_flat_and_keeps_shape():
    r = _rewards(4, 3, 1, False)
    cfg = loss_config.AdvantageConfig()
    flat = advantages.group_advantages(r, 4, cfg)
    grid = advantages.group_advantages(r.reshape(3, 4), 4, cfg)
    assert grid.shape == (3, 4)
    np.testing.assert_array_equal(grid.reshape(-1), flat)


def test_all_equal_groups_give_zero_not_nan():
    r = np.ones(8, np.float32)
    for baseline in ("mean", "rloo"):
        for scale in ("group_std", "batch_std"):
            cfg = loss_config.AdvantageConfig(baseline=baseline, scale=scale)
            np.testing.assert_array_equal(advantages.group_advantages(r, 4, cfg), 0.0)


def test_errors():
    cfg = loss_config.AdvantageConfig()
    with pytest.raises(ValueError, match="group_size"):
        advantages.group_advantages(np.zeros(6, np.float32), 4, cfg)
    with pytest.raises(ValueError, match="group_size >= 2"):
        advantages.group_advantages(np.zeros(6, np.float32), 1, cfg)
    with pytest.raises(AssertionError, match="argument `rewards`"):
        advantages.group_advantages(np.zeros((2, 3), np.float32), 4, cfg)


class AdvantageVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        r = _rewards(4, 4, 3, False)
        for baseline in ("mean", "rloo", "none"):
            for scale in ("group_std", "batch_std", "none"):
                cfg = loss_config.AdvantageConfig(baseline=baseline, scale=scale)
                fn = self.variant(lambda x, cfg=cfg: advantages.group_advantages(x, 4, cfg))
                # elementwise ops and length-4 reductions: a few ulps at most
                chex.assert_trees_all_close(
                    fn(r), advantages.group_advantages(r, 4, cfg), rtol=1e-6, atol=1e-7
                )
