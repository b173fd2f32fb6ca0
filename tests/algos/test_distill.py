"""On-policy distillation losses (jaxrlvr.algos.distill): NumPy references, the analytic
reverse-KL gradient on a small categorical, microbatch and packing exactness, jit and eager."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlvr.algos import aggregation, distill, policy_loss
from jaxrlvr.algos.loss_config import PolicyLossConfig as PLC

BETAS = [0.0, 0.1, 0.5, 0.9, 1.0]


def _log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def _np_jsd(s_logits, t_logits, beta, temperature=1.0):
    """Independent float64 reference: probabilities, explicit mixture, sum p log(p / m)."""
    p = np.exp(_log_softmax(np.asarray(s_logits, np.float64) / temperature))
    q = np.exp(_log_softmax(np.asarray(t_logits, np.float64) / temperature))

    def kl(a, b):
        return np.sum(np.where(a > 0, a * (np.log(a) - np.log(b)), 0.0), axis=-1)

    if beta == 0:
        return kl(q, p)
    if beta == 1:
        return kl(p, q)
    m = beta * q + (1 - beta) * p
    return beta * kl(q, m) + (1 - beta) * kl(p, m)


def _tokens(seed, b=4, t=6, gap=1.0):
    rng = np.random.default_rng(seed)
    lp = -rng.uniform(0.1, 4.0, size=(b, t)).astype(np.float32)
    teacher = (lp + rng.normal(scale=gap, size=(b, t))).astype(np.float32)
    mask = (rng.uniform(size=(b, t)) < 0.75).astype(np.float32)
    mask[:, 0] = 1.0
    return lp, teacher, mask


def test_reverse_kl_advantages_match_numpy():
    lp, teacher, mask = _tokens(0)
    # Padding may hold -inf log-probs: they must not leak NaN.
    lp_pad = np.where(mask > 0, lp, -np.inf).astype(np.float32)
    reward_b = np.array([1.0, -0.5, 0.0, 2.0], np.float32)
    got = distill.reverse_kl_advantages(
        lp_pad, teacher, mask, kl_coef=0.7, reward_adv=reward_b, reward_coef=0.3
    )
    want = np.where(
        mask > 0,
        -0.7 * (lp.astype(np.float64) - teacher) + 0.3 * reward_b[:, None],
        0.0,
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    # Per-token reward advantages give the same as their per-sequence broadcast.
    per_token = np.broadcast_to(reward_b[:, None], lp.shape).astype(np.float32)
    got_bt = distill.reverse_kl_advantages(
        lp_pad, teacher, mask, kl_coef=0.7, reward_adv=per_token, reward_coef=0.3
    )
    np.testing.assert_array_equal(got_bt, got)
    with pytest.raises(ValueError, match="reward_coef != 0 requires `reward_adv`"):
        distill.reverse_kl_advantages(lp, teacher, mask, reward_coef=0.5)


@pytest.mark.parametrize("beta", BETAS)
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_generalized_jsd_matches_numpy(beta, temperature):
    rng = np.random.default_rng(1)
    s, t = (rng.normal(scale=2.0, size=(2, 3, 17)).astype(np.float32) for _ in range(2))
    got = distill.generalized_jsd(s, t, beta=beta, temperature=temperature)
    chex.assert_shape(got, (2, 3))
    np.testing.assert_allclose(got, _np_jsd(s, t, beta, temperature), rtol=1e-5, atol=1e-6)
    # Teacher log-probs instead of logits: the same distribution, the same divergence.
    t_logp = np.asarray(jax.nn.log_softmax(jnp.asarray(t)), np.float32)
    np.testing.assert_allclose(
        distill.generalized_jsd(s, t_logp, beta=beta, temperature=temperature),
        got,
        rtol=1e-5,
        atol=1e-6,
    )


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_generalized_jsd_topk_matches_numpy_and_full_at_k_equal_v(beta):
    rng = np.random.default_rng(2)
    v, k = 13, 4
    s, t = (rng.normal(scale=2.0, size=(3, 5, v)).astype(np.float32) for _ in range(2))
    t_logp = _log_softmax(t)
    ids = np.argsort(-t, axis=-1)[..., :k].astype(np.int32)
    top_logp = np.take_along_axis(t_logp, ids, axis=-1).astype(np.float32)
    got = distill.generalized_jsd_topk(s, ids, top_logp, beta=beta, temperature=1.5, tail=False)
    # Reference: both restricted to the teacher's top-k tokens and renormalised there.
    want = _np_jsd(np.take_along_axis(s, ids, axis=-1), top_logp, beta, temperature=1.5)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # K = V, ids in any order: the full-vocabulary divergence.
    all_ids = np.argsort(-t, axis=-1).astype(np.int32)
    full_logp = np.take_along_axis(t_logp, all_ids, axis=-1).astype(np.float32)
    for tail in (True, False):  # the tail holds ~1e-7 (the clamp) in both: no change
        np.testing.assert_allclose(
            distill.generalized_jsd_topk(s, all_ids, full_logp, beta=beta, tail=tail),
            distill.generalized_jsd(s, t, beta=beta),
            rtol=1e-5,
            atol=1e-6,
        )


def _np_tail(topk_logp):
    """TRL's ``_add_tail_bucket`` in float64: log(1 - sum_k p_k) (log-sum clamped <= -1e-7)."""
    lp = np.asarray(topk_logp, np.float64)
    log_s = np.minimum(np.log(np.sum(np.exp(lp), axis=-1, keepdims=True)), -1e-7)
    return np.concatenate([lp, np.log(-np.expm1(log_s))], axis=-1)


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_tail_bucket_jsd_equals_trls_formula(beta, k):
    """The default top-k form: both the student's full-vocabulary log-probs at the teacher's
    top-k ids and the teacher's top-k log-probs get TRL's tail bucket; the divergence over the
    K+1 buckets equals an independent float64 computation to 1e-6 (K = 1 included: 2 buckets).
    The teacher's tails here hold >= 1 % of its mass: 1 - sum_k p_k in float32 (as in TRL)
    keeps fewer digits of a tail near 1e-4."""
    rng = np.random.default_rng(11 + k)
    v = 50
    s = rng.normal(scale=2.0, size=(3, 5, v)).astype(np.float32)
    t_logp = _log_softmax(rng.normal(scale=1.5, size=(3, 5, v)))
    ids = np.argsort(-t_logp, axis=-1)[..., :k].astype(np.int32)
    top_logp = np.take_along_axis(t_logp, ids, axis=-1).astype(np.float32)
    got = distill.generalized_jsd_topk(s, ids, top_logp, beta=beta)
    want = _np_jsd(
        _np_tail(np.take_along_axis(_log_softmax(s), ids, axis=-1)), _np_tail(top_logp), beta
    )
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert np.all(want > 1e-3)  # not the renormalised K = 1 zero
    assert np.all(1 - np.exp(top_logp.astype(np.float64)).sum(-1) > 0.01)


