"""In-place gradient accumulation (``model.grad_sink``): inside a sink, the gradient JAX returns
for a claimed leaf is ``acc + grad`` and for every other leaf the plain ``grad``; the microbatched
update built on it equals the plain sum of per-microbatch gradients; and the compiled update
holds one float32 gradient (the accumulator), not two."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import engine, grpo
from jaxrlvr.algos import state as state_lib
from jaxrlvr.model import grad_sink

B, T = 4, 12
CHUNK = 4


def _model(seed=0, **overrides):
    cfg = M.ModelConfig.tiny(remat=True, scan_layers=True, **overrides)
    graphdef, params = nnx.split(M.init_model(cfg, seed=seed), nnx.Param)
    return graphdef, params


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128, (B, T + 1)).astype(np.int32)
    mask = np.zeros((B, T), np.float32)
    mask[:, 5:9] = 1.0  # chunks of 4: [0, 4) is masked out in every row (skipped), [4, 8) not
    mask[1, 9:] = 1.0
    return batch_lib.Batch(
        input_ids=jnp.asarray(ids[:, :-1]),
        attention_mask=jnp.ones((B, T), jnp.int32),
        labels=jnp.asarray(ids[:, 1:]),
        loss_mask=jnp.asarray(mask),
        advantages=jnp.asarray(rng.normal(size=B).astype(np.float32)),
    )


def _loss(graphdef, chunk_size=CHUNK, calls=1):
    def loss(params, batch):
        lm = nnx.merge(graphdef, params)
        total = 0.0
        for k in range(calls):  # calls > 1: the same stack and head run twice in one loss
            logp, ent, _ = engine.token_logprobs(
                lm, batch, entropy_grad=True, chunk_size=chunk_size
            )
            w = batch.loss_mask * (1.0 + k)
            total = total + jnp.sum(logp * w * batch.advantages[:, None]) + 0.1 * jnp.sum(ent * w)
        return total, {"loss": total}

    return loss


def _random_like(tree, seed):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        treedef, [jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    )


def _close(a, b, tol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=tol, rtol=tol)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("calls", [1, 2])
def test_claimed_leaves_come_back_accumulated(tied, calls):
    """With a random accumulator offered for every leaf, the layers and the head weight are
    claimed and their gradient is acc + grad; the rest is the plain grad. A stack used twice
    is claimed once, so the total is still acc + g1 + g2."""
    graphdef, params = _model(tie_word_embeddings=tied)
    batch = _batch()
    loss = _loss(graphdef, calls=calls)
    plain, _ = jax.jit(jax.grad(loss, has_aux=True))(params, batch)
    acc = _random_like(params, seed=1)

    @jax.jit
    def sunk(params, acc):
        claimed = set()

        def f(p):
            with grad_sink.sink(p, acc) as c:
                out = loss(p, batch)
            claimed.update(c)
            return out

        g, _ = jax.grad(f, has_aux=True)(params)
        sunk.claimed = claimed
        return g

    got = sunk(params, acc)
    claimed = sunk.claimed
    head = "['model']['embed_tokens']['embedding']" if tied else "['lm_head']['kernel']"
    assert any(p.startswith(head) for p in claimed)
    assert any("['layers']" in p for p in claimed)
    assert not any("norm" in p and "layers" not in p for p in claimed)  # final norm: plain
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    want = [
        a + g if path in claimed else g
        for path, a, g in zip(paths, jax.tree.leaves(acc), jax.tree.leaves(plain), strict=True)
    ]
    _close(jax.tree.leaves(got), want, tol=2e-6)


def test_no_sink_no_claim():
    graphdef, params = _model()
    assert grad_sink.claim(params) is None
    with grad_sink.sink(params, params):
        assert grad_sink.claim(params) is not None
        assert grad_sink.claim(params) is None  # once per trace
    assert grad_sink.claim(params) is None
    with pytest.raises(ValueError, match="accumulators for"):
        with grad_sink.sink(params, jax.tree.leaves(params)[:2]):
            pass


def test_accumulated_microbatches_equal_the_plain_sum():
    """engine.accumulate_gradients (sink open) over 3 microbatches equals the sum of the plain
    per-microbatch gradients (no sink), for the scanned layers, the chunked tied head and the
    rest. 1e-6: the same float32 products; only the order of the adds may differ."""
    graphdef, params = _model()
    mbs = [_batch(seed=s) for s in range(3)]
    loss = _loss(graphdef)
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *mbs)
    got, metrics = jax.jit(lambda p, m: engine.accumulate_gradients(loss, p, m))(params, stacked)
    grad = jax.jit(jax.grad(loss, has_aux=True))
    parts = [grad(params, mb) for mb in mbs]
    want = jax.tree.map(lambda *g: sum(g[1:], g[0]), *[g for g, _ in parts])
    _close(got, want)
    np.testing.assert_allclose(
        float(metrics["loss"]), sum(float(m["loss"]) for _, m in parts), rtol=1e-6
    )


def _temp_bytes() -> tuple[int, int]:
    cfg = M.ModelConfig.tiny(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        remat=True,
        scan_layers=True,
    )
    graphdef, params = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    tx = optax.sgd(1e-3)
    upd = grpo.make_grpo_update(
        graphdef, tx, grpo.GRPOUpdateConfig(num_microbatches=2, logprob_chunk_size=8)
    )
    state = state_lib.TrainState.create(graphdef, params, tx)
    batch = jax.tree.map(lambda x: jnp.concatenate([x, x]), _batch())
    m = jax.jit(upd, donate_argnums=0).lower(state, batch).compile().memory_analysis()
    param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    return m.temp_size_in_bytes, param_bytes


def test_the_compiled_update_holds_one_gradient(monkeypatch):
    """XLA's memory analysis of a GRPO update (2 microbatches, weights dominate the memory):
    with the sink the temporaries stay below 1.5x the parameters (the accumulator plus
    activations); with nothing ever claimed (the plain path) each microbatch's whole gradient
    exists beside the accumulator: >= 1.9x."""
    fused, param_bytes = _temp_bytes()
    monkeypatch.setattr(grad_sink, "claim", lambda tree: None)
    plain, _ = _temp_bytes()
    assert fused < 1.5 * param_bytes, (fused, param_bytes)
    assert plain > 1.9 * param_bytes, (plain, param_bytes)


def _moe_model(seed=0):
    cfg = M.ModelConfig.tiny(
        model_type="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=True,
        router_aux_loss=True,
        remat=True,
        scan_layers=True,
    )
    graphdef, params = nnx.split(M.init_model(cfg, seed=seed), nnx.Param)
    return cfg, graphdef, params


def _moe_microbatches(cfg, count=2):
    """``count`` microbatches with forced routes: half the tokens replay a random expert pair
    (distinct ids), the rest route live (-1)."""
    rng = np.random.default_rng(7)
    mbs = []
    for s in range(count):
        ids = np.stack(
            [
                rng.permutation(cfg.num_experts)[: cfg.num_experts_per_tok]
                for _ in range(B * T * cfg.num_hidden_layers)
            ]
        ).reshape(B, T, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        ids[rng.random((B, T)) < 0.5] = -1
        mbs.append(dataclasses.replace(_batch(seed=s), routes=jnp.asarray(ids, jnp.int32)))
    return jax.tree.map(lambda *x: jnp.stack(x), *mbs)


def test_moe_update_accumulates_in_place_with_routes_and_router_terms(monkeypatch):
    """A MoE stack (scanned, rematerialised) takes the in-place path too: forced routes are
    scanned beside the layers and the router statistics come back per layer, so the
    aux-loss gradient and the router metrics equal the plain path's (claim disabled), over 2
    microbatches with half the tokens replayed. 2e-6: the same float32 products, added in
    another order; the expert ids (hence the metrics' counts) must match exactly."""
    cfg, graphdef, params = _moe_model()
    mbs = _moe_microbatches(cfg)
    loss = _loss(graphdef)

    def run():
        claimed = []
        real = grad_sink.claim

        def spy(tree):
            out = real(tree)
            claimed.append(out is not None)
            return out

        monkeypatch.setattr(grad_sink, "claim", spy)
        got = jax.jit(lambda p, m: engine.accumulate_gradients(loss, p, m))(params, mbs)
        return got, any(claimed)

    (fused, fused_metrics), fused_claimed = run()
    monkeypatch.setattr(grad_sink, "claim", lambda tree: None)
    plain, plain_metrics = jax.jit(lambda p, m: engine.accumulate_gradients(loss, p, m))(
        params, mbs
    )
    assert fused_claimed  # the layer stack was claimed: the in-place path ran
    assert any(k.startswith("router/") for k in fused_metrics)
    router_grad = [g for p, g in jax.tree_util.tree_flatten_with_path(fused)[0] if "gate" in str(p)]
    assert router_grad and all(float(jnp.abs(g).max()) > 0 for g in router_grad)
    _close(fused, plain, tol=2e-6)
    assert set(fused_metrics) == set(plain_metrics)
    for k in fused_metrics:
        np.testing.assert_allclose(
            np.asarray(fused_metrics[k]), np.asarray(plain_metrics[k]), rtol=2e-6, atol=2e-6
        )


def test_bf16_saved_layer_inputs_are_not_widened_to_float32():
    """The in-place scan saves each layer's bfloat16 input for the backward pass; XLA:CPU, which
    runs no bfloat16 dynamic-slice, used to widen that whole saved stack [L, B, T, D] to float32
    outside the backward loop. Stored as bits, the optimized program holds it once, as u16."""
    cfg = M.ModelConfig.tiny(
        hidden_size=96, num_hidden_layers=3, dtype="bfloat16", remat=True, scan_layers=True
    )
    graphdef, params = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    loss = _loss(graphdef)
    batch = jax.tree.map(lambda x: jnp.stack([x, x]), _batch())
    hlo = (
        jax.jit(lambda p, m: engine.accumulate_gradients(loss, p, m))
        .lower(params, batch)
        .compile()
        .as_text()
    )
    saved = f"[3,{B},{T},96]"
    assert f"u16{saved}" in hlo
    assert f"f32{saved}" not in hlo
