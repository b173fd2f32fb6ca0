"""Tests of the update factories (``sft``, ``grpo``, ``ppo`` on the ``engine``) and their state,
batch and optimiser.

Everything runs a real tiny Qwen2 (jaxrlvr.model) in float32 on the CPU; no component is mocked.
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlvr import distributed
from jaxrlvr import model as M
from jaxrlvr.algos import (
    advantages,
    algorithm,
    engine,
    grpo,
    loss_config,
    losses,
    optim,
    ppo,
    sft,
    step,
    value,
)
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import state as state_lib
from jaxrlvr.model import logprobs as logprobs_lib

B, T = 8, 12


def _model(seed=0, **overrides):
    cfg = M.ModelConfig.tiny(**overrides)
    lm = M.init_model(cfg, seed=seed)
    graphdef, params = nnx.split(lm, nnx.Param)
    return cfg, graphdef, params


def _batch(seed=0, b=B, t=T, vocab=128, **fields):
    """Right-padded rows [prompt 3..4][response][pad] with response lengths 1..6."""
    rng = np.random.default_rng(seed)
    full = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
    prompt = rng.integers(3, 5, b)
    resp = rng.integers(1, 7, b)
    pos = np.arange(t)[None, :]
    attn = pos < (prompt + resp)[:, None]
    loss_mask = (pos >= prompt[:, None] - 1) & (pos < (prompt + resp - 1)[:, None])
    out = dict(
        input_ids=jnp.asarray(full[:, :-1]),
        attention_mask=jnp.asarray(attn.astype(np.int32)),
        labels=jnp.asarray(full[:, 1:]),
        loss_mask=jnp.asarray(loss_mask),
        advantages=jnp.asarray(rng.normal(size=b).astype(np.float32)),
    )
    out.update(fields)
    return batch_lib.Batch(**out)


def _tree_max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _tree_equal(a, b):
    return all(
        bool(jnp.array_equal(x, y, equal_nan=True))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _mesh1():
    return M.make_mesh(M.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])


def _compiled(upd, state, mesh, **kw):
    """The bare update as a record whose rollouts are its batch (``prepare`` passes them
    through), compiled as the driver compiles every record (``step.CompiledAlgorithm``)."""
    record = algorithm.Algorithm(
        name="update",
        init=None,
        prepare=lambda state, batch: (batch, {}),
        update=upd,
        rollout_spec=upd.batch_spec,
    )
    return step.CompiledAlgorithm(record, mesh, step.state_shardings(state, mesh), **kw)


def _old_logp(graphdef, params, batch, noise=0.3, seed=1):
    """Log-probs of a slightly different policy, so ratios differ from 1 and some tokens clip."""
    logp, _ = jax.jit(engine.make_logprob_fn(graphdef))(params, batch)
    rng = np.random.default_rng(seed)
    return logp + jnp.asarray(noise * rng.normal(size=logp.shape).astype(np.float32))


# ---------------------------------------------------------------------------------------------
# Purity, tracing, state invariants.


def test_update_is_pure_and_compiles_once():
    cfg, graphdef, params = _model()
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3))
    batch = _batch()
    batch = batch.replace(old_logp=_old_logp(graphdef, params, batch))
    upd = grpo.make_grpo_update(graphdef, tx, grpo.GRPOUpdateConfig(num_microbatches=2))
    state = state_lib.TrainState.create(graphdef, params, tx, rng=0)

    plain = jax.jit(upd)  # no donation: the same input state can be reused
    s1, m1 = plain(state, batch)
    s2, m2 = plain(state, batch)
    assert _tree_equal(s1, s2) and _tree_equal(m1, m2)  # bit-identical
    assert not _tree_equal(s1.params, state.params)  # and the step did change the params

    mesh = _mesh1()
    traced = chex.assert_max_traces(upd, n=1)
    traced.batch_spec = upd.batch_spec
    compiled = _compiled(traced, state, mesh)
    cur = step.shard_state(state, mesh)
    before = jax.tree.map(lambda x: (type(x), x.shape, x.dtype, x.sharding), cur)
    for _ in range(2):
        placed, _ = compiled.prepare(cur, batch)
        cur, _ = compiled.update(cur, placed)
    after = jax.tree.map(lambda x: (type(x), x.shape, x.dtype, x.sharding), cur)
    assert jax.tree.structure(cur) == jax.tree.structure(state)
    assert before == after
    assert int(cur.step) == 2
    chex.clear_trace_counter()


# ---------------------------------------------------------------------------------------------
# Gradient accumulation is exact.

# SGD instead of Adam: Adam's first step is lr * sign(g) per element, which would turn float
# rounding on near-zero gradients into lr-sized differences. With plain SGD the parameter change
# is lr * g, so params agree to lr * (float32 summation error of g ~ 1e-7).
_SGD = optax.sgd(0.5)
_AGGREGATIONS = [
    dict(aggregation="token_mean"),
    dict(aggregation="seq_mean_token_mean"),
    dict(aggregation="seq_mean_token_sum"),
    dict(aggregation="seq_mean_token_sum_norm", norm_constant=8.0),
]


@pytest.mark.parametrize("agg", _AGGREGATIONS, ids=lambda a: a["aggregation"])
def test_microbatches_equal_full_batch_grpo(agg):
    cfg, graphdef, params = _model()
    batch = _batch(seed=3)
    batch = batch.replace(old_logp=_old_logp(graphdef, params, batch))
    loss = loss_config.PolicyLossConfig(**agg)
    state = state_lib.TrainState.create(graphdef, params, _SGD)
    out = {}
    for n in (1, 4):
        upd = grpo.make_grpo_update(
            graphdef, _SGD, grpo.GRPOUpdateConfig(loss=loss, num_microbatches=n)
        )
        out[n] = jax.jit(upd)(state, batch)
    (s1, m1), (s4, m4) = out[1], out[4]
    assert float(m1["clip_frac"]) > 0  # the clipped branch is exercised
    assert _tree_max_diff(s1.params, s4.params) < 1e-6
    assert _tree_max_diff(s1.params, state.params) > 1e-3  # the update is not trivially zero
    np.testing.assert_allclose(float(m1["loss"]), float(m4["loss"]), rtol=1e-5)
    np.testing.assert_allclose(float(m1["grad_norm"]), float(m4["grad_norm"]), rtol=1e-5)


@pytest.mark.parametrize("norm", [None, 5.0])
def test_microbatches_equal_full_batch_sft(norm):
    cfg, graphdef, params = _model()
    batch = _batch(seed=4, advantages=None)
    state = state_lib.TrainState.create(graphdef, params, _SGD)
    res = [
        jax.jit(
            sft.make_sft_update(
                graphdef, _SGD, sft.SFTUpdateConfig(normalize_constant=norm, num_microbatches=n)
            )
        )(state, batch)
        for n in (1, 4)
    ]
    assert _tree_max_diff(res[0][0].params, res[1][0].params) < 1e-6
    np.testing.assert_allclose(float(res[0][1]["nll"]), float(res[1][1]["nll"]), rtol=1e-6)


def _ppo_batch(graphdef, params, seed=5, old_values=None):
    """A PPO batch: random 0/1 rewards, perturbed old log-probs, old values ~ N(0, 0.1^2)."""
    batch = _batch(seed=seed, advantages=None)
    rng = np.random.default_rng(seed)
    if old_values is None:
        old_values = jnp.asarray(0.1 * rng.normal(size=(B, T)).astype(np.float32))
    return batch.replace(
        old_logp=_old_logp(graphdef, params, batch),
        rewards=jnp.asarray(rng.integers(0, 2, B).astype(np.float32)),
        old_values=old_values,
    )


def _critic(trunk, cfg, graphdef, params, std=0.1):
    """(value_params, value_graphdef) for ``trunk``: a head, or a separate critic model."""
    if trunk == "separate":
        vgd, vp = value.init_value_model(graphdef, params, rng=0, std=std)
        return vp, vgd
    return value.init_value_head(cfg.hidden_size, 0, std=std), None


@pytest.mark.parametrize("trunk", ["shared", "separate"])
def test_microbatches_equal_full_batch_ppo(trunk):
    cfg, graphdef, params = _model()
    batch = _ppo_batch(graphdef, params)
    vp, vgd = _critic(trunk, cfg, graphdef, params)
    state = state_lib.TrainState.create(graphdef, params, _SGD, value_params=vp, value_tx=_SGD)
    res = [
        jax.jit(
            ppo.make_ppo_update(
                graphdef,
                _SGD,
                _SGD,
                ppo.PPOUpdateConfig(num_microbatches=n, trunk=trunk),
                value_graphdef=vgd,
            )
        )(state, batch)
        for n in (1, 4)
    ]
    assert _tree_max_diff(res[0][0].params, res[1][0].params) < 1e-6
    assert _tree_max_diff(res[0][0].value_params, res[1][0].value_params) < 1e-6
    assert _tree_max_diff(res[0][0].value_params, vp) > 1e-3  # the critic did move
    np.testing.assert_allclose(float(res[0][1]["vf_loss"]), float(res[1][1]["vf_loss"]), rtol=1e-5)
    for key in ("value_grad_norm", "vf_error_sq", "value_mean"):
        np.testing.assert_allclose(float(res[0][1][key]), float(res[1][1][key]), rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# PPO with a separate critic model (trunk="separate").


def test_ppo_separate_critic_and_policy_each_get_only_their_own_loss():
    """One compiled update, two batches.

    1. old_values = the row's reward on every loss token makes every GAE delta (gamma = 1) and
       so every advantage exactly 0: the policy loss has a zero gradient and, with no KL or
       entropy term, the policy must stay bit-identical under SGD while the critic learns.
    2. With live advantages, the critic's gradient is exactly vf_coef * grad of the clipped value
       loss, written out here from the critic's own forward pass.
    """
    cfg, graphdef, params = _model()
    vgd, vp = value.init_value_model(graphdef, params, rng=1, std=0.1)
    ppo_cfg = ppo.PPOUpdateConfig(trunk="separate", num_microbatches=2, vf_coef=0.3)
    unit_sgd = optax.sgd(1.0)  # new critic = old critic - gradient
    state = state_lib.TrainState.create(graphdef, params, _SGD, value_params=vp, value_tx=unit_sgd)
    upd = jax.jit(ppo.make_ppo_update(graphdef, _SGD, unit_sgd, ppo_cfg, value_graphdef=vgd))

    zero = _ppo_batch(graphdef, params, seed=13)
    zero = zero.replace(old_values=jnp.broadcast_to(zero.rewards[:, None], (B, T)))
    new, m = upd(state, zero)
    assert float(m["advantage_mean"]) == 0.0 and float(m["vf_loss"]) > 0
    assert _tree_equal(new.params, state.params)  # bit-identical policy
    assert _tree_max_diff(new.value_params["backbone"], vp["backbone"]) > 1e-4
    assert _tree_max_diff(new.value_params["head"], vp["head"]) > 1e-4

    live = _ppo_batch(graphdef, params, seed=14)
    new, m = upd(state, live)
    assert float(m["pg_loss"]) != 0.0 and float(m["vf_clip_frac"]) > 0  # both terms are live
    assert _tree_max_diff(new.params, state.params) > 1e-4
    _, returns = ppo.ppo_advantages(live, ppo_cfg)
    mask = live.loss_mask.astype(jnp.float32)

    def value_loss(vp):
        critic = nnx.merge(vgd, vp["backbone"])
        hidden, _ = critic.backbone(live.input_ids, live.attention_mask)
        v = hidden @ vp["head"]["kernel"] + vp["head"]["bias"]
        v_clip = live.old_values + jnp.clip(v - live.old_values, -0.2, 0.2)
        err = jnp.maximum(jnp.square(v - returns), jnp.square(v_clip - returns))
        return ppo_cfg.vf_coef * jnp.sum(0.5 * err * mask) / jnp.sum(mask)

    want = jax.jit(jax.grad(value_loss))(vp)
    got = jax.tree.map(lambda old, new: old - new, state.value_params, new.value_params)
    assert _tree_max_diff(got, want) < 1e-6
    assert _tree_max_diff(want, jax.tree.map(jnp.zeros_like, want)) > 1e-3  # nonzero gradient
    np.testing.assert_allclose(
        float(m["value_grad_norm"]), float(optax.global_norm(want)), rtol=1e-5
    )


def test_init_value_model_copies_the_policy_without_its_lm_head():
    cfg, graphdef, params = _model(tie_word_embeddings=False)
    vgd, vp = value.init_value_model(graphdef, params, rng=0, std=0.1)
    assert "lm_head" in params and "lm_head" not in vp["backbone"]
    assert set(vp) == {"backbone", "head"} and vp["head"]["kernel"].shape == (cfg.hidden_size,)
    # Fresh buffers: donating the policy's state must not free the critic's weights.
    pol = {jax.tree_util.keystr(k): x for k, x in jax.tree_util.tree_leaves_with_path(params)}
    for k, x in jax.tree_util.tree_leaves_with_path(vp["backbone"]):
        y = pol[jax.tree_util.keystr(k)]
        assert np.array_equal(x, y) and x.unsafe_buffer_pointer() != y.unsafe_buffer_pointer()
    # At the start the critic's values are the head on the policy's own hidden states.
    batch = _batch(seed=15)
    sep = jax.jit(value.make_value_fn(graphdef, value_graphdef=vgd))(params, vp, batch)
    head = jax.jit(value.make_value_fn(graphdef))(params, vp["head"], batch)
    np.testing.assert_allclose(sep, head, atol=1e-6)
    assert sep.shape == (B, T) and sep.dtype == jnp.float32


def test_ppo_separate_critic_compiles_once_and_keeps_shardings():
    """Two jitted steps on the 8-device (data=2, fsdp=2, tensor=2) mesh: one trace, and the
    critic's backbone (and its Adam moments) sharded exactly like the policy's."""
    assert len(jax.devices()) == 8
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    cfg = M.ModelConfig.tiny()
    graphdef, params = nnx.split(M.init_model(cfg, seed=0, mesh=mesh), nnx.Param)
    vgd, vp = value.init_value_model(graphdef, params, std=0.1)
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3))
    state = state_lib.TrainState.create(graphdef, params, tx, value_params=vp, value_tx=tx)
    ssh = step.state_shardings(state, mesh)

    def specs(tree):
        return [s.spec for s in jax.tree.leaves(tree)]

    assert specs(ssh.value_params["backbone"]) == specs(ssh.params)  # tied: same tree
    assert sum(not s.is_fully_replicated for s in jax.tree.leaves(ssh.value_params)) >= 10
    assert specs(ssh.value_opt_state[1][0].mu["backbone"]) == specs(ssh.opt_state[1][0].mu)

    upd = ppo.make_ppo_update(
        graphdef,
        tx,
        tx,
        ppo.PPOUpdateConfig(trunk="separate", num_microbatches=2),
        value_graphdef=vgd,
    )
    traced = chex.assert_max_traces(upd, n=1)
    traced.batch_spec = upd.batch_spec
    cur = step.shard_state(state, mesh)
    value_fn = jax.jit(value.make_value_fn(graphdef, value_graphdef=vgd))
    batch = _batch(seed=16, advantages=None)
    batch = batch.replace(
        old_logp=_old_logp(graphdef, params, batch),
        rewards=jnp.asarray(np.random.default_rng(16).integers(0, 2, B).astype(np.float32)),
        old_values=value_fn(cur.params, cur.value_params, batch),
    )
    compiled = _compiled(traced, state, mesh)
    before = jax.tree.map(lambda x: (type(x), x.shape, x.dtype, x.sharding), cur)
    for _ in range(2):
        placed, _ = compiled.prepare(cur, batch)
        cur, m = compiled.update(cur, placed)
        assert float(m["nonfinite"]) == 0 and float(m["vf_loss"]) > 0
    after = jax.tree.map(lambda x: (type(x), x.shape, x.dtype, x.sharding), cur)
    assert before == after
    assert int(cur.step) == 2
    chex.clear_trace_counter()


def test_split_and_merge_microbatches_roundtrip_strided():
    x = jnp.arange(12).reshape(6, 2)
    mbs = engine.split_microbatches(x, 3)
    assert mbs.shape == (3, 2, 2)
    np.testing.assert_array_equal(mbs[1], x[jnp.array([1, 4])])  # microbatch j: rows j, j + n
    np.testing.assert_array_equal(engine.merge_microbatches(mbs), x)


# ---------------------------------------------------------------------------------------------
# Log-prob function.


def test_logprob_fn_matches_course_function_and_microbatching():
    cfg, graphdef, params = _model()
    batch = _batch(seed=6)
    logp, ent = jax.jit(engine.make_logprob_fn(graphdef))(params, batch)
    logits = nnx.merge(graphdef, params)(batch.input_ids, batch.attention_mask)
    ref = losses.get_response_log_probs(logits, batch.labels, return_token_entropy=True)
    # Same float32 math on the same logits (only fusion order differs).
    np.testing.assert_allclose(logp, ref["log_probs"], atol=1e-5)
    np.testing.assert_allclose(ent, ref["token_entropy"], atol=1e-5)
    assert logp.dtype == jnp.float32 and ent.dtype == jnp.float32
    logp4, ent4 = jax.jit(engine.make_logprob_fn(graphdef, num_microbatches=4))(params, batch)
    np.testing.assert_allclose(logp4, logp, atol=1e-6)
    np.testing.assert_allclose(ent4, ent, atol=1e-6)


@pytest.mark.parametrize("entropy_grad", [False, True])
def test_fused_logprobs_and_entropy_values_and_gradients(entropy_grad):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(30.0 * rng.normal(size=(3, 5, 40)).astype(np.float32))
    logits = logits.at[0, 0, 7].set(-jnp.inf)  # a masked-out vocabulary entry
    labels = jnp.asarray(rng.integers(8, 40, (3, 5)).astype(np.int32))
    w = jnp.asarray(rng.normal(size=(2, 3, 5)).astype(np.float32))

    def fused(z):
        lp, ent = logprobs_lib.logprobs_and_entropy(z, labels, entropy_grad=entropy_grad)
        return jnp.sum(w[0] * lp + w[1] * ent), (lp, ent)

    def ref(z):
        out = losses.get_response_log_probs(z, labels, return_token_entropy=True)
        ent = out["token_entropy"] if entropy_grad else jax.lax.stop_gradient(out["token_entropy"])
        return jnp.sum(w[0] * out["log_probs"] + w[1] * ent), (out["log_probs"], ent)

    (_, (lp, ent)), g = jax.value_and_grad(fused, has_aux=True)(logits)
    (_, (lp_r, ent_r)), g_r = jax.value_and_grad(ref, has_aux=True)(logits)
    # float32, logits of size ~100: log-sum-exp terms agree to a few ulps of 100.
    np.testing.assert_allclose(lp, lp_r, atol=2e-5)
    np.testing.assert_allclose(ent, ent_r, atol=2e-5)
    assert np.all(np.isfinite(np.asarray(g)))
    # losses.compute_entropy's own gradient is NaN on the row holding a -inf logit (reported to
    # the loss-math helper); compare every other token there.
    g, g_r = np.asarray(g).copy(), np.asarray(g_r).copy()
    g[0, 0], g_r[0, 0] = 0.0, 0.0
    np.testing.assert_allclose(g, g_r, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Learning.


def test_sft_drives_nll_down():
    cfg, graphdef, params = _model()
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-2))
    batch = _batch(seed=7, advantages=None)
    upd = jax.jit(sft.make_sft_update(graphdef, tx, sft.SFTUpdateConfig()))
    state = state_lib.TrainState.create(graphdef, params, tx)
    nll = []
    for _ in range(30):
        state, m = upd(state, batch)
        nll.append(float(m["nll"]))
    # log(128) ~ 4.85 at random init; 30 Adam steps on one small batch memorise most of it.
    assert nll[0] > 4.0
    assert nll[-1] < 0.5 * nll[0]


_VOCAB, _TARGET, _G = 32, 5, 64
_PROMPT = np.array([1, 2, 3], np.int32)


def _bandit_batch(tokens):
    """Prompt [1, 2, 3] then one sampled token: the only loss position is the last prompt one."""
    g = tokens.shape[0]
    ids = jnp.broadcast_to(jnp.asarray(_PROMPT), (g, 3))
    labels = jnp.concatenate([ids[:, 1:], tokens[:, None].astype(jnp.int32)], axis=1)
    mask = jnp.broadcast_to(jnp.array([False, False, True]), (g, 3))
    return dict(
        input_ids=ids, attention_mask=jnp.ones((g, 3), jnp.int32), labels=labels, loss_mask=mask
    )


def _bandit_fns(graphdef):
    @jax.jit
    def sample(params, key):
        lm = nnx.merge(graphdef, params)
        logits = lm(jnp.asarray(_PROMPT)[None])[0, -1]
        tokens = jax.random.categorical(key, logits, shape=(_G,))
        return tokens, jax.nn.softmax(logits)[_TARGET]  # sampled tokens, expected reward

    return sample


@pytest.mark.slow  # 30-50 updates plus sampling: ~60 s on the shared 2 cores
def test_grpo_raises_bandit_reward():
    cfg, graphdef, params = _model(vocab_size=_VOCAB)
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=3e-3))
    upd = jax.jit(grpo.make_grpo_update(graphdef, tx, grpo.GRPOUpdateConfig()))
    sample = _bandit_fns(graphdef)
    state = state_lib.TrainState.create(graphdef, params, tx)
    key = jax.random.PRNGKey(0)
    adv_cfg = loss_config.AdvantageConfig()
    _, p0 = sample(state.params, key)
    for _ in range(50):
        key, sub = jax.random.split(key)
        tokens, _ = sample(state.params, sub)
        reward = (tokens == _TARGET).astype(jnp.float32)
        adv = advantages.group_advantages(reward, _G, adv_cfg)
        state, m = upd(state, batch_lib.Batch(**_bandit_batch(tokens), advantages=adv))
    _, p1 = sample(state.params, key)
    # Random init gives ~1/32 on every token; 50 GRPO steps must make the target likely.
    assert float(p0) < 0.1
    assert float(p1) > 0.5


@pytest.mark.slow  # 30-50 updates plus sampling: ~60 s on the shared 2 cores
@pytest.mark.parametrize("trunk", ["shared", "separate"])
def test_ppo_raises_bandit_reward(trunk):
    """The reward rises, and the critic (a head on the policy trunk, or a separate critic model)
    tracks it: its value loss falls from its peak and its value ends near the expected reward."""
    cfg, graphdef, params = _model(vocab_size=_VOCAB)
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=3e-3))
    vtx = optax.adam(1e-2)
    vp, vgd = _critic(trunk, cfg, graphdef, params, std=0.0)
    ppo_cfg = ppo.PPOUpdateConfig(lam=1.0, trunk=trunk)
    upd = jax.jit(ppo.make_ppo_update(graphdef, tx, vtx, ppo_cfg, value_graphdef=vgd))
    value_fn = jax.jit(value.make_value_fn(graphdef, value_graphdef=vgd))
    logprob_fn = jax.jit(engine.make_logprob_fn(graphdef))
    sample = _bandit_fns(graphdef)
    state = state_lib.TrainState.create(graphdef, params, tx, value_params=vp, value_tx=vtx)
    key = jax.random.PRNGKey(1)
    _, p0 = sample(state.params, key)
    vf = []
    for _ in range(50):
        key, sub = jax.random.split(key)
        tokens, _ = sample(state.params, sub)
        fields = _bandit_batch(tokens)
        probe = batch_lib.Batch(**fields)
        old_logp, _ = logprob_fn(state.params, probe)
        old_values = value_fn(state.params, state.value_params, probe)
        batch = batch_lib.Batch(
            **fields,
            rewards=(tokens == _TARGET).astype(jnp.float32),
            old_logp=old_logp,
            old_values=old_values,
        )
        state, m = upd(state, batch)
        vf.append(float(m["vf_loss"]))
    _, p1 = sample(state.params, key)
    assert float(p0) < 0.1
    assert float(p1) > 0.5
    # The value loss peaks while the reward is a coin flip, then falls once the critic has
    # caught up with a near-deterministic reward (~1e-3 against a peak ~0.1).
    assert np.mean(vf[-10:]) < 0.25 * max(vf)
    v1 = value_fn(state.params, state.value_params, probe)[0, 2]  # the one loss position
    assert abs(float(v1) - float(p1)) < 0.1


@pytest.mark.slow  # 30-50 updates plus sampling: ~60 s on the shared 2 cores
@pytest.mark.parametrize("trunk", ["shared", "separate"])
def test_ppo_value_loss_falls(trunk):
    """Rewards fixed per row; the critic (head + shared trunk, or a separate critic model) must
    learn to predict them."""
    cfg, graphdef, params = _model()
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3))
    vtx = optax.adam(3e-2)
    vp, vgd = _critic(trunk, cfg, graphdef, params, std=0.0)
    ppo_cfg = ppo.PPOUpdateConfig(vf_coef=1.0, trunk=trunk)
    upd = jax.jit(ppo.make_ppo_update(graphdef, tx, vtx, ppo_cfg, value_graphdef=vgd))
    value_fn = jax.jit(value.make_value_fn(graphdef, value_graphdef=vgd))
    logprob_fn = jax.jit(engine.make_logprob_fn(graphdef))
    state = state_lib.TrainState.create(graphdef, params, tx, value_params=vp, value_tx=vtx)
    base = _batch(seed=8, b=16, advantages=None)
    rewards = jnp.asarray(np.random.default_rng(0).integers(0, 2, 16).astype(np.float32))
    vf = []
    for _ in range(30):
        old_values = value_fn(state.params, state.value_params, base)
        old_logp, _ = logprob_fn(state.params, base)
        batch = base.replace(rewards=rewards, old_logp=old_logp, old_values=old_values)
        state, m = upd(state, batch)
        vf.append(float(m["vf_loss"]))
    # V = 0 at the start: vf_loss = mean 0.5 * returns^2 ~ 0.25; fitting 16 rows' rewards must
    # at least halve it (it falls far more in practice).
    assert vf[0] > 0.1
    assert np.mean(vf[-5:]) < 0.5 * vf[0]


# ---------------------------------------------------------------------------------------------
# Non-finite guard and batch validation.


def test_nan_batch_leaves_state_unchanged():
    cfg, graphdef, params = _model()
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3))
    upd = grpo.make_grpo_update(graphdef, tx, grpo.GRPOUpdateConfig(num_microbatches=2))
    state = state_lib.TrainState.create(graphdef, params, tx)
    good = _batch(seed=9)
    state, m = jax.jit(upd)(state, good)  # one real step, so the opt state is non-trivial
    assert float(m["nonfinite"]) == 0
    bad = good.replace(advantages=good.advantages.at[3].set(jnp.nan))
    new, m = jax.jit(upd)(state, bad)
    assert float(m["nonfinite"]) == 1
    assert _tree_equal(new, state)

    mesh = _mesh1()
    compiled = _compiled(upd, state, mesh, on_nonfinite="raise")
    cur = step.shard_state(state, mesh)
    placed, _ = compiled.prepare(cur, bad)
    with pytest.raises(step.NonFiniteUpdateError, match="non-finite"):
        compiled.update(cur, placed)


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda b: b.replace(input_ids=b.input_ids.astype(jnp.float32)), "input_ids must be int32"),
        (lambda b: b.replace(labels=b.labels[:, :-1]), r"labels must have shape \(8, 12\)"),
        (lambda b: b.replace(advantages=None), "advantages is required"),
        (lambda b: b.replace(advantages=b.advantages[:, None]), "advantages must have shape"),
        (
            lambda b: b.replace(old_logp=jnp.zeros((8, 12), jnp.bfloat16)),
            "old_logp must be float32",
        ),
        (lambda b: b.replace(rewards=jnp.zeros((8,))), "rewards is not used by this update"),
    ],
)
def test_bad_batch_rejected_before_compilation(change, match):
    cfg, graphdef, params = _model()
    tx = optim.make_optimizer(optim.OptimizerConfig())
    upd = grpo.make_grpo_update(graphdef, tx, grpo.GRPOUpdateConfig(num_microbatches=2))
    traces = []

    def counted(state, batch):
        traces.append(1)
        return upd(state, batch)

    counted.batch_spec = upd.batch_spec
    state = state_lib.TrainState.create(graphdef, params, tx)
    good = _batch()
    mesh = _mesh1()
    compiled = _compiled(counted, state, mesh)
    with pytest.raises(batch_lib.BatchError, match=match):
        compiled.prepare(step.shard_state(state, mesh), change(good))
    assert traces == []  # rejected on the host: nothing was traced or compiled


def test_batch_not_divisible_by_microbatches():
    spec = batch_lib.BatchSpec(required=("advantages",), num_microbatches=3)
    with pytest.raises(batch_lib.BatchError, match="not divisible by num_microbatches=3"):
        batch_lib.validate_batch(_batch(), spec)


# ---------------------------------------------------------------------------------------------
# Remat and mixed precision.


def test_remat_gives_the_same_update():
    batch = _batch(seed=10)
    res = []
    for remat in (False, True):
        cfg, graphdef, params = _model(remat=remat)
        state = state_lib.TrainState.create(graphdef, params, _SGD)
        res.append(jax.jit(grpo.make_grpo_update(graphdef, _SGD))(state, batch))
    # Recomputing the forward in the backward pass is the same float32 arithmetic; only XLA's
    # fusion choices may differ. SGD (see _SGD) keeps the comparison about the gradient.
    assert _tree_max_diff(res[0][0].params, res[1][0].params) < 1e-6
    assert _tree_max_diff(res[0][0].params, params) > 1e-3
    np.testing.assert_allclose(
        float(res[0][1]["grad_norm"]), float(res[1][1]["grad_norm"]), rtol=1e-5
    )


def test_bfloat16_compute_keeps_float32_master_weights():
    cfg, graphdef, params = _model(dtype="bfloat16", param_dtype="float32")
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3))
    state = state_lib.TrainState.create(graphdef, params, tx)
    new, m = jax.jit(grpo.make_grpo_update(graphdef, tx))(state, _batch(seed=11))
    assert float(m["nonfinite"]) == 0
    assert {x.dtype for x in jax.tree.leaves(new.params)} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(new.opt_state) if x.ndim > 0} == {jnp.dtype("float32")}
    assert not _tree_equal(new.params, state.params)


# ---------------------------------------------------------------------------------------------
# Optimiser, configs.


@pytest.mark.parametrize("scale", [0.01, 100.0])  # global norm below / above max_norm
def test_clip_by_global_norm_matches_optax(scale):
    """optim.clip_by_global_norm (one scalar factor, fused by XLA) gives optax's clipped
    gradient to float32 rounding (1e-6 relative) and optax's (empty) state, so checkpoints of
    the optimiser state keep their structure."""
    rng = np.random.default_rng(0)
    grads = {
        "a": jnp.asarray(scale * rng.normal(size=(5, 3)).astype(np.float32)),
        "b": jnp.asarray(scale * rng.normal(size=(7,)).astype(np.float32)),
    }
    ours, ref = optim.clip_by_global_norm(1.0), optax.clip_by_global_norm(1.0)
    s_ours, s_ref = ours.init(grads), ref.init(grads)
    assert jax.tree.structure(s_ours) == jax.tree.structure(s_ref)
    got, _ = jax.jit(ours.update)(grads, s_ours)
    want, _ = ref.update(grads, s_ref)
    for k in grads:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=1e-6, atol=0)
    if scale > 1:
        assert abs(float(optax.tree.norm(got)) - 1.0) < 1e-6


def test_schedules():
    const = optim.make_schedule(optim.OptimizerConfig(learning_rate=1.0, warmup_steps=4))
    np.testing.assert_allclose([float(const(s)) for s in (0, 2, 4, 100)], [0.0, 0.5, 1.0, 1.0])
    cos = optim.make_schedule(
        optim.OptimizerConfig(
            learning_rate=1.0,
            schedule="cosine",
            warmup_steps=2,
            total_steps=12,
            final_lr_ratio=0.1,
        )
    )
    # warmup to 1 at step 2, cosine to 0.1 at step 12; halfway (step 7) = 0.1 + 0.9 / 2.
    np.testing.assert_allclose(
        [float(cos(s)) for s in (0, 1, 2, 7, 12)], [0.0, 0.5, 1.0, 0.55, 0.1], atol=1e-6
    )


def test_learning_rate_metric_and_clipping():
    cfg, graphdef, params = _model()
    ocfg = optim.OptimizerConfig(learning_rate=1e-2, warmup_steps=2, max_grad_norm=1e-3)
    tx = optim.make_optimizer(ocfg)
    upd = jax.jit(grpo.make_grpo_update(graphdef, tx, lr_schedule=optim.make_schedule(ocfg)))
    state = state_lib.TrainState.create(graphdef, params, tx)
    lrs = []
    for _ in range(3):
        state, m = upd(state, _batch(seed=12))
        lrs.append(float(m["learning_rate"]))
        assert float(m["grad_norm"]) > 1e-3  # reported before clipping
    np.testing.assert_allclose(lrs, [0.0, 5e-3, 1e-2], rtol=1e-6)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: optim.OptimizerConfig(schedule="linear"), "schedule must be one of"),
        (lambda: optim.OptimizerConfig(schedule="cosine"), "total_steps"),
        (lambda: ppo.PPOUpdateConfig(trunk="tied"), "trunk must be one of"),
        (
            lambda: ppo.make_ppo_update(None, _SGD, _SGD, ppo.PPOUpdateConfig(trunk="separate")),
            "trunk='separate' needs value_graphdef",
        ),
        (
            lambda: ppo.make_ppo_update(None, _SGD, _SGD, value_graphdef=object()),
            "trunk='shared' takes no value_graphdef",
        ),
        (lambda: grpo.GRPOUpdateConfig(num_microbatches=0), "num_microbatches"),
        (lambda: step.CompiledAlgorithm(None, None, None, on_nonfinite="warn"), "on_nonfinite"),
        (lambda: distributed.DistributedConfig(enabled=True), "coordinator_address"),
        (
            lambda: distributed.DistributedConfig(
                enabled=True, coordinator_address="127.0.0.1:1", num_processes=2, process_id=2
            ),
            "process_id",
        ),
        (lambda: distributed.DistributedConfig(cpu_collectives="nccl"), "cpu_collectives"),
    ],
)
def test_config_validation(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_distributed_disabled_is_a_noop():
    assert distributed.initialize(distributed.DistributedConfig()) is False
    assert distributed.DistributedConfig(enabled=True, auto=True).auto  # env detection: no args
