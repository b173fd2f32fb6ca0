"""The configurable policy objective (jaxrlvr.algos.policy_loss) against a scalar Python loop."""

import math
import typing

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlvr.algos import aggregation, loss_config, policy_loss

PLC = loss_config.PolicyLossConfig
CC = loss_config.CorrectionConfig
MODES = typing.get_args(loss_config.Aggregation)

CONFIGS = {
    "grpo": PLC(),
    "dapo_clip_higher_token_mean": PLC(aggregation="token_mean", clip_eps_high=0.28),
    "dual_clip": PLC(dual_clip=3.0, clip_eps_low=0.1),
    "dr_grpo": PLC(aggregation="seq_mean_token_sum_norm", norm_constant=12.0),
    "gspo": PLC(ratio_level="sequence", clip_eps_low=0.05, clip_eps_high=0.08),
    "kl_k3_entropy": PLC(kl_coef=0.1, entropy_coef=0.01),
    "kl_k1_reward": PLC(kl_coef=0.1, kl_estimator="k1", kl_in="reward"),
    "kl_k2": PLC(kl_coef=0.3, kl_estimator="k2", aggregation="seq_mean_token_sum"),
    "truncate_token": PLC(correction=CC(mode="truncate", high=1.5)),
    "truncate_sequence": PLC(
        correction=CC(mode="truncate", level="sequence", high=1.2), aggregation="token_mean"
    ),
    "mask_geometric": PLC(correction=CC(mode="mask", level="geometric", high=1.3)),
    "icepop_token_engine": PLC(correction=CC(mode="icepop", source="engine", high=1.5)),
    "no_clip": PLC(clip=False),
}