def _bisect(f, lo, hi, target, n=80):
    """x in [lo, hi] with f(x) = target, f increasing."""
    for _ in range(n):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if f(mid) < target else (lo, mid)
    return (lo + hi) / 2


def test_issue_example_tail_moves_the_top_k_reverse_kl_to_the_full_one():
    """Issue 48's example: a teacher with 98.5 % of its mass in its top 4 and a student with
    23 % there, built so that the reverse KL (beta 1) is 1.63 renormalised over the top 4 and
    3.68 over the vocabulary. With the tail the top-4 value is
    0.23 (1.63 + log(0.23 / 0.985)) + 0.77 log(0.77 / 0.015) = 3.07, whatever the rest's shape."""
    v, k = 1000, 4
    rng = np.random.default_rng(0)
    t_top = 0.985 * np.array([0.7, 0.2, 0.07, 0.03])
    t = np.concatenate([t_top, np.full(v - k, 0.015 / (v - k))])
    w = np.array([0.0, 1.0, 2.0, 3.0])

    def kl(a, b):
        return float(np.sum(a * np.log(a / b)))

    def top_shape(x):  # the student's top-4 shape, away from the teacher's as x grows
        return np.exp(x * w) / np.exp(x * w).sum()

    x = _bisect(lambda x: kl(top_shape(x), t_top / 0.985), 0.0, 10.0, 1.63)
    z = rng.normal(size=v - k)

    def rest_shape(a):
        return np.exp(a * z) / np.exp(a * z).sum()

    uniform = np.full(v - k, 1 / (v - k))
    a = _bisect(
        lambda a: kl(rest_shape(a), uniform),
        0.0,
        10.0,
        (
            3.68
            - 0.23 * kl(top_shape(x), t_top / 0.985)
            - 0.23 * np.log(0.23 / 0.985)
            - 0.77 * np.log(0.77 / 0.015)
        )
        / 0.77,
    )
    s = np.concatenate([0.23 * top_shape(x), 0.77 * rest_shape(a)])
    assert kl(s, t) == pytest.approx(3.68, abs=1e-6)

    s_logits = np.log(s).astype(np.float32)[None]
    ids = np.arange(k, dtype=np.int32)[None]
    t_logp = np.log(t_top).astype(np.float32)[None]
    full = float(distill.generalized_jsd(s_logits, np.log(t).astype(np.float32)[None])[0])
    renorm = float(distill.generalized_jsd_topk(s_logits, ids, t_logp, tail=False)[0])
    tail = float(distill.generalized_jsd_topk(s_logits, ids, t_logp)[0])
    assert full == pytest.approx(3.68, abs=1e-4)
    assert renorm == pytest.approx(1.63, abs=1e-4)
    assert tail == pytest.approx(
        0.23 * (1.63 + np.log(0.23 / 0.985)) + 0.77 * np.log(0.77 / 0.015), abs=1e-4
    )
    # the tail closes 70 % of the renormalised form's gap to the full-vocabulary value
    assert renorm < tail <= full and full - tail < 0.3 * (full - renorm)


