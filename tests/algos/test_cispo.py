"""CISPO (jaxrlvr.algos.cispo) against an independent NumPy formula: value and gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlvr import config as config_lib
from jaxrlvr.algos import aggregation, cispo, loss_config, policy_loss

PLC = loss_config.PolicyLossConfig


def _batch(seed=0, b=6, t=7):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    mask[2] = 0.0  # an all-masked row
    lp = -rng.uniform(0.1, 3.0, size=(b, t)).astype(np.float32)
    # log ratios over [-3, 3]: weights from 0.05 to 20, so both bounds bind somewhere.
    old = (lp - rng.uniform(-3.0, 3.0, size=(b, t))).astype(np.float32)
    lp[mask == 0] = -np.inf  # padding may hold anything: it must not leak
    adv = rng.normal(size=(b,)).astype(np.float32)
    return lp, old, adv, mask


def _numpy_cispo(lp, old, adv, mask, eps_low, eps_high, aggregation_mode):
    """The paper's formula written out in NumPy: value of -J and its gradient w.r.t. log pi."""
    b, t = lp.shape
    loss, grad = 0.0, np.zeros((b, t))
    lengths = mask.sum(1)
    rows = b  # GRPO's B (aggregation.loss_denominator): every row, an empty one too
    for i in range(b):
        for j in range(t):
            if not mask[i, j]:
                continue
            r = np.exp(float(lp[i, j]) - float(old[i, j]))
            w = min(max(r, 1.0 - eps_low), 1.0 + eps_high)
            if aggregation_mode == "token_mean":
                scale = 1.0 / mask.sum()
            else:  # seq_mean_token_mean
                scale = 1.0 / (lengths[i] * rows)
            loss += -w * adv[i] * lp[i, j] * scale
            grad[i, j] = -w * adv[i] * scale  # sg(w): the weight carries no gradient
    return loss, grad


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("eps_low,eps_high", [(1.0, 4.0), (0.2, 0.28)])
def test_value_and_gradient_match_the_formula(mode, eps_low, eps_high, jit):
    lp, old, adv, mask = _batch()
    loss_cfg = PLC(aggregation=mode)
    cfg = cispo.CISPOConfig(eps_low=eps_low, eps_high=eps_high)
    den = aggregation.loss_denominator(mask, loss_cfg)

    def f(lp):
        return cispo.cispo_loss(lp, old, adv, mask, loss_cfg, cfg, denominator=den)[0]

    f = jax.value_and_grad(f)
    want, want_grad = _numpy_cispo(lp, old, adv, mask, eps_low, eps_high, mode)
    got, got_grad = (jax.jit(f) if jit else f)(jnp.asarray(lp))
    # float32 sums of ~30 terms of size <= 20 * 3: 1e-5 relative is a few ulps of the total.
    np.testing.assert_allclose(float(got), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=1e-5, atol=1e-7)
    # Both bounds bind in this batch (so the clip is exercised, not only the identity).
    r = np.exp(lp - old)[mask != 0]
    assert (r > 1 + eps_high).any() and (eps_low >= 1 or (r < 1 - eps_low).any())


def test_every_token_keeps_its_gradient_where_ppo_clipping_drops_it():
    lp, old, adv, mask = _batch(seed=1)
    loss_cfg = PLC(aggregation="token_mean", clip_eps_low=0.2, clip_eps_high=0.2)
    den = aggregation.loss_denominator(mask, loss_cfg)
    g_cispo = jax.grad(
        lambda x: cispo.cispo_loss(x, old, adv, mask, loss_cfg, cispo.CISPOConfig(),
                                   denominator=den)[0]
    )(jnp.asarray(lp))  # fmt: skip
    g_ppo = jax.grad(
        lambda x: policy_loss.policy_loss(x, old, adv, mask, loss_cfg, denominator=den)[0]
    )(jnp.asarray(lp))
    valid = mask != 0
    assert np.all(np.asarray(g_cispo)[valid] != 0)  # adv is never exactly 0 here
    assert np.all(np.asarray(g_cispo)[~valid] == 0)
    dropped = valid & (np.asarray(g_ppo) == 0)
    assert dropped.sum() >= 5  # the PPO/GRPO min zeroes these; CISPO keeps them


def test_default_bounds_cap_the_weight_at_5_not_trls_02():
    # One token, log ratio log 3: the weight is 3 with the default cap 1 + 4 (TRL's pitfall,
    # epsilon_high=0.2 used as the cap itself, would make it 0.2), and 5 at log ratio log 9.
    mask = np.ones((1, 2), np.float32)
    old = np.zeros((1, 2), np.float32)
    lp = np.log(np.array([[3.0, 9.0]], np.float32))
    loss_cfg = PLC(aggregation="token_mean")
    _, m = cispo.cispo_loss(
        jnp.asarray(lp), old, np.ones(1, np.float32), mask, loss_cfg, cispo.CISPOConfig(),
        denominator=jnp.float32(2.0),
    )  # fmt: skip
    np.testing.assert_allclose(float(m["weight_sum"]), 3.0 + 5.0, rtol=1e-6)
    assert float(m["clip_high_frac_sum"]) == 1.0 and float(m["clip_low_frac_sum"]) == 0.0


def test_microbatches_add_up_to_the_full_batch():
    lp, old, adv, mask = _batch(seed=2)
    loss_cfg = PLC()  # seq_mean_token_mean
    cfg = cispo.CISPOConfig(eps_low=0.3, eps_high=1.0)
    den = aggregation.loss_denominator(mask, loss_cfg)
    full, m_full = cispo.cispo_loss(lp, old, adv, mask, loss_cfg, cfg, denominator=den)
    halves = [
        cispo.cispo_loss(lp[s], old[s], adv[s], mask[s], loss_cfg, cfg, denominator=den)
        for s in (slice(0, 3), slice(3, 6))
    ]
    np.testing.assert_allclose(float(halves[0][0] + halves[1][0]), float(full), rtol=1e-6)
    acc = policy_loss.accumulate_metrics(halves[0][1], halves[1][1])
    assert float(acc["token_count"]) == float(m_full["token_count"]) == mask.sum()


def test_config_choices_and_refusals():
    cfg = config_lib.load_config("configs/cispo_demo.yaml")
    assert cfg.rl.algo == "cispo" and cfg.rl.cispo == cispo.CISPOConfig(eps_low=1.0, eps_high=4.0)
    with pytest.raises(ValueError, match=r"^rl.cispo: cispo.eps_high=-1.0: expected a number"):
        config_lib.load_config("configs/cispo_demo.yaml", ["rl.cispo.eps_high=-1"])
    with pytest.raises(ValueError, match=r"^rl: rl.loss.kl_coef=0.1 does not apply to CISPO"):
        config_lib.load_config("configs/cispo_demo.yaml", ["rl.loss.kl_coef=0.1"])
    with pytest.raises(ValueError, match="not rl.algo='cispo'"):
        config_lib.load_config("configs/cispo_demo.yaml", ["rl.max_staleness=1"])
