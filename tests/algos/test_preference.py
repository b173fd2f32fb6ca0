"""Preference losses (DPO, cDPO, IPO, SimPO, ORPO) against NumPy, their known values and
gradients, the preference record's exact microbatching, bad shapes, and the CS336 per-instance DPO
loss against the same computation in transformers + torch."""

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings

from jaxrlvr import model as M
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import losses, preference

# ---------------------------------------------------------------------------------------------
# NumPy references, written from the papers' formulas.


def _np_logsig(x):
    return -np.logaddexp(0.0, -x)


def np_loss(kind, cw, cl, rw, rl, nw, nl, beta, eps=0.0, gamma=1.0):
    """Mean loss and mean reward margin of the four objectives (float64)."""
    if kind == "dpo":
        h = beta * ((cw - rw) - (cl - rl))
        return np.mean(-(1 - eps) * _np_logsig(h) - eps * _np_logsig(-h)), np.mean(h)
    if kind == "ipo":
        h = (cw - rw) - (cl - rl)
        return np.mean((h - 1 / (2 * beta)) ** 2), np.mean(beta * h)
    aw, al = cw / np.maximum(nw, 1), cl / np.maximum(nl, 1)
    if kind == "simpo":
        return np.mean(-_np_logsig(beta * aw - beta * al - gamma)), np.mean(beta * (aw - al))
    odds = lambda a: a - np.log1p(-np.exp(a))  # noqa: E731
    loss = -aw - beta * _np_logsig(odds(aw) - odds(al))
    return np.mean(loss), np.mean(beta * (aw - al))


def _call(kind, cw, cl, rw, rl, nw, nl, beta, eps=0.0, gamma=1.0, denominator=None):
    cfg = preference.PreferenceLossConfig(kind=kind, beta=beta, label_smoothing=eps, gamma=gamma)
    return preference.preference_loss(
        cw, cl, nw, nl, cfg, ref_chosen_logp_p=rw, ref_rejected_logp_p=rl, denominator=denominator
    )


KINDS = ("dpo", "ipo", "simpo", "orpo")


@settings(max_examples=25, deadline=None)
@given(
    kind=st.sampled_from(KINDS),
    p=st.integers(1, 6),
    seed=st.integers(0, 2**16),
    beta=st.floats(0.05, 2.5),
    eps=st.sampled_from([0.0, 0.1, 0.3]),
    gamma=st.floats(0.0, 1.5),
)
def test_losses_match_numpy(kind, p, seed, beta, eps, gamma):
    rng = np.random.default_rng(seed)
    nw, nl = rng.integers(1, 20, p).astype(np.float64), rng.integers(1, 20, p).astype(np.float64)
    # Summed log-probs: lengths x per-token values in (-4, -0.01).
    cw, cl = nw * rng.uniform(-4, -0.01, p), nl * rng.uniform(-4, -0.01, p)
    rw, rl = cw + rng.normal(size=p), cl + rng.normal(size=p)
    eps = eps if kind == "dpo" else 0.0
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    loss, m = _call(kind, *map(f32, (cw, cl, rw, rl, nw, nl)), beta, eps, gamma)
    want_loss, want_margin = np_loss(kind, cw, cl, rw, rl, nw, nl, beta, eps, gamma)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(m["reward_margin"], want_margin, rtol=2e-4, atol=2e-5)
    margin = m["chosen_reward"] - m["rejected_reward"]
    np.testing.assert_allclose(m["reward_margin"], margin, rtol=1e-5, atol=1e-5)
    assert 0.0 <= float(m["reward_accuracy"]) <= 1.0