@pytest.mark.parametrize("tail", [True, False])
def test_nan_teacher_on_padding_gives_finite_jsd_gradients(tail):
    """The mask is applied before the divergence: NaN teacher log-probs and out-of-range ids on
    padded positions change neither the loss nor its (finite) gradient."""
    rng = np.random.default_rng(5)
    v, k = 11, 3
    s = rng.normal(size=(2, 4, v)).astype(np.float32)
    t_logp = _log_softmax(rng.normal(scale=2.0, size=(2, 4, v)))
    ids = np.argsort(-t_logp, axis=-1)[..., :k].astype(np.int32)
    top = np.take_along_axis(t_logp, ids, axis=-1).astype(np.float32)
    mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], np.float32)
    bad_top, bad_ids = top.copy(), ids.copy()
    bad_top[mask == 0] = np.nan
    bad_ids[mask == 0] = 10**6
    cfg = PLC(aggregation="token_mean")
    den = aggregation.loss_denominator(mask, cfg)

    def loss(x, ids, top):
        jsd = distill.generalized_jsd_topk(x, ids, top, beta=0.5, tail=tail, mask=mask)
        return distill.jsd_loss(jsd, mask, cfg, denominator=den)[0]

    value_and_grad = jax.jit(jax.value_and_grad(loss))  # one program for both inputs
    clean_v, clean_g = value_and_grad(s, ids, top)
    bad_v, bad_g = value_and_grad(s, bad_ids, bad_top)
    assert np.all(np.isfinite(bad_g)) and float(bad_v) > 0
    np.testing.assert_array_equal(bad_v, clean_v)
    np.testing.assert_array_equal(bad_g, clean_g)
    np.testing.assert_array_equal(bad_g[mask == 0], 0.0)


def test_jsd_loss_coefficient_scales_the_loss_not_the_metrics():
    rng = np.random.default_rng(6)
    jsd = rng.uniform(size=(2, 5)).astype(np.float32)
    mask = np.ones((2, 5), np.float32)
    cfg = PLC(aggregation="token_mean")
    one, m1 = distill.jsd_loss(jsd, mask, cfg, denominator=10.0)
    two, m2 = distill.jsd_loss(jsd, mask, cfg, denominator=10.0, coef=2.5)
    assert float(two) == pytest.approx(2.5 * float(one), rel=1e-6)
    assert float(m2["distill/jsd_sum"]) == float(m1["distill/jsd_sum"])


def _categorical(seed, v=6):
    rng = np.random.default_rng(seed)
    theta = jnp.asarray(rng.normal(size=v), jnp.float32)
    log_q = jax.nn.log_softmax(jnp.asarray(rng.normal(scale=1.5, size=v), jnp.float32))
    return theta, log_q


def _analytic_reverse_kl_grad(theta, log_q):
    """d/dtheta KL(softmax(theta) || q) = pi * (log pi - log q - KL), in float64."""
    log_pi = _log_softmax(np.asarray(theta))
    pi = np.exp(log_pi)
    diff = log_pi - np.asarray(log_q, np.float64)
    return pi * (diff - np.sum(pi * diff))