def _batch(seed, b=8, t=5, gap=0.5):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, t + 1, size=b)
    mask = (np.arange(t)[None, :] < lengths[:, None]).astype(np.float32)
    mask[1] = 0.0  # an all-masked row
    lp = -rng.uniform(0.1, 3.0, size=(b, t)).astype(np.float32)
    f = lambda: (lp + rng.normal(scale=gap, size=(b, t))).astype(np.float32)
    old, ref, sampler = f(), f(), f()
    ent = rng.uniform(0, 2, size=(b, t)).astype(np.float32)
    adv = rng.normal(size=(b,)).astype(np.float32)
    # Two prompt groups per row (ScaleRL's prompt-level aggregation reads them; a group lies in
    # one row, as a shared-prompt block does).
    groups = np.where(np.arange(t)[None, :] < t // 2, 1, 2).repeat(b, 0).astype(np.int32)
    return dict(
        lp=lp, old=old, adv=adv, mask=mask, ref=ref, sampler=sampler, ent=ent, groups=groups
    )


def _run(d, cfg, lp=None, mask=None, den=None, **overrides):
    mask = d["mask"] if mask is None else mask
    groups = d.get("groups")
    den = aggregation.loss_denominator(mask, cfg, group_ids_bt=groups) if den is None else den
    kwargs = dict(
        ref_logp_bt=d["ref"], sampler_logp_bt=d["sampler"], entropy_bt=d["ent"],
        group_ids_bt=groups,
    )  # fmt: skip
    kwargs.update(overrides)
    return policy_loss.policy_loss(
        jnp.asarray(d["lp"] if lp is None else lp), d["old"], d["adv"], mask, cfg,
        denominator=den, **kwargs,
    )  # fmt: skip


def _loop_reference(d, cfg):
    """Scalar float64 loop over tokens; returns (loss, clip count, kl sum, ratio max)."""
    lp, old, adv, mask = d["lp"], d["old"], d["adv"], d["mask"]
    ref, sampler, ent = d["ref"], d["sampler"], d["ent"]
    b, t = lp.shape
    clamp = cfg.log_ratio_clamp
    row_terms, n_clip, kl_sum, ratio_max = [], 0, 0.0, 0.0
    for i in range(b):
        valid = [j for j in range(t) if mask[i, j]]
        seq_log_ratio = sum(float(lp[i, j]) - float(old[i, j]) for j in valid) / max(len(valid), 1)
        corr = cfg.correction
        tok_log_w = {j: float(old[i, j]) - float(sampler[i, j]) for j in valid}
        seq_log_w = sum(tok_log_w.values())
        low, high = corr.band
        total = 0.0
        for j in valid:
            if cfg.ratio_level == "sequence":
                log_ratio = seq_log_ratio
            else:
                log_ratio = float(lp[i, j]) - float(old[i, j])
            ratio = math.exp(min(max(log_ratio, -clamp), clamp))
            ratio_max = max(ratio_max, ratio)
            a = float(adv[i])
            unclipped = ratio * a
            clipped = min(max(ratio, 1 - cfg.clip_eps_low), 1 + cfg.clip_eps_high) * a
            clipped = clipped if cfg.clip else unclipped
            n_clip += clipped < unclipped
            pg = -min(unclipped, clipped)
            if cfg.dual_clip is not None and a < 0:
                pg = min(pg, -cfg.dual_clip * a)
            # No behaviour log-probs here: engine and both are old / sampler.
            log_w = {
                "token": tok_log_w[j],
                "sequence": seq_log_w,
                "geometric": seq_log_w / len(valid),
            }[corr.level]
            r = math.exp(min(max(log_w, -clamp), clamp))
            inside = low <= r <= high
            w = {
                "none": 1.0,
                "truncate": min(max(r, low), high),
                "mask": float(inside),
                "icepop": r * inside,
            }[corr.mode]
            log_r = min(max(float(ref[i, j]) - float(lp[i, j]), -clamp), clamp)
            k = {
                "k1": -log_r,
                "k2": 0.5 * log_r**2,
                "k3": math.exp(log_r) - 1 - log_r,
            }[cfg.kl_estimator]
            kl_sum += k
            kl_term = cfg.kl_coef * k if cfg.kl_in == "loss" else 0.0
            total += pg * w + kl_term - cfg.entropy_coef * float(ent[i, j])
        if cfg.aggregation == "seq_mean_token_mean":
            total /= max(len(valid), 1)
        row_terms.append(total)
    den = {
        "token_mean": mask.sum(),
        "seq_mean_token_mean": b,
        "seq_mean_token_sum": b,
        "seq_mean_token_sum_norm": b * (cfg.norm_constant or 1.0),
    }[cfg.aggregation]
    return sum(row_terms) / den, n_clip, kl_sum, ratio_max


@pytest.mark.parametrize("name", list(CONFIGS))
def test_matches_loop_reference(name):
    cfg = CONFIGS[name]
    d = _batch(0)
    loss, metrics = _run(d, cfg)
    want, n_clip, kl_sum, ratio_max = _loop_reference(d, cfg)
    # float32 vs float64 over 40 tokens with ratios up to ~e^1.5: 1e-5 relative
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert float(metrics["loss"]) == float(loss)
    assert float(metrics["clip_frac_sum"]) == n_clip
    assert float(metrics["kl_sum"]) == pytest.approx(kl_sum, rel=1e-5)
    assert float(metrics["ratio_max"]) == pytest.approx(ratio_max, rel=1e-5)
    assert float(metrics["token_count"]) == d["mask"].sum()


def test_kl_and_entropy_terms_shift_loss_by_their_aggregates():
    d = _batch(1)
    base = PLC()
    with_terms = PLC(kl_coef=0.2, entropy_coef=0.05)
    den = aggregation.loss_denominator(d["mask"], base)
    kl_agg = float(aggregation.aggregate(jnp.asarray(_k3(d)), d["mask"], base, den))
    ent_agg = float(aggregation.aggregate(jnp.asarray(d["ent"]), d["mask"], base, den))
    l0, _ = _run(d, base)
    l1, m1 = _run(d, with_terms)
    assert float(l1) == pytest.approx(float(l0) + 0.2 * kl_agg - 0.05 * ent_agg, rel=1e-5)
    assert float(m1["kl_loss"]) == pytest.approx(0.2 * kl_agg, rel=1e-5)
    # in-reward KL: the loss ignores it but the metric still reports it
    l2, m2 = _run(d, PLC(kl_coef=0.2, kl_in="reward"))
    assert float(l2) == float(l0) and float(m2["kl_sum"]) > 0 and float(m2["kl_loss"]) == 0


def _k3(d):
    log_r = np.clip(d["ref"].astype(np.float64) - d["lp"], -20, 20)
    return (np.expm1(log_r) - log_r).astype(np.float32)


def test_zero_gradient_on_clipped_and_dual_clipped_tokens():
    # Hand-built tokens, eps = 0.2, dual clip c = 3, one valid token per case.
    log_ratio = np.log(np.array([1.5, 0.5, 1.5, 0.5, 5.0, 1.1, 0.9], np.float32))
    adv = np.array([1.0, -1.0, -1.0, 1.0, -1.0, 1.0, -1.0], np.float32)
    # clipped-branch wins for cases 0 and 1; dual clip caps case 4; others get gradient.
    zero = np.array([1, 1, 0, 0, 1, 0, 0], bool)
    b = len(adv)
    old = np.full((b, 1), -1.0, np.float32)
    lp = old + log_ratio[:, None]
    mask = np.ones((b, 1), np.float32)
    cfg = PLC(dual_clip=3.0, aggregation="seq_mean_token_sum")
    d = dict(lp=lp, old=old, adv=adv, mask=mask, ref=None, sampler=None, ent=None)

    def f(x):
        return _run(d, cfg, lp=x, ref_logp_bt=None, sampler_logp_bt=None, entropy_bt=None)[0]

    grad = np.asarray(jax.grad(f)(jnp.asarray(lp)))[:, 0]
    assert np.all(grad[zero] == 0.0)
    # unclipped: d(-ratio * A / B)/d lp = -ratio * A / B
    np.testing.assert_allclose(grad[~zero], (-np.exp(log_ratio) * adv / b)[~zero], rtol=1e-6)
    _, m = _run(d, cfg, ref_logp_bt=None, sampler_logp_bt=None, entropy_bt=None)
    assert float(m["clip_frac_sum"]) == 2 and float(m["dual_clip_frac_sum"]) == 1
    assert float(m["clip_high_frac_sum"]) == 1  # case 0: ratio 1.5 > 1.2 with A > 0
    assert float(m["clip_low_frac_sum"]) == 1  # case 1: ratio 0.5 < 0.8 with A < 0


def test_no_clip_keeps_the_gradient_that_clipping_zeroes():
    # The tokens of the test above whose clipped branch wins (ratio 1.5 with A > 0, 0.5 with
    # A < 0) and two inside the range: without clipping every token gets -ratio * A / B.
    log_ratio = np.log(np.array([1.5, 0.5, 1.1, 0.9], np.float32))
    adv = np.array([1.0, -1.0, 1.0, -1.0], np.float32)
    b = len(adv)
    old = np.full((b, 1), -1.0, np.float32)
    lp = old + log_ratio[:, None]
    d = dict(lp=lp, old=old, adv=adv, mask=np.ones((b, 1), np.float32), ref=None, sampler=None)
    d["ent"] = None

    def grad(cfg):
        def f(x):
            return _run(d, cfg, lp=x, ref_logp_bt=None, sampler_logp_bt=None, entropy_bt=None)[0]

        return np.asarray(jax.grad(f)(jnp.asarray(lp)))[:, 0]

    want = -np.exp(log_ratio) * adv / b
    np.testing.assert_allclose(grad(PLC(clip=False)), want, rtol=1e-6)
    clipped = grad(PLC())
    assert np.all(clipped[:2] == 0.0)
    np.testing.assert_allclose(clipped[2:], want[2:], rtol=1e-6)


def test_gspo_gradient_is_sequence_ratio_times_mean_token_gradient():
    d = _batch(2, gap=0.02)  # small gap: every sequence ratio inside the clip range
    cfg = PLC(ratio_level="sequence")
    grad = np.asarray(
        jax.grad(lambda x: _run(d, cfg, lp=x, ref_logp_bt=None, sampler_logp_bt=None)[0])(
            jnp.asarray(d["lp"])
        )
    )
    m = d["mask"]
    count = np.maximum(m.sum(-1, keepdims=True), 1)
    s = np.exp(((d["lp"] - d["old"]) * m).sum(-1, keepdims=True) / count)
    assert np.all(np.abs(s - 1) < 0.2)
    b = m.shape[0]
    # J = (1/B) sum_i s_i A_i; d s_i / d lp_t = s_i / |y_i| (per valid token); seq_mean_token_mean
    # over a per-sequence constant is that constant.
    want = -d["adv"][:, None] * s * m / count / b
    np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-8)


