"""Every update on both Qwen3 families: SFT (and expert iteration, whose update is SFT on the
graded rollouts), GRPO, GSPO, PPO and DPO on a tiny random Qwen3 and Qwen3-MoE.

Each case runs one real update with 2 microbatches (plain SGD, so the parameter change is lr x
gradient) and checks that the loss is finite, the update moved the parameters, and on the MoE the
router and the experts both received gradient; for GSPO and DPO the update with 1 microbatch too,
whose loss and parameters must agree (the MoE's dropless dispatch routes each token alone, so
splitting the batch changes nothing). 4.9 min for the ten cases on the loaded 2 cores.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import engine, grpo, loss_config, ppo, preference, sft, value
from jaxrlvr.algos import state as state_lib

B, T = 8, 12
_SGD = optax.sgd(0.5)
# Methods whose 2-microbatch update is also compared with the 1-microbatch one.
_EXACTNESS = ("gspo", "dpo")
_FAMILIES = {
    "qwen3": dict(model_type="qwen3", head_dim_override=32),
    "qwen3_moe": dict(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
    ),
}


@pytest.fixture(scope="module", params=list(_FAMILIES))
def family(request):
    cfg = M.ModelConfig.tiny(**_FAMILIES[request.param])
    graphdef, params = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    return cfg, graphdef, params


def _batch(seed, **fields):
    """Right-padded rows [prompt 3..4][response 1..6][pad]."""
    rng = np.random.default_rng(seed)
    full = rng.integers(0, 128, (B, T + 1)).astype(np.int32)
    prompt, resp = rng.integers(3, 5, B), rng.integers(1, 7, B)
    pos = np.arange(T)[None, :]
    out = dict(
        input_ids=jnp.asarray(full[:, :-1]),
        attention_mask=jnp.asarray((pos < (prompt + resp)[:, None]).astype(np.int32)),
        labels=jnp.asarray(full[:, 1:]),
        loss_mask=jnp.asarray((pos >= prompt[:, None] - 1) & (pos < (prompt + resp - 1)[:, None])),
    )
    out.update(fields)
    return batch_lib.Batch(**out)


def _old_logp(graphdef, params, batch):
    """A slightly different policy's log-probs, so that ratios differ from 1."""
    logp, _ = jax.jit(engine.make_logprob_fn(graphdef))(params, batch)
    noise = 0.3 * np.random.default_rng(1).normal(size=logp.shape).astype(np.float32)
    return logp + jnp.asarray(noise)


def _pairs(seed=0):
    """2 x 4 stacked preference rows (chosen, then rejected) sharing 4-token prompts."""
    p = B // 2
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 128, (B, T)).astype(np.int32)
    ids[p:, :4] = ids[:p, :4]
    mask, att = np.zeros((B, T), np.float32), np.ones((B, T), np.int32)
    for i in range(B):
        end = 6 + (i * 3) % (T - 6)
        mask[i, 3 : end - 1], att[i, end:], ids[i, end:] = 1.0, 0, 0
    return batch_lib.Batch(
        input_ids=ids, attention_mask=att, labels=np.roll(ids, -1, axis=1), loss_mask=mask
    )