@pytest.mark.parametrize("aggregation_mode", ["token_mean", "seq_mean_token_mean"])
def test_reverse_kl_advantage_gradient_is_the_analytic_reverse_kl_gradient(aggregation_mode):
    # One position, every action a enumerated with its probability pi(a) (held fixed): the
    # expected policy-gradient loss E_a~pi[loss(a)] has the gradient of KL(pi || q) exactly.
    theta, log_q = _categorical(3)
    v = theta.shape[0]
    cfg = PLC(aggregation=aggregation_mode)
    dcfg = distill.DistillConfig(kl_coef=1.0)
    one = jnp.ones((1, 1), jnp.float32)

    def expected_loss(th):
        log_pi = jax.nn.log_softmax(th)
        pi = jax.lax.stop_gradient(jnp.exp(log_pi))
        total = 0.0
        for a in range(v):
            loss, _ = distill.reverse_kl_policy_loss(
                log_pi[a].reshape(1, 1), log_q[a].reshape(1, 1), one, cfg, dcfg,
                denominator=jnp.float32(1.0),
            )  # fmt: skip
            total = total + pi[a] * loss
        return total

    got = jax.grad(expected_loss)(theta)
    np.testing.assert_allclose(got, _analytic_reverse_kl_grad(theta, log_q), atol=2e-6)


def test_jsd_gradients_at_the_endpoints_are_the_analytic_kl_gradients():
    theta, log_q = _categorical(4, v=9)
    rev = jax.grad(lambda th: distill.generalized_jsd(th, log_q, beta=1.0))(theta)
    np.testing.assert_allclose(rev, _analytic_reverse_kl_grad(theta, log_q), atol=2e-6)
    # Forward KL(q || pi): d/dtheta = pi - q.
    fwd = jax.grad(lambda th: distill.generalized_jsd(th, log_q, beta=0.0))(theta)
    want = np.exp(_log_softmax(np.asarray(theta))) - np.exp(np.asarray(log_q, np.float64))
    np.testing.assert_allclose(fwd, want, atol=2e-6)
    # No gradient flows into the teacher.
    g_teacher = jax.grad(lambda t: distill.generalized_jsd(theta, t, beta=0.5))(log_q)
    np.testing.assert_array_equal(g_teacher, 0.0)


@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_one_vs_two_microbatches_and_packed_rows_are_exact(mode):
    cfg = PLC(aggregation=mode)
    dcfg = distill.DistillConfig(kl_coef=0.8, reward_coef=0.5)
    lp, teacher, mask = _tokens(5, b=4, t=6)
    reward = np.array([1.0, 0.0, -1.0, 0.5], np.float32)
    rng = np.random.default_rng(5)
    jsd_bt = rng.uniform(0.0, 2.0, size=lp.shape).astype(np.float32)
    den = aggregation.loss_denominator(mask, cfg)

    def rkl(x, idx):
        return distill.reverse_kl_policy_loss(
            x, teacher[idx], mask[idx], cfg, dcfg, denominator=den, reward_adv=reward[idx]
        )

    full_idx = np.arange(4)
    full_g = jax.grad(lambda x: rkl(x, full_idx)[0])(jnp.asarray(lp))
    parts = [np.arange(0, 4, 2), np.arange(1, 4, 2)]  # the engine's strided split
    g = np.zeros_like(lp)
    acc = policy_loss.metrics_identity(rkl(lp, full_idx)[1])
    for idx in parts:
        g[idx] = jax.grad(lambda x, idx=idx: rkl(x, idx)[0])(jnp.asarray(lp[idx]))
        acc = policy_loss.accumulate_metrics(acc, rkl(lp[idx], idx)[1])
    np.testing.assert_allclose(g, full_g, rtol=0, atol=1e-7)
    chex.assert_trees_all_close(
        policy_loss.finalize_metrics(acc),
        policy_loss.finalize_metrics(rkl(lp, full_idx)[1]),
        rtol=1e-5,
        atol=1e-6,
    )
    want_kl = np.sum(mask * (lp - teacher)) / np.sum(mask)
    got = policy_loss.finalize_metrics(rkl(lp, full_idx)[1])["distill/reverse_kl"]
    np.testing.assert_allclose(got, want_kl, rtol=1e-5)

    jl_full, jm_full = distill.jsd_loss(jsd_bt, mask, cfg, denominator=den)
    jl_parts = sum(
        float(distill.jsd_loss(jsd_bt[i], mask[i], cfg, denominator=den)[0]) for i in parts
    )
    np.testing.assert_allclose(jl_parts, float(jl_full), rtol=1e-6)
    np.testing.assert_allclose(
        policy_loss.finalize_metrics(jm_full)["distill/jsd"],
        np.sum(mask * jsd_bt) / np.sum(mask),
        rtol=1e-6,
    )

    # Rows 0 and 1 packed into one row (segments 1 and 2) aggregate as the padded rows do.
    t = lp.shape[1]
    two = np.arange(2)
    packed = lambda x: x[two].reshape(1, 2 * t)  # noqa: E731
    seg = np.repeat(np.array([[1, 2]], np.int32), t, axis=1)
    den2 = aggregation.loss_denominator(mask[two], cfg)
    den2p = aggregation.loss_denominator(packed(mask), cfg, seg)
    np.testing.assert_allclose(den2p, den2)
    padded = distill.reverse_kl_policy_loss(
        lp[two], teacher[two], mask[two], cfg, dcfg, denominator=den2, reward_adv=reward[two]
    )[0]
    reward_bt = np.broadcast_to(reward[two, None], (2, t)).reshape(1, 2 * t)
    packed_loss = distill.reverse_kl_policy_loss(
        packed(lp), packed(teacher), packed(mask), cfg, dcfg,
        denominator=den2p, reward_adv=reward_bt, segment_ids_bt=seg,
    )[0]  # fmt: skip
    np.testing.assert_allclose(packed_loss, padded, rtol=1e-6)
    np.testing.assert_allclose(
        distill.jsd_loss(packed(jsd_bt), packed(mask), cfg, denominator=den2p, segment_ids_bt=seg)[
            0
        ],
        distill.jsd_loss(jsd_bt[two], mask[two], cfg, denominator=den2)[0],
        rtol=1e-6,
    )


