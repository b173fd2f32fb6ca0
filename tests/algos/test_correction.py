"""The off-policy correction inside the policy loss (``policy_loss`` with ``loss.correction``):
gradients, exactness over microbatches and under packing, with all three log-prob sources
(old, behaviour, sampler) present, for every level x mode.

The NumPy references of the weights and diagnostics themselves are in test_importance.py.
"""

import itertools
import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlvr.algos import aggregation, importance, loss_config, policy_loss

PLC = loss_config.PolicyLossConfig
CC = loss_config.CorrectionConfig
LEVELS = typing.get_args(loss_config.CorrectionLevel)
MODES = typing.get_args(loss_config.CorrectionMode)
SOURCES = typing.get_args(loss_config.CorrectionSource)
# Every level and every mode at least once (the full level x mode grid is checked against
# NumPy in test_importance.py and for gradients below).
COVER = [
    ("token", "icepop"),
    ("sequence", "truncate"),
    ("geometric", "mask"),
    ("sequence", "icepop"),
    ("token", "none"),
]


def _batch(seed, b=8, t=6, gap=0.3):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, b)
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    mask[2] = 0.0
    mask[0, 1] = 0.0  # an environment token inside a response
    lp = -rng.uniform(0.1, 3.0, (b, t))
    behaviour = lp + rng.normal(0, gap, (b, t))
    old = behaviour + rng.normal(0, gap, (b, t))
    sampler = behaviour + rng.normal(0, gap, (b, t))
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    return dict(
        lp=f32(old + rng.normal(0, 0.05, (b, t))),
        old=f32(old),
        behaviour=f32(behaviour),
        sampler=f32(sampler),
        adv=f32(rng.normal(size=b)),
        mask=mask,
    )


def _loss(d, cfg, lp=None, den=None, seg=None, adv=None):
    den = aggregation.loss_denominator(d["mask"], cfg, seg) if den is None else den
    return policy_loss.policy_loss(
        jnp.asarray(d["lp"] if lp is None else lp),
        d["old"],
        d["adv"] if adv is None else adv,
        d["mask"],
        cfg,
        denominator=den,
        sampler_logp_bt=d["sampler"],
        behaviour_logp_bt=d["behaviour"],
        segment_ids_bt=seg,
    )


@pytest.mark.parametrize("level, mode", list(itertools.product(LEVELS, MODES)))
def test_gradient_is_the_weight_times_the_plain_gradient(level, mode):
    """w is a constant per token, so d loss / d lp = w * (d plain loss / d lp) token by token,
    for every source; and the plain gradient itself matches central finite differences."""
    d = _batch(1)
    plain = PLC(aggregation="token_mean")
    g0 = np.asarray(jax.grad(lambda x: _loss(d, plain, lp=x)[0])(jnp.asarray(d["lp"])))
    for source in SOURCES:
        cfg = PLC(aggregation="token_mean", correction=CC(mode=mode, level=level, source=source))
        g = np.asarray(jax.grad(lambda x, cfg=cfg: _loss(d, cfg, lp=x)[0])(jnp.asarray(d["lp"])))
        lr = importance.source_log_ratio(source, d["old"], d["behaviour"], d["sampler"])
        w = np.asarray(importance.correction_weights(lr, d["mask"], cfg.correction)[0])
        # float32 gradients of a mean over ~30 tokens: 1e-6 relative, 1e-9 absolute
        np.testing.assert_allclose(g, w * g0, rtol=1e-6, atol=1e-9, err_msg=source)
        assert np.all(g[d["mask"] == 0] == 0.0)
        if mode in ("mask", "icepop"):
            masked = np.asarray(importance.correction_weights(lr, d["mask"], cfg.correction)[1])
            assert np.all(g[masked > 0] == 0.0)  # rejected tokens get no gradient


def test_plain_gradient_matches_finite_differences():
    d = _batch(2)
    cfg = PLC(aggregation="token_mean", correction=CC(mode="icepop", level="geometric"))
    f = lambda x: float(_loss(d, cfg, lp=x)[0])  # noqa: E731
    g = np.asarray(jax.grad(lambda x: _loss(d, cfg, lp=x)[0])(jnp.asarray(d["lp"])))
    lp = d["lp"].astype(np.float64)
    eps = 1e-3
    for i, j in [(0, 0), (3, 1), (5, 2)]:
        if d["mask"][i, j] == 0:
            continue
        up, down = lp.copy(), lp.copy()
        up[i, j] += eps
        down[i, j] -= eps
        fd = (f(up.astype(np.float32)) - f(down.astype(np.float32))) / (2 * eps)
        # float32 loss differences over 2e-3: 2e-3 absolute on gradients of size ~0.05
        assert fd == pytest.approx(g[i, j], abs=2e-3)


