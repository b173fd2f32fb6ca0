"""Loss aggregation (jaxrlvr.algos.aggregation): reference values, naive-loss gradients and
exactness of microbatch accumulation for every mode."""

import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrlvr.algos import aggregation, loss_config, losses

MODES = typing.get_args(loss_config.Aggregation)
C = 16.0  # Dr. GRPO constant used throughout


def _cfg(mode):
    return loss_config.PolicyLossConfig(
        aggregation=mode, norm_constant=C if mode == "seq_mean_token_sum_norm" else None
    )


def _batch(seed, b=8, t=6, empty_rows=(2,)):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    mask[list(empty_rows)] = 0.0  # all-masked rows must not produce NaN
    lp = -rng.uniform(0.1, 4.0, size=(b, t)).astype(np.float32)
    adv = rng.normal(size=(b,)).astype(np.float32)
    return lp, adv, mask


def _groups(shape):
    """Prompt-group ids [B, T]: three groups per row (tokens 0-1, 2-3, 4-), as shared-prompt
    blocks lie whole in one row."""
    b, t = shape
    return np.repeat(np.minimum(np.arange(t) // 2 + 1, 3)[None, :], b, 0).astype(np.int32)


def _reference(per_token, mask, mode):
    per_token, mask = per_token.astype(np.float64), mask.astype(np.float64)
    b = per_token.shape[0]
    sums = (per_token * mask).sum(-1)
    if mode == "prompt_mean_token_mean":  # a Python loop over (row, group)
        groups, means = _groups(mask.shape), []
        for i in range(b):
            for g in np.unique(groups[i]):
                sel = groups[i] == g
                if mask[i, sel].sum() > 0:
                    means.append((per_token[i, sel] * mask[i, sel]).sum() / mask[i, sel].sum())
        return np.mean(means)
    if mode == "token_mean":
        return sums.sum() / mask.sum()
    if mode == "seq_mean_token_mean":
        return np.mean(sums / np.maximum(mask.sum(-1), 1))
    if mode == "seq_mean_token_sum":
        return sums.sum() / b
    return sums.sum() / (b * C)


@pytest.mark.parametrize("mode", MODES)
def test_matches_reference_and_masked_entries_are_ignored(mode):
    lp, adv, mask = _batch(0)
    per_token = -adv[:, None] * lp
    per_token_poisoned = np.where(mask > 0, per_token, np.nan).astype(np.float32)
    den = aggregation.loss_denominator(mask, _cfg(mode), group_ids_bt=_groups(mask.shape))
    got = aggregation.aggregate(
        jnp.asarray(per_token_poisoned), mask, _cfg(mode), den, group_ids_bt=_groups(mask.shape)
    )
    # float32 sums of 48 O(10) terms vs float64
    assert float(got) == pytest.approx(_reference(per_token, mask, mode), rel=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_naive_loss_gradient_is_minus_adv_mask_over_normalizer(mode):
    lp, adv, mask = _batch(1)
    cfg = _cfg(mode)
    groups = _groups(mask.shape)
    den = aggregation.loss_denominator(mask, cfg, group_ids_bt=groups)

    def loss(x):
        per_token = losses.compute_naive_policy_gradient_loss(adv[:, None], x)
        return aggregation.aggregate(per_token, mask, cfg, den, group_ids_bt=groups)

    grad = np.asarray(jax.grad(loss)(jnp.asarray(lp)))
    b = lp.shape[0]
    normalizer = {
        "token_mean": np.full((b, 1), mask.sum()),
        "seq_mean_token_mean": b * np.maximum(mask.sum(-1, keepdims=True), 1),
        "seq_mean_token_sum": np.full((b, 1), b),
        "seq_mean_token_sum_norm": np.full((b, 1), b * C),
        "prompt_mean_token_mean": _prompt_normalizer(mask),
    }[mode]
    # one multiply and one divide per entry: within 2 ulps
    np.testing.assert_allclose(grad, -adv[:, None] * mask / normalizer, rtol=1e-6)


def _prompt_normalizer(mask):
    """P x (each token's group token count), [B, T] (1 where the group has no loss token)."""
    groups = _groups(mask.shape)
    counts = np.zeros_like(mask)
    for i in range(mask.shape[0]):
        for g in np.unique(groups[i]):
            sel = groups[i] == g
            counts[i, sel] = mask[i, sel].sum()
    num_groups = sum(
        mask[i, groups[i] == g].sum() > 0
        for i in range(mask.shape[0])
        for g in np.unique(groups[i])
    )
    return num_groups * np.maximum(counts, 1)


def _microbatched_grad(fn, lp, adv, mask, cfg, n_micro):
    # full batch, before the loop
    den = aggregation.loss_denominator(jnp.asarray(mask), cfg, group_ids_bt=_groups(mask.shape))
    grads, total = [], 0.0
    for lp_m, adv_m, mask_m in zip(
        np.split(lp, n_micro), np.split(adv, n_micro), np.split(mask, n_micro), strict=True
    ):
        value, g = jax.value_and_grad(fn)(jnp.asarray(lp_m), adv_m, mask_m, cfg, den)
        grads.append(g)
        total += value
    return total, np.concatenate(grads)


def _naive(lp, adv, mask, cfg, den):
    per_token = losses.compute_naive_policy_gradient_loss(adv[:, None], lp)
    return aggregation.aggregate(per_token, mask, cfg, den, group_ids_bt=_groups(mask.shape))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1), st.sampled_from(MODES))
def test_one_vs_four_microbatches_same_gradient(seed, mode):
    lp, adv, mask = _batch(seed, empty_rows=(seed % 8,))
    cfg = _cfg(mode)
    loss1, g1 = _microbatched_grad(_naive, lp, adv, mask, cfg, 1)
    loss4, g4 = _microbatched_grad(_naive, lp, adv, mask, cfg, 4)
    assert np.all(np.isfinite(g1)) and np.isfinite(loss1)
    np.testing.assert_allclose(g4, g1, rtol=0, atol=1e-6)  # the bound
    assert float(loss4) == pytest.approx(float(loss1), rel=1e-5, abs=1e-6)


def test_per_microbatch_token_mean_would_differ():
    # Power check for the test above: dividing each microbatch by its own token count (the bug
    # the global denominator prevents) changes the gradient by far more than 1e-6.
    lp, adv, mask = _batch(3)
    cfg = _cfg("token_mean")
    _, g_global = _microbatched_grad(_naive, lp, adv, mask, cfg, 4)

    def local(lp_, adv_, mask_, cfg_, den):
        den_ = aggregation.loss_denominator(mask_, cfg_, group_ids_bt=_groups(mask_.shape))
        return _naive(lp_, adv_, mask_, cfg_, den_) / 4

    _, g_local = _microbatched_grad(local, lp, adv, mask, cfg, 4)
    assert np.max(np.abs(g_local - g_global)) > 1e-3


def test_all_masked_batch_is_finite():
    lp, adv, _ = _batch(4)
    mask = np.zeros_like(lp)
    for mode in MODES:
        cfg = _cfg(mode)
        den = aggregation.loss_denominator(mask, cfg, group_ids_bt=_groups(mask.shape))
        val, g = jax.value_and_grad(_naive)(jnp.asarray(lp), adv, mask, cfg, den)
        assert float(val) == 0.0 and np.all(np.asarray(g) == 0.0)


def test_denominators():
    _, _, mask = _batch(5)
    assert float(aggregation.loss_denominator(mask, _cfg("token_mean"))) == mask.sum()
    assert float(aggregation.loss_denominator(mask, _cfg("seq_mean_token_mean"))) == 8
    assert float(aggregation.loss_denominator(mask, _cfg("seq_mean_token_sum"))) == 8
    assert float(aggregation.loss_denominator(mask, _cfg("seq_mean_token_sum_norm"))) == 8 * C
    # Prompt groups with any loss token: every row has its first token, rows with > 2 and > 4
    # tokens their second and third groups; the all-masked row 2 has none.
    groups = _groups(mask.shape)
    lengths = mask.sum(-1)
    expected = (lengths > 0).sum() + (lengths > 2).sum() + (lengths > 4).sum()
    den = aggregation.loss_denominator(mask, _cfg("prompt_mean_token_mean"), group_ids_bt=groups)
    assert float(den) == expected


def test_prompt_mean_drops_masked_groups_and_needs_group_ids():
    # A prompt whose group is masked out whole (zero-variance filtering) leaves the mean and its
    # count: the loss is the mean over the remaining prompts.
    per_token = np.asarray([[1.0, 3.0, 10.0, 10.0], [5.0, 7.0, 9.0, 0.0]], np.float32)
    mask = np.asarray([[1, 1, 0, 0], [1, 1, 1, 0]], np.float32)
    groups = np.asarray([[1, 1, 2, 2], [1, 2, 2, 0]], np.int32)
    cfg = _cfg("prompt_mean_token_mean")
    den = aggregation.loss_denominator(mask, cfg, group_ids_bt=groups)
    got = aggregation.aggregate(jnp.asarray(per_token), mask, cfg, den, group_ids_bt=groups)
    assert float(den) == 3.0
    assert float(got) == pytest.approx((2.0 + 5.0 + 8.0) / 3)
    with pytest.raises(ValueError, match="prompt_group_ids"):
        aggregation.loss_denominator(mask, cfg)


class AggregationVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        lp, adv, mask = _batch(6)
        for mode in MODES:
            cfg = _cfg(mode)

            def fn(x, m, cfg=cfg):
                g = _groups(m.shape)
                den = aggregation.loss_denominator(m, cfg, group_ids_bt=g)
                return aggregation.aggregate(x, m, cfg, den, group_ids_bt=g)

            # reductions of 48 float32 terms; XLA may reorder the sum under jit
            chex.assert_trees_all_close(
                self.variant(fn)(lp, mask), fn(lp, mask), rtol=1e-6, atol=1e-7
            )