def _run(method, cfg, graphdef, params, n):
    """(new params, metrics, loss key) of one `method` update with `n` microbatches."""
    if method == "dpo":
        algo = preference.preference_algorithm(
            graphdef,
            _SGD,
            preference.PreferenceUpdateConfig(
                loss=preference.PreferenceLossConfig(kind="dpo", beta=0.5), num_microbatches=n
            ),
        )
        state = algo.init(jax.tree.map(jnp.copy, params), 0)
        batch, _ = algo.prepare(state, _pairs())
        new, m = jax.jit(algo.update)(state, batch)
        return new.params, m, "loss"
    if method == "sft":
        upd = sft.make_sft_update(graphdef, _SGD, sft.SFTUpdateConfig(num_microbatches=n))
        state = state_lib.TrainState.create(graphdef, params, _SGD)
        new, m = jax.jit(upd)(state, _batch(4))
        return new.params, m, "nll"
    rng = np.random.default_rng(5)
    if method == "ppo":
        batch = _batch(5)
        batch = batch.replace(
            old_logp=_old_logp(graphdef, params, batch),
            rewards=jnp.asarray(rng.integers(0, 2, B).astype(np.float32)),
            old_values=jnp.asarray(0.1 * rng.normal(size=(B, T)).astype(np.float32)),
        )
        vp = value.init_value_head(cfg.hidden_size, 0, std=0.1)
        state = state_lib.TrainState.create(graphdef, params, _SGD, value_params=vp, value_tx=_SGD)
        upd = ppo.make_ppo_update(
            graphdef, _SGD, _SGD, ppo.PPOUpdateConfig(num_microbatches=n, trunk="shared")
        )
        new, m = jax.jit(upd)(state, batch)
        return new.params, m, "loss"
    level = "sequence" if method == "gspo" else "token"
    batch = _batch(3, advantages=jnp.asarray(rng.normal(size=B).astype(np.float32)))
    batch = batch.replace(old_logp=_old_logp(graphdef, params, batch))
    loss = loss_config.PolicyLossConfig(aggregation="seq_mean_token_mean", ratio_level=level)
    upd = grpo.make_grpo_update(
        graphdef, _SGD, grpo.GRPOUpdateConfig(loss=loss, num_microbatches=n)
    )
    new, m = jax.jit(upd)(state_lib.TrainState.create(graphdef, params, _SGD), batch)
    return new.params, m, "loss"


@pytest.mark.slow  # 12-50 s per case (one or two compiles) on the loaded 2 cores
@pytest.mark.parametrize("method", ["sft", "grpo", "gspo", "ppo", "dpo"])
def test_update_is_exact_under_microbatching_and_trains_every_part(family, method):
    cfg, graphdef, params = family
    p1, m1, key = _run(method, cfg, graphdef, params, 2)
    assert np.isfinite(float(m1[key]))
    if method in _EXACTNESS:  # one compile more per case: the policy-gradient and pair losses
        p2, m2, _ = _run(method, cfg, graphdef, params, 1)
        np.testing.assert_allclose(float(m1[key]), float(m2[key]), rtol=2e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2), strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-6)
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda a, b: a - b, p1, params))[0]
    moved = {jax.tree_util.keystr(k): float(jnp.max(jnp.abs(v))) for k, v in flat}
    assert max(moved.values()) > 1e-4
    assert max(v for k, v in moved.items() if "self_attn" in k) > 0.0
    if cfg.is_moe:
        parts = ("['gate']", "gate_proj", "up_proj", "down_proj")  # the router, the experts
        for part in parts:
            assert max(v for k, v in moved.items() if "mlp" in k and part in k) > 0.0, part


def test_grpo_update_on_a_mixed_dense_and_sparse_layout_trains_both_stacks():
    """A Qwen3-MoE whose layer 0 is dense (``mlp_only_layers=[0]``) and layers 1-2 sparse: one
    GRPO update with 2 microbatches is finite and moves the dense stack's MLP
    (``model.dense_layers``), the sparse stack's router and experts (``model.layers``) and both
    stacks' attention."""
    cfg = M.ModelConfig.tiny(**_FAMILIES["qwen3_moe"], num_hidden_layers=3, mlp_only_layers=(0,))
    graphdef, params = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    new, m, key = _run("grpo", cfg, graphdef, params, 2)
    assert np.isfinite(float(m[key]))
    flat = jax.tree_util.tree_flatten_with_path(jax.tree.map(lambda a, b: a - b, new, params))[0]
    moved = {jax.tree_util.keystr(k): float(jnp.max(jnp.abs(v))) for k, v in flat}

    def most(stack, part):
        return max(v for k, v in moved.items() if f"['{stack}']" in k and part in k)

    for part in ("gate_proj", "up_proj", "down_proj", "self_attn"):
        assert most("dense_layers", part) > 0.0, part
    for part in ("['gate']", "experts", "self_attn"):
        assert most("layers", part) > 0.0, part