@pytest.mark.parametrize("level, mode", COVER)
def test_four_microbatches_equal_one(level, mode):
    """Loss, gradient and every metric (token and sequence fractions, ESS, max / min) are the
    same accumulated over four microbatches as on the whole batch."""
    cfg = PLC(correction=CC(mode=mode, level=level, source="engine", high=1.3))
    d = _batch(3)
    den = aggregation.loss_denominator(d["mask"], cfg)
    full = jax.grad(lambda x: _loss(d, cfg, lp=x, den=den)[0])(jnp.asarray(d["lp"]))
    whole = policy_loss.finalize_metrics(_loss(d, cfg, den=den)[1])
    acc, parts = policy_loss.metrics_identity(_loss(d, cfg, den=den)[1]), []
    for idx in np.split(np.arange(8), 4):
        dm = {k: v[idx] for k, v in d.items()}
        parts.append(jax.grad(lambda x, dm=dm: _loss(dm, cfg, lp=x, den=den)[0])(dm["lp"]))
        acc = policy_loss.accumulate_metrics(acc, _loss(dm, cfg, den=den)[1])
    # float32 sums in a different order: 1e-6 absolute on gradients and losses
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-6)
    got = policy_loss.finalize_metrics(acc)
    assert got.keys() == whole.keys()
    for k in whole:
        np.testing.assert_allclose(got[k], whole[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert "offpolicy/engine/ess" in got and "offpolicy/staleness/seq_masked" in got


def _pack(d):
    """The rows of ``d`` laid two per packed row (segments 1 and 2), per-token advantages."""
    b, t = d["mask"].shape
    out = {k: np.zeros((b // 2, 2 * t), np.float32) for k in d if k != "adv"}
    seg = np.zeros((b // 2, 2 * t), np.int32)
    adv = np.zeros((b // 2, 2 * t), np.float32)
    for r in range(b // 2):
        for s in range(2):
            i, cols = 2 * r + s, slice(s * t, (s + 1) * t)
            for k in out:
                out[k][r, cols] = d[k][i]
            seg[r, cols] = s + 1
            adv[r, cols] = d["adv"][i]
    out["adv"] = adv
    return out, seg


@pytest.mark.parametrize("level, mode", COVER)
def test_packed_rows_equal_padded_rows(level, mode):
    """Sequence and geometric ratios are per segment: two sequences packed in one row give the
    same loss, gradient and metrics as one sequence per row."""
    cfg = PLC(correction=CC(mode=mode, level=level, source="both", high=1.3))
    d = _batch(4)
    packed, seg = _pack(d)
    adv_bt = np.broadcast_to(d["adv"][:, None], d["mask"].shape).astype(np.float32)
    l_pad, m_pad = _loss(d, cfg, adv=adv_bt)
    l_pack, m_pack = _loss(packed, cfg, seg=seg)
    # float32 sums in a different order: 1e-6
    assert float(l_pack) == pytest.approx(float(l_pad), abs=1e-6)
    g_pad = jax.grad(lambda x: _loss(d, cfg, lp=x, adv=adv_bt)[0])(jnp.asarray(d["lp"]))
    g_pack = jax.grad(lambda x: _loss(packed, cfg, lp=x, seg=seg)[0])(jnp.asarray(packed["lp"]))
    np.testing.assert_allclose(_pack({**d, "lp": np.asarray(g_pad)})[0]["lp"], g_pack, atol=1e-6)
    f_pad, f_pack = policy_loss.finalize_metrics(m_pad), policy_loss.finalize_metrics(m_pack)
    for k in f_pad:
        np.testing.assert_allclose(f_pack[k], f_pad[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_sources_read_the_right_log_probs():
    """engine ignores old_logp, staleness ignores the sampler, both reads old and sampler only:
    changing the log-probs a source does not read leaves its weights (and the loss) alone."""
    d = _batch(5)
    for source, untouched in [("engine", "old"), ("staleness", "sampler"), ("both", "behaviour")]:
        cfg = PLC(correction=CC(mode="icepop", source=source))
        if untouched == "old":  # old also sets the PPO ratio: compare the weight sums instead
            key = "offpolicy/weight_sum"
        else:
            key = "loss"
        moved = dict(d, **{untouched: d[untouched] + 0.7})
        a, b = _loss(d, cfg)[1][key], _loss(moved, cfg)[1][key]
        assert float(a) == pytest.approx(float(b), rel=1e-6), source
    # ... and without behaviour log-probs the staleness ratio is exactly 1.
    d_sync = dict(d, behaviour=d["old"])
    m = policy_loss.finalize_metrics(_loss(d_sync, PLC())[1])
    assert float(m["offpolicy/staleness/k1"]) == 0 and float(m["offpolicy/staleness/ess"]) == 1
