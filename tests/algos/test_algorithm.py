"""The Algorithm records: one optimiser for init and update, the PPO critic through the record,
prepare's device passes, and a bad rollout batch rejected once, on the host, before tracing."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlvr import compile_cache
from jaxrlvr import model as M
from jaxrlvr.algos import algorithm, engine, grpo, loss_config, optim, ppo, sft, step
from jaxrlvr.algos import batch as batch_lib

B, T = 8, 12


@pytest.fixture(scope="module")
def setup():
    cfg = M.ModelConfig.tiny()
    mesh = M.make_mesh(M.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    graphdef, params = nnx.split(M.init_model(cfg, seed=0, mesh=mesh), nnx.Param)
    return cfg, mesh, graphdef, params


def _rollouts(vocab: int, seed: int = 0) -> batch_lib.Batch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    loss_mask[:, 4:] = 1.0
    return batch_lib.Batch(
        input_ids=ids,
        attention_mask=np.ones((B, T), np.int32),
        labels=np.roll(ids, -1, axis=1),
        loss_mask=loss_mask,
        advantages=rng.normal(size=B).astype(np.float32),
        rewards=rng.normal(size=B).astype(np.float32),
        correct=np.asarray([1, 0, 1, 1, 0, 0, 1, 0], np.float32),
        sampler_logp=np.full((B, T), -3.0, np.float32),
    )


def _copy(params):
    # The compiled update donates the state; every test starts from its own buffers.
    return jax.tree.map(jnp.copy, params)


def _compiled(algo, params, mesh):
    shape = jax.eval_shape(lambda p: algo.init(p, 0), params)
    shardings = step.state_shardings(shape, mesh)
    state = jax.device_put(algo.init(_copy(params), 0), shardings)
    return state, step.CompiledAlgorithm(algo, mesh, shardings)


def test_init_and_update_share_one_optimizer(setup):
    """The record's update applies exactly the optimiser its init built: one SFT step equals a
    hand-written optax step of the same OptimizerConfig on the same gradient."""
    cfg, mesh, graphdef, params = setup
    opt_cfg = optim.OptimizerConfig(learning_rate=1e-2, weight_decay=0.1)
    algo = sft.sft_algorithm(graphdef, opt_cfg)
    state = algo.init(_copy(params), 0)
    tx = optim.make_optimizer(opt_cfg)
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(tx.init(params))
    rollouts = _rollouts(cfg.vocab_size)
    batch, _ = algo.prepare(state, algorithm.select_fields(rollouts, algo.rollout_spec))
    new, metrics = algo.update(state, batch)

    def loss(p):
        lm = nnx.merge(graphdef, p)
        logp, _, _ = engine.token_logprobs(lm, batch)
        return -jnp.sum(logp * batch.loss_mask) / jnp.sum(batch.loss_mask)

    grads = jax.grad(loss)(params)
    upd, _ = tx.update(grads, tx.init(params), params)
    expected = optax.apply_updates(params, upd)
    # Adam's first step is lr * g / (|g| + eps): where |g| is tiny, float summation order of the
    # two gradient computations moves the step by up to ~1e-3 of lr = 1e-2; 2e-5 allows that.
    for a, b in zip(jax.tree.leaves(new.params), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=2e-5)
    assert float(metrics["learning_rate"]) == pytest.approx(1e-2)


def test_a_ready_optax_transformation_is_accepted(setup):
    _, _, graphdef, params = setup
    tx = optax.sgd(0.1)
    algo = grpo.grpo_algorithm(graphdef, tx)
    state = algo.init(_copy(params), 0)
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(tx.init(params))
    with pytest.raises(TypeError, match="optimizer: expected an OptimizerConfig"):
        sft.sft_algorithm(graphdef, {"learning_rate": 1e-3})


@pytest.mark.parametrize("trunk", ["shared", "separate"])
def test_ppo_critic_through_the_record(setup, trunk):
    """init builds the critic (a zero head, or a copy of the policy's trunk plus a zero head);
    prepare computes the rollout-time values; update trains the critic with its own optimiser."""
    cfg, mesh, graphdef, params = setup
    shape = jax.eval_shape(lambda p: p, params)
    algo = ppo.ppo_algorithm(
        graphdef,
        optim.OptimizerConfig(learning_rate=1e-2),
        ppo.PPOUpdateConfig(trunk=trunk, vf_coef=1.0),
        params_shape=shape,
    )
    state = algo.init(_copy(params), 0)
    assert state.value_opt_state is not None
    if trunk == "separate":
        head = state.value_params["head"]
        embed = state.value_params["backbone"]["model"]["embed_tokens"]["embedding"]
        np.testing.assert_array_equal(
            embed.get_value(), params["model"]["embed_tokens"]["embedding"].get_value()
        )
    else:
        head = state.value_params
    np.testing.assert_array_equal(np.asarray(head["kernel"]), 0.0)
    rollouts = algorithm.select_fields(_rollouts(cfg.vocab_size), algo.rollout_spec)
    batch, _ = algo.prepare(state, rollouts)
    np.testing.assert_allclose(np.asarray(batch.old_values), 0.0)  # zero head: V = 0
    assert batch.advantages is None and batch.rewards is not None
    new, metrics = algo.update(state, batch)
    assert float(metrics["vf_loss"]) > 0
    new_head = new.value_params["head"] if trunk == "separate" else new.value_params
    assert np.abs(np.asarray(new_head["bias"])) > 0  # the critic learned
    with pytest.raises(ValueError, match="pass params_shape"):
        ppo.ppo_algorithm(graphdef, optax.sgd(0.1), ppo.PPOUpdateConfig(trunk="separate"))


def test_grpo_prepare_runs_old_and_reference_passes(setup):
    """Several epochs per batch: prepare adds old_logp and (KL) ref_logp; the update reports the
    sampler/trainer gap of the rollout-time log-probs."""
    cfg, mesh, graphdef, params = setup
    loss = loss_config.PolicyLossConfig(kl_coef=0.05)
    algo = grpo.grpo_algorithm(
        graphdef, optax.sgd(0.1), grpo.GRPOUpdateConfig(loss=loss), epochs_per_batch=2
    )
    state = algo.init(_copy(params), 0)
    assert state.ref_params is not None
    rollouts = algorithm.select_fields(_rollouts(cfg.vocab_size), algo.rollout_spec)
    assert rollouts.rewards is None and rollouts.correct is None
    batch, _ = algo.prepare(state, rollouts)
    expected, _ = engine.make_logprob_fn(graphdef)(params, rollouts)
    np.testing.assert_allclose(np.asarray(batch.old_logp), np.asarray(expected), atol=1e-6)
    np.testing.assert_allclose(np.asarray(batch.ref_logp), np.asarray(expected), atol=1e-6)
    _, metrics = algo.update(state, batch)
    m = rollouts.loss_mask > 0
    gap = np.abs(np.asarray(expected) - rollouts.sampler_logp)[m]
    assert float(metrics["logp_diff_abs"]) == pytest.approx(gap.mean(), 1e-5)
    assert float(metrics["logp_diff_abs_max"]) == pytest.approx(gap.max(), 1e-5)
    # Without a KL term there is no reference copy and no reference pass.
    plain = grpo.grpo_algorithm(graphdef, optax.sgd(0.1))
    assert plain.init(_copy(params), 0).ref_params is None


def test_grpo_one_epoch_skips_the_old_logprob_pass(setup):
    """One epoch on fresh rollouts: no old_logp pass; the update's ratio is exactly 1 and its
    result equals the one with an explicit old_logp (to float rounding)."""
    cfg, mesh, graphdef, params = setup
    one = grpo.grpo_algorithm(graphdef, optax.sgd(0.5))
    two = grpo.grpo_algorithm(graphdef, optax.sgd(0.5), epochs_per_batch=2)
    rollouts = algorithm.select_fields(_rollouts(cfg.vocab_size), one.rollout_spec)
    state = one.init(_copy(params), 0)
    batch_one, _ = one.prepare(state, rollouts)
    batch_two, _ = two.prepare(state, rollouts)
    assert batch_one.old_logp is None and batch_two.old_logp is not None
    new_one, m_one = one.update(state, batch_one)
    # The same one-epoch update on the batch that carries the explicit old_logp pass.
    new_two, m_two = one.update(state, batch_two)
    assert float(m_one["ratio_max"]) == 1.0 and float(m_one["ratio_min"]) == 1.0
    for a, b in zip(jax.tree.leaves(new_one.params), jax.tree.leaves(new_two.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert float(m_one["logp_diff_abs"]) == pytest.approx(float(m_two["logp_diff_abs"]), 1e-5)


@pytest.mark.parametrize("make", ["grpo", "ppo", "expert_iteration", "sft"])
def test_record_owns_its_epochs(setup, make):
    """A record made with epochs_per_batch=2 runs both epochs in one update call: the state and
    the last epoch's metrics equal the one-epoch record's update applied twice to the same
    prepared batch (what the driver looped before), to float rounding."""
    cfg, mesh, graphdef, params = setup
    factory = {
        "grpo": grpo.grpo_algorithm,
        "ppo": ppo.ppo_algorithm,
        "expert_iteration": sft.expert_iteration_algorithm,
        "sft": sft.sft_algorithm,
    }[make]
    once = factory(graphdef, optax.sgd(0.5))
    twice = factory(graphdef, optax.sgd(0.5), epochs_per_batch=2)
    rollouts = algorithm.select_fields(_rollouts(cfg.vocab_size), twice.rollout_spec)
    state = twice.init(_copy(params), 0)
    batch, _ = twice.prepare(state, rollouts)
    assert twice.batch_spec == once.batch_spec
    one_epoch = jax.jit(once.update)
    looped, m_looped = one_epoch(state, batch)
    looped, m_looped = one_epoch(looped, batch)
    new, m = jax.jit(twice.update)(state, batch)
    assert int(new.step) == 2 and int(looped.step) == 2
    for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(looped)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert m.keys() == m_looped.keys()
    for k in m:
        assert float(m[k]) == pytest.approx(float(m_looped[k]), rel=1e-5, abs=1e-6), k


def test_epochs_report_a_nonfinite_epoch(setup):
    """nonfinite is 1 when any epoch was skipped, so on_nonfinite="raise" still sees it."""
    cfg, mesh, graphdef, params = setup
    algo = grpo.grpo_algorithm(graphdef, optax.sgd(0.5), epochs_per_batch=3)
    rollouts = algorithm.select_fields(_rollouts(cfg.vocab_size), algo.rollout_spec)
    state = algo.init(_copy(params), 0)
    batch, _ = algo.prepare(state, rollouts)
    bad = batch.replace(advantages=jnp.asarray(batch.advantages).at[0].set(jnp.nan))
    new, m = algo.update(state, bad)
    assert float(m["nonfinite"]) == 1.0 and int(new.step) == 0
    with pytest.raises(ValueError, match="epochs_per_batch must be an integer >= 1"):
        grpo.grpo_algorithm(graphdef, optax.sgd(0.5), epochs_per_batch=0)


def test_expert_iteration_trains_only_on_accepted_rows(setup):
    cfg, mesh, graphdef, params = setup
    algo = sft.expert_iteration_algorithm(graphdef, optax.sgd(0.1))
    rollouts = _rollouts(cfg.vocab_size)
    state = algo.init(_copy(params), 0)
    batch, _ = algo.prepare(state, algorithm.select_fields(rollouts, algo.rollout_spec))
    assert batch.correct is None  # the update's batch holds only what it reads
    kept = rollouts.correct > 0
    np.testing.assert_array_equal(np.asarray(batch.loss_mask)[~kept], 0.0)
    np.testing.assert_array_equal(np.asarray(batch.loss_mask)[kept], rollouts.loss_mask[kept])
    _, metrics = algo.update(state, batch)
    assert float(metrics["token_count"]) == rollouts.loss_mask[kept].sum()


def test_bad_rollouts_rejected_once_before_tracing(setup):
    """A missing or mistyped field fails on the host with one BatchError naming it; neither
    prepare nor update is traced."""
    cfg, mesh, graphdef, params = setup
    algo = grpo.grpo_algorithm(graphdef, optax.sgd(0.1))
    traces = []

    def counting_prepare(state, rollouts):
        traces.append(1)
        return algo.prepare(state, rollouts)

    state, compiled = _compiled(dataclasses.replace(algo, prepare=counting_prepare), params, mesh)
    good = algorithm.select_fields(_rollouts(cfg.vocab_size), algo.rollout_spec)
    with pytest.raises(batch_lib.BatchError, match=r"batch\.advantages is required"):
        compiled.prepare(state, good.replace(advantages=None))
    with pytest.raises(batch_lib.BatchError, match=r"batch\.sampler_logp must be float32"):
        compiled.prepare(state, good.replace(sampler_logp=good.sampler_logp.astype(np.float64)))
    with pytest.raises(batch_lib.BatchError, match=r"batch\.rewards is not used by this update"):
        compiled.prepare(state, good.replace(rewards=np.zeros(B, np.float32)))
    assert traces == []
    batch, _ = compiled.prepare(state, good)
    assert traces == [1]


def test_compiled_equals_uncompiled_and_compiles_once(setup):
    """The jitted, donated, sharded step gives the un-jitted result, and a second step of the
    same shape reuses the compiled programs; the state's structure and shardings are stable."""
    cfg, mesh, graphdef, params = setup
    # SGD: the step is linear in the gradient, so a tight tolerance tests the compiled path
    # (Adam's first step g / (|g| + eps) would amplify summation-order noise where g ~ 0).
    algo = grpo.grpo_algorithm(graphdef, optax.sgd(0.5), grpo.GRPOUpdateConfig())
    rollouts = algorithm.select_fields(_rollouts(cfg.vocab_size), algo.rollout_spec)
    eager_state = algo.init(_copy(params), 0)
    eager_batch, _ = algo.prepare(eager_state, rollouts)
    eager_new, eager_m = algo.update(eager_state, eager_batch)

    state, compiled = _compiled(algo, params, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    batch, _ = compiled.prepare(state, rollouts)
    state, m = compiled.update(state, batch)
    for a, b in zip(jax.tree.leaves(state.params), jax.tree.leaves(eager_new.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    assert float(m["loss"]) == pytest.approx(float(eager_m["loss"]), rel=1e-5, abs=1e-6)
    # JAX's own compile events witness that the second step reuses the first one's programs:
    # no tracing, no lowering, no XLA compile and no persistent-cache load. (The jitted
    # functions' private ``_cache_size`` read 0 in one process where an earlier test module had
    # run on the same xdist worker: JAX's C++ dispatch cache is not a dependable witness.)
    counter = compile_cache.CompileCounter().start()
    try:
        batch, _ = compiled.prepare(state, rollouts)
        state, _ = compiled.update(state, batch)
        jax.block_until_ready(state)
    finally:
        counter.stop()
    assert (counter.compiles, counter.cache_hits) == (0, 0)
    assert counter.trace_s == 0.0 and counter.lower_s == 0.0
    assert jax.tree.map(lambda x: x.sharding, state) == shardings


def test_package_exports_the_records_factories_and_compiled_path():
    """``jaxrlvr.algos`` exports every record factory, ``Algorithm`` and ``CompiledAlgorithm``
    (and every name it lists exists); each factory makes an ``Algorithm``."""
    from jaxrlvr import algos

    assert all(hasattr(algos, name) for name in algos.__all__)
    factories = [
        "sft_algorithm",
        "expert_iteration_algorithm",
        "grpo_algorithm",
        "ppo_algorithm",
        "preference_algorithm",
    ]
    assert {"Algorithm", "CompiledAlgorithm", "per_instance_dpo_loss", *factories} <= set(
        algos.__all__
    )
    assert "jit_update" not in dir(algos) and not any("_update" in n for n in algos.__all__)
    graphdef, params = nnx.split(M.init_model(M.ModelConfig.tiny(), seed=0), nnx.Param)
    for name in factories:
        assert isinstance(getattr(algos, name)(graphdef, optax.sgd(0.1)), algos.Algorithm)