def test_truncate_weights_and_metrics():
    d = _batch(3, gap=1.0)
    _, m = _run(d, PLC(correction=CC(mode="truncate", high=1.5)))
    diff = (d["old"] - d["sampler"]).astype(np.float64)
    valid = d["mask"] > 0
    w = np.minimum(np.exp(diff), 1.5)
    assert float(m["offpolicy/weight_sum"]) == pytest.approx(w[valid].sum(), rel=1e-5)
    assert float(m["offpolicy/both/truncated_sum"]) == (np.exp(diff) > 1.5)[valid].sum()
    assert float(m["logp_diff_abs_sum"]) == pytest.approx(np.abs(diff)[valid].sum(), rel=1e-5)
    assert float(m["logp_diff_abs_max"]) == pytest.approx(np.abs(diff)[valid].max(), rel=1e-6)
    # The weights carry no gradient: d/d lp of the weighted loss = w * d/d lp of the plain loss
    # at token level (ratio and weight are both per token).
    cfg_w, cfg_0 = PLC(correction=CC(mode="truncate", high=1.5)), PLC()
    g_w = jax.grad(lambda x: _run(d, cfg_w, lp=x)[0])(jnp.asarray(d["lp"]))
    g_0 = jax.grad(lambda x: _run(d, cfg_0, lp=x)[0])(jnp.asarray(d["lp"]))
    np.testing.assert_allclose(g_w, w * np.asarray(g_0), rtol=1e-5, atol=1e-8)