def test_bad_config_and_shapes_are_one_line_errors():
    for kw, key in [
        ({"beta": 1.5}, "distill.beta"),
        ({"temperature": 0.0}, "distill.temperature"),
        ({"top_k": 0}, "distill.top_k"),
        ({"signal": "kl"}, "distill.signal"),
        ({"kl_coef": -1.0}, "distill.kl_coef"),
        ({"top_k_tail": "no"}, "distill.top_k_tail"),
        ({"signal": "jsd", "top_k": 1, "top_k_tail": False}, "^distill.top_k=1 with .*exactly 0"),
        ({"signal": "jsd", "temperature": 2.0}, "^distill.temperature=2.0 with distill.top_k_t"),
        ({"signal": "jsd", "kl_coef": 0.0}, "^distill.kl_coef=0 under distill.signal='jsd'"),
    ]:
        with pytest.raises(ValueError, match=key) as e:
            distill.DistillConfig(**kw)
        assert "\n" not in str(e.value)
    distill.DistillConfig(signal="jsd", top_k=1)  # with the tail: two buckets, a real signal
    distill.DistillConfig(signal="jsd", temperature=2.0, top_k_tail=False)
    distill.DistillConfig(top_k=1, top_k_tail=False, kl_coef=0.0)  # reverse KL: top_k unused
    s = np.zeros((2, 3, 5), np.float32)
    with pytest.raises(ValueError, match="^temperature=2.0 with the tail bucket"):
        distill.generalized_jsd_topk(
            s, np.zeros((2, 3, 2), np.int32), np.zeros((2, 3, 2)), temperature=2.0
        )
    with pytest.raises(ValueError, match="^renormalised over K=1 token"):
        distill.generalized_jsd_topk(
            s, np.zeros((2, 3, 1), np.int32), np.zeros((2, 3, 1)), tail=False
        )
    with pytest.raises(AssertionError, match="teacher_logits"):
        distill.generalized_jsd(s, np.zeros((2, 3, 6), np.float32))
    with pytest.raises(AssertionError, match="teacher_topk_ids"):
        distill.generalized_jsd_topk(s, np.zeros((2, 3, 2), np.float32), np.zeros((2, 3, 2)))