def test_dpo_equal_policy_and_reference_is_log2_jit_and_not():
    x = jnp.asarray([-3.0, -10.0, -0.5], jnp.float32)
    y = jnp.asarray([-7.0, -1.0, -2.5], jnp.float32)
    fn = lambda a, b: preference.dpo_loss(a, b, a, b, beta=0.1, label_smoothing=0.2)  # noqa: E731
    for f in (fn, jax.jit(fn)):
        loss, m = f(x, y)
        np.testing.assert_allclose(loss, np.log(2.0), rtol=1e-6)
        assert float(m["reward_margin"]) == 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_swapping_chosen_and_rejected_flips_the_margin(kind):
    rng = np.random.default_rng(0)
    cw, cl, rw, rl = (jnp.asarray(rng.uniform(-9, -1, 5), jnp.float32) for _ in range(4))
    nw, nl = (jnp.asarray(rng.integers(1, 9, 5), jnp.float32) for _ in range(2))
    _, m = _call(kind, cw, cl, rw, rl, nw, nl, 0.5)
    _, s = _call(kind, cl, cw, rl, rw, nl, nw, 0.5)
    np.testing.assert_allclose(s["reward_margin"], -m["reward_margin"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(s["chosen_logp"], m["rejected_logp"], rtol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_gradient_raises_chosen_and_lowers_rejected(kind):
    cw, cl = jnp.asarray([-20.0, -8.0]), jnp.asarray([-15.0, -9.0])
    rw, rl = cw + 0.3, cl - 0.2
    n = jnp.asarray([10.0, 4.0])

    def loss(c, r):
        return _call(kind, c, r, rw, rl, n, n, 0.5)[0]

    gc, gr = jax.grad(loss, argnums=(0, 1))(cw, cl)
    # Gradient descent moves x by -grad: chosen log-prob up, rejected down.
    assert np.all(np.asarray(gc) < 0), gc
    assert np.all(np.asarray(gr) > 0), gr


@pytest.mark.parametrize(
    "args, name",
    [
        ((jnp.zeros((3, 2)), jnp.zeros(3), jnp.zeros(3), jnp.zeros(3)), "chosen_logp_p"),
        ((jnp.zeros(3), jnp.zeros(4), jnp.zeros(3), jnp.zeros(3)), "rejected_logp_p"),
        ((jnp.zeros(3), jnp.zeros(3), jnp.zeros(2), jnp.zeros(3)), "ref_chosen_logp_p"),
    ],
)
def test_bad_shapes_name_the_argument(args, name):
    with pytest.raises(AssertionError, match=f"argument `{name}`"):
        preference.dpo_loss(*args, beta=0.1)


def test_bad_shapes_name_the_length_argument():
    z = jnp.zeros(3)
    with pytest.raises(AssertionError, match="argument `rejected_len_p`"):
        preference.simpo_loss(z, z, z, jnp.zeros(5), beta=2.0, gamma=1.0)
    with pytest.raises(AssertionError, match="argument `mask_bt`"):
        preference.sequence_logps(jnp.zeros((2, 4)), jnp.zeros((2, 3)))


def test_config_is_validated():
    with pytest.raises(ValueError, match="kind must be one of"):
        preference.PreferenceLossConfig(kind="kto")
    with pytest.raises(ValueError, match="label_smoothing applies to kind='dpo'"):
        preference.PreferenceLossConfig(kind="ipo", label_smoothing=0.1)


@pytest.mark.parametrize("kind", ["dpo", "ipo", "simpo"])
def test_nll_weight_adds_the_chosen_mean_nll_rpo(kind):
    """RPO: loss + alpha * mean over pairs of -log pi(y_w) / |y_w| (NumPy), exact over a
    split into two denominators, and the chosen log-prob's gradient grows by alpha / |y_w| / P
    while the rejected one's is unchanged."""
    rng = np.random.default_rng(1)
    cw, cl = rng.uniform(-30, -1, 6), rng.uniform(-30, -1, 6)
    rw, rl = cw + rng.normal(size=6), cl + rng.normal(size=6)
    nw, nl = rng.integers(1, 12, 6).astype(float), rng.integers(1, 12, 6).astype(float)
    f32 = [jnp.asarray(x, jnp.float32) for x in (cw, cl, nw, nl, rw, rl)]

    def call(alpha, sl=slice(None), denominator=None):
        cfg = preference.PreferenceLossConfig(kind=kind, beta=0.5, nll_weight=alpha)
        c, r, a, b, x, y = (v[sl] for v in f32)
        return preference.preference_loss(
            c, r, a, b, cfg, ref_chosen_logp_p=x, ref_rejected_logp_p=y, denominator=denominator
        )

    plain, _ = call(0.0)
    loss, m = call(2.0)
    want = np_loss(kind, cw, cl, rw, rl, nw, nl, 0.5)[0] + 2.0 * np.mean(-cw / nw)
    np.testing.assert_allclose(loss, want, rtol=1e-5)
    np.testing.assert_allclose(m["loss"], want, rtol=1e-5)
    np.testing.assert_allclose(m["nll"], np.mean(-cw / nw), rtol=1e-5)
    halves = call(2.0, slice(0, 3), 6.0)[0] + call(2.0, slice(3, 6), 6.0)[0]
    np.testing.assert_allclose(halves, loss, rtol=1e-5)

    def grads(alpha):
        cfg = preference.PreferenceLossConfig(kind=kind, beta=0.5, nll_weight=alpha)
        fn = lambda c, r: preference.preference_loss(  # noqa: E731
            c, r, f32[2], f32[3], cfg, ref_chosen_logp_p=f32[4], ref_rejected_logp_p=f32[5]
        )[0]
        return jax.grad(fn, argnums=(0, 1))(f32[0], f32[1])

    (g0c, g0r), (g2c, g2r) = grads(0.0), grads(2.0)
    np.testing.assert_allclose(g2c - g0c, -2.0 / nw / 6, rtol=1e-5)
    np.testing.assert_allclose(g2r, g0r, rtol=1e-6)


def test_nll_weight_is_validated():
    with pytest.raises(ValueError, match="nll_weight must be >= 0"):
        preference.PreferenceLossConfig(kind="dpo", nll_weight=-1.0)
    with pytest.raises(ValueError, match="kind='orpo' has its own NLL"):
        preference.PreferenceLossConfig(kind="orpo", nll_weight=1.0)


def test_orpo_is_finite_at_probability_one():
    z = jnp.zeros(2)
    loss, _ = preference.orpo_loss(z, jnp.asarray([-3.0, -1.0]), z + 2, z + 2, beta=0.1)
    assert np.isfinite(float(loss))


# ---------------------------------------------------------------------------------------------
# The record: exact microbatching, prepare's reference pass, a bad batch.

P, T = 4, 10


@pytest.fixture(scope="module")
def setup():
    cfg = M.ModelConfig.tiny()
    graphdef, params = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    return cfg, graphdef, params


def _pairs(vocab, seed=0):
    """2P stacked rows: chosen (rows 0..P-1) and rejected (P..2P-1) share a prompt of 4 tokens,
    responses of different lengths, right-padded."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (2 * P, T)).astype(np.int32)
    ids[P:, :4] = ids[:P, :4]
    mask = np.zeros((2 * P, T), np.float32)
    att = np.ones((2 * P, T), np.int32)
    for i in range(2 * P):
        end = 6 + (i * 3) % (T - 6)
        mask[i, 3 : end - 1] = 1.0  # label t is token t + 1: the response starts at label 3
        att[i, end:] = 0
        ids[i, end:] = 0
    return batch_lib.Batch(
        input_ids=ids,
        attention_mask=att,
        labels=np.roll(ids, -1, axis=1),
        loss_mask=mask,
    )


def _copy(params):
    return jax.tree.map(jnp.copy, params)


@pytest.mark.slow  # 45-90 s on the loaded 2-core CI machine
@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_microbatching_is_exact(setup, kind):
    cfg, graphdef, params = setup
    tx = optax.sgd(1e-2)
    loss_cfg = preference.PreferenceLossConfig(kind=kind, beta=0.5)
    out = []
    for n in (1, 2):
        algo = preference.preference_algorithm(
            graphdef, tx, preference.PreferenceUpdateConfig(loss=loss_cfg, num_microbatches=n)
        )
        assert algo.name == kind
        state = algo.init(_copy(params), 0)
        assert (state.ref_params is None) == (kind == "orpo")
        batch, _ = algo.prepare(state, _pairs(cfg.vocab_size))
        new, m = jax.jit(algo.update)(state, batch)
        out.append((new.params, m))
    (p1, m1), (p2, m2) = out
    for k in ("loss", "reward_margin", "reward_accuracy", "chosen_logp", "token_count"):
        np.testing.assert_allclose(m1[k], m2[k], rtol=2e-5, atol=1e-6, err_msg=k)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)


@pytest.mark.slow  # 45-90 s on the loaded 2-core CI machine
def test_dpo_record_first_step_is_log2_then_the_margin_grows(setup):
    """At step 0 the policy is its own reference: loss log 2, margin 0; the update's gradient
    step raises the chosen log-probs relative to the rejected ones."""
    cfg, graphdef, params = setup
    loss_cfg = preference.PreferenceLossConfig(kind="dpo", beta=0.5)
    algo = preference.preference_algorithm(
        graphdef, optax.sgd(0.5), preference.PreferenceUpdateConfig(loss=loss_cfg)
    )
    state = algo.init(_copy(params), 0)
    batch, _ = algo.prepare(state, _pairs(cfg.vocab_size))
    assert batch.ref_logp.shape == (2 * P, T)
    update = jax.jit(algo.update)
    new, m = update(state, batch)
    np.testing.assert_allclose(m["loss"], np.log(2.0), rtol=1e-5)
    np.testing.assert_allclose(m["reward_margin"], 0.0, atol=1e-6)
    _, m_after = update(new, batch)
    assert float(m_after["reward_margin"]) > 0.0
    assert float(m_after["loss"]) < np.log(2.0)


def test_bad_pair_batches_are_refused(setup):
    cfg, graphdef, params = setup
    algo = preference.preference_algorithm(graphdef, optax.sgd(0.1))
    state = algo.init(_copy(params), 0)
    batch, _ = algo.prepare(state, _pairs(cfg.vocab_size))
    # 3 pairs (6 rows) in 2 microbatches: B divides, the pairs do not.
    chosen, rejected = preference.split_pairs(batch)
    three = preference.stack_pairs(*(jax.tree.map(lambda x: x[:3], h) for h in (chosen, rejected)))
    two = preference.preference_algorithm(
        graphdef, optax.sgd(0.1), preference.PreferenceUpdateConfig(num_microbatches=2)
    )
    with pytest.raises(batch_lib.BatchError, match="3 pairs"):
        two.update(state, three)
    odd = jax.tree.map(lambda x: x[:-1], batch)
    with pytest.raises(batch_lib.BatchError, match="odd"):
        algo.update(state, odd)
    packed = batch.replace(segment_ids=batch.labels * 0 + 1, positions=batch.labels * 0)
    with pytest.raises(batch_lib.BatchError, match="unpacked"):
        algo.update(state, packed)
    with pytest.raises(batch_lib.BatchError, match="ref_logp"):
        algo.update(state, batch.replace(ref_logp=None))


# ---------------------------------------------------------------------------------------------
# CS336 per-instance DPO loss vs transformers + torch.


def _model_helpers():
    """tests/model/helpers.py (tiny random HF Qwen2 checkpoints), imported by path: ``tests`` is
    not a package."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[1] / "model" / "helpers.py"
    spec = importlib.util.spec_from_file_location("_model_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 45-90 s on the loaded 2-core CI machine
def test_per_instance_dpo_loss_matches_torch(tmp_path):
    import torch

    from jaxrlvr.data import tokenizer as tokenizer_lib

    helpers = _model_helpers()

    tok = tokenizer_lib.build_char_tokenizer()
    hf = helpers.write_checkpoint(tmp_path / "pol", tie=False, seed=0, vocab_size=len(tok))
    hf_ref = helpers.write_checkpoint(tmp_path / "ref", tie=False, seed=3, vocab_size=len(tok))
    lm, ref = M.load_hf(hf.path), M.load_hf(hf_ref.path)
    prompt, chosen, rejected = "2+3?", "5", "It is 6."
    beta = 0.3
    got = losses.per_instance_dpo_loss(lm, ref, tok, beta, prompt, chosen, rejected)

    # The same computation, written directly with transformers + torch.
    template = (
        "Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n{response}"
    )
    prefix_len = len(tok.encode(template.split("{response}")[0].format(instruction=prompt)))

    def logp(model, response):
        text = template.format(instruction=prompt, response=response)
        ids = torch.tensor([tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]])
        with torch.no_grad():
            logits = model(ids).logits.float()
        lp = torch.log_softmax(logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
        return lp[prefix_len - 1 :].sum()

    pol, rf = hf.torch_model, hf_ref.torch_model
    h = (logp(pol, chosen) - logp(rf, chosen)) - (logp(pol, rejected) - logp(rf, rejected))
    want = -torch.nn.functional.logsigmoid(beta * h)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, atol=1e-5)
    # Equal models: log 2.
    same = losses.per_instance_dpo_loss(lm, lm, tok, beta, prompt, chosen, rejected)
    np.testing.assert_allclose(float(same), np.log(2.0), rtol=1e-6)