def test_per_token_advantages_equal_broadcast_sequence_advantages():
    d = _batch(4)
    cfg = PLC(kl_coef=0.1)
    l1, _ = _run(d, cfg)
    d2 = dict(d, adv=np.broadcast_to(d["adv"][:, None], d["lp"].shape).copy())
    l2, _ = _run(d2, cfg)
    assert float(l1) == float(l2)


@pytest.mark.parametrize("mode", MODES)
def test_one_vs_four_microbatches_full_objective(mode):
    cfg = PLC(
        aggregation=mode,
        norm_constant=10.0 if mode == "seq_mean_token_sum_norm" else None,
        kl_coef=0.05,
        entropy_coef=0.01,
        correction=CC(mode="icepop", level="geometric", high=1.5),
        dual_clip=3.0,
        clip_eps_high=0.28,
    )
    d = _batch(5, gap=0.4)
    den = aggregation.loss_denominator(d["mask"], cfg, group_ids_bt=d["groups"])
    full = jax.grad(lambda x: _run(d, cfg, lp=x, den=den)[0])(jnp.asarray(d["lp"]))
    parts, acc = [], policy_loss.metrics_identity(_run(d, cfg, den=den)[1])
    for idx in np.split(np.arange(8), 4):
        dm = {k: v[idx] for k, v in d.items()}
        parts.append(jax.grad(lambda x, dm=dm: _run(dm, cfg, lp=x, den=den)[0])(dm["lp"]))
        acc = policy_loss.accumulate_metrics(acc, _run(dm, cfg, den=den)[1])
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-6)  # issue's bound
    # Metrics accumulated over microbatches equal the full batch's (sums, max, min).
    whole = policy_loss.finalize_metrics(_run(d, cfg, den=den)[1])
    chex.assert_trees_all_close(policy_loss.finalize_metrics(acc), whole, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("gap", [50.0, -50.0])
def test_no_nan_for_large_gaps_masked_rows_and_equal_rewards(name, gap):
    cfg = CONFIGS[name]
    d = _batch(6)
    d["old"] = (d["lp"] - gap).astype(np.float32)
    d["ref"] = (d["lp"] + gap).astype(np.float32)
    d["sampler"] = (d["old"] - gap).astype(np.float32)
    d["lp"][d["mask"] == 0] = -np.inf  # padded positions may hold garbage
    d["adv"] = np.zeros_like(d["adv"])  # an all-equal group gives A = 0
    d["adv"][::2] = -1.0
    loss, metrics = _run(d, cfg)
    grad = jax.grad(lambda x: _run(d, cfg, lp=x)[0])(jnp.asarray(d["lp"]))
    assert np.isfinite(float(loss))
    assert np.all(np.isfinite(np.asarray(grad)))
    assert np.all(np.asarray(grad)[d["mask"] == 0] == 0.0)
    for key, value in policy_loss.finalize_metrics(metrics).items():
        assert np.isfinite(float(value)), key


def test_fully_masked_batch_gives_zero_loss_and_finite_metrics():
    d = _batch(7)
    mask = np.zeros_like(d["mask"])
    for cfg in CONFIGS.values():
        loss, metrics = _run(d, cfg, mask=mask)
        assert float(loss) == 0.0
        final = policy_loss.finalize_metrics(metrics)
        assert all(np.isfinite(float(v)) for v in final.values())


def test_missing_inputs_are_clear_errors():
    d = _batch(8)
    with pytest.raises(ValueError, match="ref_logp_bt"):
        _run(d, PLC(kl_coef=0.1), ref_logp_bt=None)
    with pytest.raises(ValueError, match="sampler_logp_bt"):
        _run(d, PLC(correction=CC(mode="mask", level="sequence")), sampler_logp_bt=None)
    with pytest.raises(ValueError, match="loss.correction"):
        PLC(tis="token")
    with pytest.raises(ValueError, match="entropy_bt"):
        _run(d, PLC(entropy_coef=0.1), entropy_bt=None)


def test_metric_keys_do_not_depend_on_optional_inputs():
    d = _batch(9)
    _, with_all = _run(d, PLC())
    _, with_none = _run(d, PLC(), ref_logp_bt=None, sampler_logp_bt=None, entropy_bt=None)
    assert with_all.keys() == with_none.keys()


class PolicyLossVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        d = _batch(10)
        # Three configs reach every branch (compiling all ten costs ~10 s on two shared cores).
        configs = {
            "grpo": PLC(),
            "everything_token": PLC(
                aggregation="token_mean", dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01,
                correction=CC(mode="truncate"), clip_eps_high=0.28,
            ),
            "gspo_drgrpo_icepop_seq": PLC(
                ratio_level="sequence", aggregation="seq_mean_token_sum_norm", norm_constant=8.0,
                correction=CC(mode="icepop", level="sequence", high=3.0), kl_coef=0.1,
                kl_estimator="k2",
            ),
        }  # fmt: skip
        for name, cfg in configs.items():

            def fn(lp, old, adv, mask, ref, sampler, ent, cfg=cfg):
                den = aggregation.loss_denominator(mask, cfg)
                return policy_loss.policy_loss(
                    lp, old, adv, mask, cfg, denominator=den,
                    ref_logp_bt=ref, sampler_logp_bt=sampler, entropy_bt=ent,
                )  # fmt: skip

            args = [d[k] for k in ("lp", "old", "adv", "mask", "ref", "sampler", "ent")]
            # float32 reductions over 40 tokens; XLA may reorder them under jit
            chex.assert_trees_all_close(
                self.variant(fn)(*args), fn(*args), rtol=1e-6, atol=1e-7, custom_message=name
            )