class DistillVariantsTest(chex.TestCase):
    @chex.variants(with_jit=True, without_jit=True)
    def test_jit_and_eager_agree(self):
        lp, teacher, mask = _tokens(7)
        cfg = PLC(aggregation="token_mean", kl_coef=0.1)
        dcfg = distill.DistillConfig(kl_coef=1.0, reward_coef=0.2)
        rng = np.random.default_rng(7)
        s, t = (rng.normal(size=(4, 6, 11)).astype(np.float32) for _ in range(2))
        ids = np.argsort(-t, axis=-1)[..., :3].astype(np.int32)
        reward = np.linspace(-1, 1, 4).astype(np.float32)
        ref = (lp + 0.1).astype(np.float32)

        def fn(lp, teacher, mask, s, t, ids, reward, ref):
            den = aggregation.loss_denominator(mask, cfg)
            rkl = distill.reverse_kl_policy_loss(
                lp, teacher, mask, cfg, dcfg, denominator=den, reward_adv=reward, ref_logp_bt=ref
            )
            per_pos = distill.generalized_jsd(s, t, beta=0.5, temperature=1.3)
            t_logp = jax.nn.log_softmax(t, axis=-1)
            top = distill.generalized_jsd_topk(
                s, ids, jnp.take_along_axis(t_logp, ids, -1), beta=0.0
            )
            return rkl, distill.jsd_loss(per_pos, mask, cfg, denominator=den), top

        args = (lp, teacher, mask, s, t, ids, reward, ref)
        chex.assert_trees_all_close(self.variant(fn)(*args), fn(*args), rtol=1e-6, atol=1e-7)


@pytest.mark.slow  # ~12 s on a quiet machine, mostly compiling the update; 25 s loaded
def test_distill_record_trains_the_student_towards_the_teacher():
    # A tiny student and a different tiny teacher; the rollouts carry the teacher's log-probs
    # (the pass a LocalTeacher runs: engine.make_logprob_fn with the teacher's params), then the
    # record's prepare and update run jitted, in two microbatches.
    from flax import nnx

    from jaxrlvr import model as jmodel
    from jaxrlvr import rollout
    from jaxrlvr.algos import engine, optim

    cfg = jmodel.ModelConfig.tiny()
    graphdef, params = nnx.split(jmodel.init_model(cfg, seed=0), nnx.Param)
    noise = np.random.default_rng(1)  # the teacher: the student's weights, perturbed
    teacher_params = jax.tree.map(
        lambda x: x + noise.normal(scale=0.3, size=x.shape).astype(np.float32), params
    )
    logprobs = jax.jit(lambda p, b: engine.make_logprob_fn(graphdef)(p, b)[0])
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, cfg.vocab_size, size=3).tolist() for _ in range(4)]
    completions = [rng.integers(1, cfg.vocab_size, size=n).tolist() for n in (5, 2, 7, 4)]
    rollouts = rollout.to_batch(rollout.pack(prompts, completions, pad_id=0))
    teacher_logp = np.asarray(logprobs(teacher_params, rollouts))
    rollouts = rollouts.replace(teacher_logp=teacher_logp)
    mask = np.asarray(rollouts.loss_mask)
    with pytest.raises(ValueError, match="distill.signal='jsd' trains over the teacher's top-k"):
        distill.DistillUpdateConfig(distill=distill.DistillConfig(signal="jsd", top_k=None))
    with pytest.raises(ValueError, match="^loss.kl_coef does not apply to distill.signal='jsd'"):
        distill.DistillUpdateConfig(
            distill=distill.DistillConfig(signal="jsd", top_k=4), loss=PLC(kl_coef=0.1)
        )

    algo = distill.distill_algorithm(
        graphdef,
        optim.OptimizerConfig(learning_rate=1e-2),
        distill.DistillUpdateConfig(num_microbatches=2),
    )
    assert algo.rollout_spec.required == ("teacher_logp",)
    prepare, update = jax.jit(algo.prepare), jax.jit(algo.update)
    state = algo.init(params, 0)
    # The student as its own teacher: every advantage is 0, and so is the gradient.
    same = rollouts.replace(teacher_logp=np.asarray(logprobs(params, rollouts)))
    _, m0 = update(state, prepare(state, same)[0])
    assert float(m0["distill/reverse_kl"]) == pytest.approx(0.0, abs=1e-6)
    assert float(m0["grad_norm"]) == pytest.approx(0.0, abs=1e-6)

    def gap(p):  # the mean squared log-ratio on the batch's tokens
        diff = np.asarray(logprobs(p, rollouts)) - teacher_logp
        return np.sum(mask * diff**2) / mask.sum(), np.sum(mask * diff) / mask.sum()

    before, k1 = gap(params)
    _, metrics = update(state, prepare(state, rollouts)[0])
    assert float(metrics["distill/reverse_kl"]) == pytest.approx(k1, rel=1e-4, abs=1e-6)
    for _ in range(5):
        state, _ = update(state, prepare(state, rollouts)[0])
    # On fixed tokens -A * grad log p = grad (log p - log q)^2 / 2: the gap must shrink.
    assert gap(state.params)[0] < 0.5 * before


