"""GRPO's old-log-prob pass: skipped only when it is provably the current policy's (one epoch on
rollouts that cannot be stale), and the skipped path updates exactly as the explicit one.

The off-policy correction (token truncation of old / sampler) must weight on both paths: the
sampler's own log-probs (``sampler_logp``) stay the denominator whether ``old_logp`` was
computed or not.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr.algos import algorithm, engine, grpo, loss_config
from jaxrlvr.algos import batch as batch_lib

B, T = 8, 12


@pytest.fixture(scope="module")
def setup():
    cfg = M.ModelConfig.tiny()
    graphdef, params = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, cfg.vocab_size, (B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    loss_mask[:, 4:] = 1.0
    # Sampler log-probs near the policy's (~ -log V) but off by up to +-1: some TIS weights
    # are truncated at the cap, some are below 1.
    logp, _ = engine.make_logprob_fn(graphdef)(
        params,
        batch_lib.Batch(
            input_ids=ids,
            attention_mask=np.ones((B, T), np.int32),
            labels=np.roll(ids, -1, axis=1),
            loss_mask=loss_mask,
        ),
    )
    sampler = np.asarray(logp) + rng.uniform(-1.0, 1.0, (B, T)).astype(np.float32)
    rollouts = batch_lib.Batch(
        input_ids=ids,
        attention_mask=np.ones((B, T), np.int32),
        labels=np.roll(ids, -1, axis=1),
        loss_mask=loss_mask,
        advantages=rng.normal(size=B).astype(np.float32),
        sampler_logp=sampler.astype(np.float32),
    )
    return graphdef, params, rollouts, np.asarray(logp)


_RECORDS = {}


def _grpo(graphdef, **kw):
    """The record of these settings, its prepare and update jitted once (shared by the tests)."""
    key = tuple(sorted(kw.items()))
    if key not in _RECORDS:
        loss = loss_config.PolicyLossConfig(
            correction=loss_config.CorrectionConfig(mode="truncate", high=1.5)
        )
        cfg = grpo.GRPOUpdateConfig(loss=loss)
        algo = grpo.grpo_algorithm(graphdef, optax.sgd(0.5), cfg, **kw)
        _RECORDS[key] = dataclasses.replace(
            algo, prepare=jax.jit(algo.prepare), update=jax.jit(algo.update)
        )
    return _RECORDS[key]


def _prepared(algo, params, rollouts):
    state = algo.init(jax.tree.map(jnp.copy, params), 0)
    batch, _ = algo.prepare(state, algorithm.select_fields(rollouts, algo.rollout_spec))
    return state, batch


@pytest.mark.parametrize(
    "kw, skipped",
    [
        (dict(), True),
        (dict(rollouts_may_be_stale=False), True),
        (dict(rollouts_may_be_stale=True), False),
        (dict(epochs_per_batch=2), False),
        (dict(epochs_per_batch=2, rollouts_may_be_stale=True), False),
    ],
)
def test_old_pass_runs_unless_one_epoch_and_fresh(setup, kw, skipped):
    graphdef, params, rollouts, logp = setup
    _, batch = _prepared(_grpo(graphdef, **kw), params, rollouts)
    if skipped:
        assert batch.old_logp is None
    else:
        # The explicit pass is the current policy's log-probs (the same function, 1e-6).
        np.testing.assert_allclose(np.asarray(batch.old_logp), logp, atol=1e-6)
    # Either way the sampler's log-probs reach the update untouched (the TIS denominator).
    np.testing.assert_array_equal(np.asarray(batch.sampler_logp), rollouts.sampler_logp)


def test_skipped_path_equals_explicit_old_logprobs(setup):
    """One epoch: the update without the old pass (its own log-probs behind a stop-gradient)
    equals the update fed the explicit old pass, parameters within 1e-6 (float32 rounding of
    the same computation; the ratio is exactly 1 on the skipped path), with TIS on."""
    graphdef, params, rollouts, logp = setup
    state_s, batch_s = _prepared(_grpo(graphdef), params, rollouts)
    state_e, batch_e = _prepared(_grpo(graphdef, rollouts_may_be_stale=True), params, rollouts)
    assert batch_s.old_logp is None and batch_e.old_logp is not None
    new_s, m_s = _grpo(graphdef).update(state_s, batch_s)
    new_e, m_e = _grpo(graphdef).update(state_e, batch_e)
    for a, b in zip(jax.tree.leaves(new_s.params), jax.tree.leaves(new_e.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=1e-6)
    assert float(m_s["ratio_max"]) == 1.0 and float(m_s["ratio_min"]) == 1.0
    # Truncated IS on both paths: weights min(exp(old - sampler), cap) from the SAMPLER's
    # log-probs, with old = the current policy's log-probs.
    mask = rollouts.loss_mask > 0
    w = np.minimum(np.exp(logp - rollouts.sampler_logp), 1.5)[mask]
    gap = np.abs(logp - rollouts.sampler_logp)[mask]
    assert (w < 1.0).any() and (w == 1.5).any()  # the case tests both sides of the cap
    for m in (m_s, m_e):
        assert float(m["offpolicy/weight"]) == pytest.approx(w.mean(), rel=1e-5)
        assert float(m["offpolicy/both/truncated"]) == pytest.approx((w == 1.5).mean(), rel=1e-5)
        assert float(m["logp_diff_abs"]) == pytest.approx(gap.mean(), rel=1e-5)


def test_tis_changes_the_update_on_the_skipped_path(setup):
    """The sampler's log-probs matter on the skipped path: other sampler log-probs (other TIS
    weights) give another update; equal ones (weights 1) give the plain GRPO update."""
    graphdef, params, rollouts, logp = setup
    algo = _grpo(graphdef)
    state, batch = _prepared(algo, params, rollouts)
    on_policy = rollouts.replace(sampler_logp=logp.astype(np.float32))
    state2, batch2 = _prepared(algo, params, on_policy)
    new, _ = algo.update(state, batch)
    new2, m2 = algo.update(state2, batch2)
    diff = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(new2.params))
    )
    assert diff > 1e-4
    assert float(m2["offpolicy/weight"]) == pytest.approx(1.0, abs=1e-5)