@pytest.mark.slow  # compiles the JSD update and the teacher's top-k pass
def test_jsd_record_matches_the_direct_loss_and_trains_towards_the_teacher_top_k():
    from flax import nnx

    from jaxrlvr import model as jmodel
    from jaxrlvr import rollout, teachers
    from jaxrlvr.algos import optim

    cfg = jmodel.ModelConfig.tiny()
    graphdef, params = nnx.split(jmodel.init_model(cfg, seed=0), nnx.Param)
    noise = np.random.default_rng(2)
    teacher = teachers.LocalTeacher(
        graphdef,
        jax.tree.map(
            lambda x: x + noise.normal(scale=0.3, size=x.shape).astype(np.float32), params
        ),
    )
    rng = np.random.default_rng(3)
    prompts = [rng.integers(1, cfg.vocab_size, size=4).tolist() for _ in range(4)]
    completions = [rng.integers(1, cfg.vocab_size, size=n).tolist() for n in (9, 3, 6, 11)]
    rollouts = rollout.to_batch(rollout.pack(prompts, completions, pad_id=0))
    k = 8
    ids, top_logp = (np.asarray(x) for x in teacher.topk(rollouts, k))
    rollouts = rollouts.replace(teacher_topk_ids=ids, teacher_topk_logp=top_logp)
    mask = np.asarray(rollouts.loss_mask)
    dcfg = distill.DistillConfig(signal="jsd", beta=0.5, top_k=k)  # the tail bucket (default)

    def direct(p):  # the unchunked per-position JSD from a plain forward, token mean
        logits = nnx.merge(graphdef, p)(rollouts.input_ids, rollouts.attention_mask)
        jsd = distill.generalized_jsd_topk(logits, ids, top_logp, beta=0.5)
        return float(np.sum(mask * np.asarray(jsd)) / mask.sum())

    algo = distill.distill_algorithm(
        graphdef,
        optim.OptimizerConfig(learning_rate=1e-2),
        distill.DistillUpdateConfig(distill=dcfg, num_microbatches=2, logprob_chunk_size=4),
    )
    assert algo.rollout_spec.required == ("teacher_topk_ids", "teacher_topk_logp")
    prepare, update = jax.jit(algo.prepare), jax.jit(algo.update)
    state = algo.init(params, 0)
    before = direct(params)
    for step in range(6):
        state, metrics = update(state, prepare(state, rollouts)[0])
        if step == 0:  # chunked, in two microbatches: the direct loss
            assert float(metrics["loss"]) == pytest.approx(before, rel=1e-5)
            assert float(metrics["distill/jsd"]) == pytest.approx(before, rel=1e-5)
    # With the tail the student's mass outside the teacher's top 8 (of 64) is in the loss too:
    # six steps took it 0.295 -> 0.191 (renormalised at temperature 1.2 they halved it).
    assert direct(state.params) < 0.75 * before


def test_teacher_top_k_batch_fields_are_validated_on_the_host():
    from jaxrlvr.algos import batch as batch_lib

    spec = batch_lib.BatchSpec(required=("teacher_topk_ids", "teacher_topk_logp"))
    ids = np.zeros((2, 3), np.int32)
    good = batch_lib.Batch(
        input_ids=ids,
        attention_mask=ids,
        labels=ids,
        loss_mask=ids,
        teacher_topk_ids=np.zeros((2, 3, 4), np.int32),
        teacher_topk_logp=np.zeros((2, 3, 4), np.float32),
    )
    assert batch_lib.validate_batch(good, spec) == (2, 3)
    bad_rank = good.replace(teacher_topk_ids=np.zeros((2, 3), np.int32))
    with pytest.raises(
        batch_lib.BatchError, match=r"teacher_topk_ids must have shape \(2, 3, 'K'\)"
    ):
        batch_lib.validate_batch(bad_rank, spec)
    bad_type = good.replace(teacher_topk_ids=np.zeros((2, 3, 4), np.float32))
    with pytest.raises(batch_lib.BatchError, match="teacher_topk_ids must be int32"):
        batch_lib.validate_batch(bad_type, spec)
