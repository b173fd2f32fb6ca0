"""The Qwen3-MoE block: grouped dispatch against the dense reference, the router's auxiliary loss
against transformers, KV-cache decode, scan / unrolled / remat, packing, sharding over 8 fake
devices, routing replay's forced experts."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrlvr import model as M
from jaxrlvr.model import moe

from . import helpers
from .test_kv_cache import decode_logits

B, T = 3, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe")
    return helpers.write_checkpoint(path, tie=False, seed=31, family="qwen3_moe")


@pytest.fixture(scope="module")
def lm(ckpt):
    return M.load_hf(ckpt.path)


@functools.partial(jax.jit, static_argnums=0)
def _backbone(graphdef, params, ids, mask=None, positions=None, routes=None):
    """``backbone(..., with_router=True)`` under jit: (hidden, router)."""
    hidden, _, router = nnx.merge(graphdef, params).backbone(
        ids, mask, positions, routes=routes, with_router=True
    )
    return hidden, router


def backbone(lm, ids, mask=None, positions=None, routes=None):
    as_array = lambda x: None if x is None else jnp.asarray(x)  # noqa: E731
    graphdef, params = nnx.split(lm, nnx.Param)
    return _backbone(graphdef, params, *map(as_array, (ids, mask, positions, routes)))


def _experts(seed, e=8, d=16, f=8, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    return (
        (0.3 * jax.random.normal(ks[0], (e, d, f))).astype(dtype),
        (0.3 * jax.random.normal(ks[1], (e, d, f))).astype(dtype),
        (0.3 * jax.random.normal(ks[2], (e, f, d))).astype(dtype),
    )


@pytest.mark.parametrize("impl", ["block_loop", "sorted_blocks", "dense", "ragged_dot"])
@pytest.mark.parametrize("n", [3, 300])  # decode-sized and prefill-sized token counts
def test_grouped_dispatch_equals_dense_reference(impl, n):
    """Every token reaches its k experts (dropless), weighted as the one-hot reference says,
    with skewed routing (expert 0 takes most slots, some experts none); gradients too."""
    e, k = 8, 3
    x = jax.random.normal(jax.random.PRNGKey(n), (n, 16))
    logits = jax.random.normal(jax.random.PRNGKey(n + 1), (n, e)) + jnp.array([3.0] + [0.0] * 7)
    ids, w = moe.select_experts(jax.nn.softmax(logits), k, True)
    experts = _experts(n)

    def grouped(x, *experts):
        return moe.grouped_experts(x, ids, w, *experts, impl=impl)

    def dense(x, *experts):
        return moe.dense_experts(x, ids, w, *experts)

    # Different summation orders only: observed max |diff| ~1e-6 on O(1) outputs.
    out = jax.jit(grouped)(x, *experts)
    np.testing.assert_allclose(out, jax.jit(dense)(x, *experts), atol=1e-5, rtol=0)
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    g1 = jax.jit(jax.grad(loss(grouped), argnums=(0, 1, 2, 3)))(x, *experts)
    g2 = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2, 3)))(x, *experts)
    for a, b in zip(g1, g2):
        scale = float(np.abs(np.asarray(b)).max())
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0)


@pytest.mark.parametrize("impl", ["block_loop", "sorted_blocks", "dense", "ragged_dot"])
def test_padding_rows_skip_the_experts(impl):
    """``valid_n``: padding rows give 0 and the valid rows what the reference gives them (values
    and gradients); ``block_loop`` runs no expert on a padding row."""
    n, e, k = 300, 8, 2
    x = jax.random.normal(jax.random.PRNGKey(2), (n, 16))
    probs = jax.nn.softmax(jax.random.normal(jax.random.PRNGKey(3), (n, e)))
    ids, w = moe.select_experts(probs, k, True)
    valid = jax.random.uniform(jax.random.PRNGKey(4), (n,)) < 0.6
    experts = _experts(5)

    def grouped(x, *experts):
        return moe.grouped_experts(x, ids, w, *experts, impl=impl, valid_n=valid)

    def dense(x, *experts):
        return moe.dense_experts(x, ids, jnp.where(valid[:, None], w, 0.0), *experts)

    out = jax.jit(grouped)(x, *experts)
    assert not np.any(np.asarray(out)[~np.asarray(valid)])
    np.testing.assert_allclose(out, jax.jit(dense)(x, *experts), atol=1e-5, rtol=0)  # as above
    loss = lambda f: lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    g1 = jax.jit(jax.grad(loss(grouped), argnums=(0, 1, 2, 3)))(x, *experts)
    g2 = jax.jit(jax.grad(loss(dense), argnums=(0, 1, 2, 3)))(x, *experts)
    for a, b in zip(g1, g2):
        np.testing.assert_allclose(a, b, atol=1e-5 * float(np.abs(np.asarray(b)).max()), rtol=0)
    if impl == "block_loop":
        # The loop never runs a padding row: NaN there reaches neither the outputs nor the
        # kernels' gradients (a zeroed gate weight alone would give 0 x NaN = NaN).
        x_nan = jnp.where(valid[:, None], x, jnp.nan)
        np.testing.assert_array_equal(jax.jit(grouped)(x_nan, *experts), out)
        g3 = jax.jit(jax.grad(loss(grouped), argnums=(0, 1, 2, 3)))(x_nan, *experts)
        for a, b in zip(g3, g1):
            np.testing.assert_array_equal(a, b)


def test_block_loop_in_bfloat16_is_near_the_float32_reference():
    """bfloat16 rows through ``block_loop`` (its loops move 2-byte rows as bits, and sum each
    expert's kernel gradients in float32): values and gradients within bfloat16's rounding of
    the float32 one-hot reference on the same (bf16-representable) inputs. Bounds: 2 % of the
    largest entry, ~5 bf16 ulps (observed ~0.6 % for values, ~1 % for gradients)."""
    n, e, k = 200, 8, 2
    x = jax.random.normal(jax.random.PRNGKey(5), (n, 16)).astype(jnp.bfloat16)
    logits = jax.random.normal(jax.random.PRNGKey(6), (n, e))
    ids, w = moe.select_experts(jax.nn.softmax(logits), k, True)
    experts = _experts(7, dtype=jnp.bfloat16)
    f32 = lambda a: a.astype(jnp.float32)  # noqa: E731

    def loss(fn):
        return lambda x, *ex: jnp.sum(jnp.sin(f32(fn(x, ids, w.astype(x.dtype), *ex))))

    loop = functools.partial(moe.grouped_experts, impl="block_loop")
    args = (x, *experts)
    out = jax.jit(loop)(x, ids, w.astype(jnp.bfloat16), *experts)
    assert out.dtype == jnp.bfloat16
    ref = moe.dense_experts(f32(x), ids, w, *map(f32, experts))
    np.testing.assert_allclose(f32(out), ref, atol=0.02 * float(jnp.abs(ref).max()), rtol=0)
    grads = jax.jit(jax.grad(loss(loop), argnums=(0, 1, 2, 3)))(*args)
    refs = jax.grad(loss(moe.dense_experts), argnums=(0, 1, 2, 3))(*map(f32, args))
    for g, r in zip(grads, refs):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_allclose(f32(g), r, atol=0.02 * float(jnp.abs(r).max()), rtol=0)


def test_auto_kernel_by_shape_on_cpu():
    """On the CPU "auto" takes the dense kernel only where it measured faster (E <= 2k and at
    most DENSE_MAX_TOKENS tokens), the block loop elsewhere (the MoE demo: 8 experts top-2)."""
    assert jax.default_backend() == "cpu"
    assert moe.resolve_impl("auto", 256, 4, 2) == "dense"
    assert moe.resolve_impl("auto", moe.DENSE_MAX_TOKENS + 1, 4, 2) == "block_loop"
    assert moe.resolve_impl("auto", 32, 8, 2) == "block_loop"
    assert moe.resolve_impl("auto", 2016, 8, 2) == "block_loop"
    assert moe.resolve_impl("dense", 2016, 8, 2) == "dense"


def test_auto_kernel_on_accelerators(monkeypatch):
    """On a GPU "auto" takes the sorted blocks (measured on an H200 with JAX 0.11.2: ragged_dot
    4.8x slower in the GRPO update of a 4-layer Qwen3-30B-A3B, docs/gpu/README.md), on a TPU
    ragged_dot; the expert-parallel dispatch follows the kernel."""
    from jaxrlvr.model import expert_parallel

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert moe.resolve_impl("auto", 2048, 128, 8) == "sorted_blocks"
    assert moe.resolve_impl("auto", 32, 8, 2) == "sorted_blocks"
    assert expert_parallel.dispatch_for("auto") == "ring"
    assert moe.resolve_impl("ragged_dot", 2048, 128, 8) == "ragged_dot"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert moe.resolve_impl("auto", 2048, 128, 8) == "ragged_dot"
    assert expert_parallel.dispatch_for("auto") == "ragged"


def test_router_selection_follows_transformers():
    """select_experts = transformers' Qwen3MoeTopKRouter (float32 softmax, top-k, optional
    renormalisation) on the same logits."""
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    class C:
        num_experts_per_tok, num_experts, hidden_size = 2, 8, 8

    logits = np.random.default_rng(0).standard_normal((40, 8)).astype(np.float32)
    for norm in (False, True):
        C.norm_topk_prob = norm
        router = hf.Qwen3MoeTopKRouter(C)
        with torch.no_grad():
            router.weight.copy_(torch.eye(8))
            _, w_ref, ids_ref = router(torch.as_tensor(logits))
        ids, w = moe.select_experts(jax.nn.softmax(jnp.asarray(logits)), 2, norm)
        np.testing.assert_array_equal(ids, ids_ref.numpy())
        np.testing.assert_allclose(w, w_ref.numpy(), atol=1e-6)


def test_aux_loss_equals_transformers(lm, ckpt):
    """load_balancing_loss over our router statistics = transformers' load_balancing_loss_func
    on its router logits, with padding excluded by the attention mask."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    ids = helpers.random_ids(B, T, seed=3)
    mask, positions = helpers.left_padded([T, 9, 4], T)
    with torch.no_grad():
        out = ckpt.torch_model(
            torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(positions, dtype=torch.long),
            output_router_logits=True,
        )
    ref = load_balancing_loss_func(out.router_logits, 8, 2, torch.as_tensor(mask)).item()
    ref_nomask = load_balancing_loss_func(out.router_logits, 8, 2, None).item()
    _, router = backbone(lm, ids, mask, positions)
    assert router.expert_ids.shape == (2, B, T, 2)
    assert float(router.num_tokens) == mask.sum()
    np.testing.assert_allclose(float(moe.load_balancing_loss(router)), ref, rtol=1e-5)
    assert abs(ref - ref_nomask) > 1e-4  # the mask mattered
    # Our expert ids are transformers' top-k (on real tokens: padding's hidden states differ).
    hf_ids = torch.topk(out.router_logits[0], 2, dim=-1).indices.numpy().reshape(B, T, 2)
    real = mask.astype(bool)
    np.testing.assert_array_equal(np.asarray(router.expert_ids[0])[real], hf_ids[real])
    metrics = moe.router_metrics(router)
    assert metrics["load_max_over_mean"].shape == (2,)
    assert np.all(np.asarray(metrics["load_max_over_mean"]) >= 1.0)
    assert np.all(np.asarray(metrics["load_entropy"]) <= np.log(8) + 1e-6)


def test_kv_cache_decode_equals_full_forward(lm):
    ids = helpers.random_ids(B, 12, seed=4)
    logits, full_mask, positions = decode_logits(lm, ids, [6, 4, 2], 6)
    full = helpers.forward(lm, ids, full_mask, positions)
    real = full_mask.astype(bool)
    np.testing.assert_allclose(logits[real], full[real], atol=1e-5, rtol=0)


def test_unrolled_remat_equals_scan(ckpt, lm):
    """Unrolled, rematerialised layers: the scanned model's loss and gradients (router and aux
    loss included)."""
    ids = jnp.asarray(helpers.random_ids(B, T, seed=5))
    other = M.load_hf(ckpt.path, scan_layers=False, remat=True)

    def grads(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p):
            hidden, _, router = nnx.merge(graphdef, p).backbone(ids, with_router=True)
            return jnp.mean(hidden**2) + moe.load_balancing_loss(router)

        return jax.jit(jax.value_and_grad(loss))(params)

    (v1, g1), (v2, g2) = grads(lm), grads(other)
    np.testing.assert_allclose(v1, v2, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
        scale = float(np.abs(np.asarray(b)).max())
        np.testing.assert_allclose(a, b, atol=1e-5 * max(scale, 1e-6), rtol=0)
    # The aux loss's gradient reaches the router.
    router_grad = g1["model"]["layers"]["mlp"]["gate"]["kernel"][...]
    assert float(jnp.abs(router_grad).max()) > 0


def test_packed_row_with_shared_prompt_equals_separate_rows(lm):
    """One row holding a sequence (segment 1) and a shared prompt (segment 0, group 1) with two
    completions (segments 2, 3 of group 1) gives the logits of each sequence alone: routing is
    per token, attention follows the segments and the shared prompt."""
    a, p = helpers.random_ids(1, 7, seed=6), helpers.random_ids(1, 5, seed=7)
    c1, c2 = helpers.random_ids(1, 4, seed=16), helpers.random_ids(1, 4, seed=17)
    row = np.concatenate([a, p, c1, c2], axis=1)
    seg = np.array([[1] * 7 + [0] * 5 + [2] * 4 + [3] * 4], np.int32)
    grp = np.array([[0] * 7 + [1] * 13], np.int32)
    pos = np.array([list(range(7)) + list(range(5)) + list(range(5, 9)) * 2], np.int32)
    graphdef, params = nnx.split(lm, nnx.Param)

    @jax.jit
    def call(p, ids, pos, seg, grp):
        return nnx.merge(graphdef, p)(ids, None, pos, segment_ids=seg, prompt_group_ids=grp)

    packed = np.asarray(call(params, *map(jnp.asarray, (row, pos, seg, grp))))
    np.testing.assert_allclose(packed[:, :7], helpers.forward(lm, a), atol=1e-5, rtol=0)
    first = helpers.forward(lm, np.concatenate([p, c1], axis=1))
    second = helpers.forward(lm, np.concatenate([p, c2], axis=1))
    np.testing.assert_allclose(packed[:, 7:12], first[:, :5], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[:, 12:16], first[:, 5:], atol=1e-5, rtol=0)
    np.testing.assert_allclose(packed[:, 16:], second[:, 5:], atol=1e-5, rtol=0)


def test_forced_routes_replay(lm):
    """Routing replay's hook: forcing the live experts changes nothing (bit for bit); forcing
    others gives the dense reference's output at those experts, with the gate weights taken
    from the live softmax there, so the router still gets a gradient; -1 rows use the live
    top-k."""
    ids = jnp.asarray(helpers.random_ids(2, 8, seed=8))
    hidden, router = backbone(lm, ids)
    same, router2 = backbone(lm, ids, routes=router.expert_ids)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(hidden))
    np.testing.assert_array_equal(np.asarray(router2.expert_ids), np.asarray(router.expert_ids))

    forced = (router.expert_ids + 1) % 8  # every token on other experts
    forced = forced.at[:, :, 0].set(-1)  # the first position of each row: live top-k
    moved, router3 = backbone(lm, ids, routes=forced)
    got = np.asarray(router3.expert_ids)
    np.testing.assert_array_equal(got[:, :, 1:], np.asarray(forced)[:, :, 1:])
    np.testing.assert_array_equal(got[:, :, 0], np.asarray(router.expert_ids)[:, :, 0])
    np.testing.assert_allclose(np.asarray(moved)[:, 0], np.asarray(hidden)[:, 0], atol=1e-6)
    assert np.abs(np.asarray(moved)[:, 1:] - np.asarray(hidden)[:, 1:]).max() > 1e-3

    graphdef, params = nnx.split(lm, nnx.Param)

    def loss(p):
        h, _ = nnx.merge(graphdef, p).backbone(ids, routes=forced)
        return jnp.mean(h**2)

    grad = jax.jit(jax.grad(loss))(params)["model"]["layers"]["mlp"]["gate"]["kernel"][...]
    assert float(jnp.abs(grad).max()) > 0


def test_first_layer_forced_routes_match_dense_reference(lm):
    """Layer 0's MoE output under forced experts equals the dense one-hot reference fed the
    same experts and live-softmax weights (computed here from the layer's own parameters)."""
    from jaxrlvr.model import decoder

    cfg = lm.config
    layer = jax.tree.map(lambda a: a[0], nnx.state(lm.model.layers))
    layer = nnx.merge(nnx.graphdef(lm.model.layers), layer)
    h = jax.random.normal(jax.random.PRNGKey(9), (2, 5, cfg.hidden_size))
    forced = jax.random.randint(jax.random.PRNGKey(10), (2, 5, 2), 0, 8)
    forced = forced.at[..., 1].set((forced[..., 0] + 3) % 8)  # two distinct experts
    y, (got_ids, _, _) = jax.jit(lambda h, f: decoder._moe_mlp(layer.mlp, cfg, h, None, f))(
        h, forced
    )
    probs = jax.nn.softmax(h.reshape(10, -1) @ layer.mlp.gate.kernel[...], axis=-1)
    w = jnp.take_along_axis(probs, forced.reshape(10, 2), axis=-1)
    w = w / w.sum(-1, keepdims=True)  # the fixture's norm_topk_prob
    ex = layer.mlp.experts
    ref = moe.dense_experts(
        h.reshape(10, -1),
        forced.reshape(10, 2),
        w,
        ex.gate_proj[...],
        ex.up_proj[...],
        ex.down_proj[...],
    )
    np.testing.assert_array_equal(np.asarray(got_ids), np.asarray(forced))
    np.testing.assert_allclose(np.asarray(y).reshape(10, -1), ref, atol=1e-5, rtol=0)


def test_sharded_equals_unsharded(ckpt, lm):
    """On 8 fake devices (fsdp 4 x tensor 2) experts are split over fsdp by expert, and the
    logits and router outputs equal the single-device model's."""
    mesh = M.make_mesh(M.MeshConfig(data=1, fsdp=4, tensor=2))
    sharded = M.load_hf(ckpt.path, mesh=mesh)
    gate_up = sharded.model.layers.mlp.experts.gate_proj[...]
    assert gate_up.sharding.spec == P(None, "fsdp", None, "tensor")
    assert sharded.model.layers.mlp.experts.down_proj[...].sharding.spec == P(
        None, "fsdp", "tensor"
    )
    ids = helpers.random_ids(4, 12, seed=11)
    mask, positions = helpers.left_padded([12, 9, 5, 12], 12)
    graphdef, params = nnx.split(sharded, nnx.Param)

    @jax.jit
    def forward(params, ids, mask, positions):
        m = nnx.merge(graphdef, params)
        hidden, _, router = m.backbone(ids, mask, positions, with_router=True)
        return m.lm_logits(hidden), router

    put = lambda x: jax.device_put(jnp.asarray(x), M.batch_sharding(mesh, 2))  # noqa: E731
    logits, router = forward(params, put(ids), put(mask), put(positions))
    reference = helpers.forward(lm, ids, mask, positions)
    _, ref_router = backbone(lm, ids, mask, positions)
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(logits)[real], reference[real], atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(router.expert_ids), np.asarray(ref_router.expert_ids))


def test_bfloat16_runs_close_to_float32(ckpt, lm):
    """bf16 compute: logits near float32's (a top-k flip moves a token's output, so the bound
    is on the mean; observed mean |diff| ~0.02 on O(1) logits)."""
    bf16 = M.load_hf(ckpt.path, dtype="bfloat16")
    ids = helpers.random_ids(B, T, seed=12)
    err = np.abs(helpers.forward(bf16, ids) - helpers.forward(lm, ids))
    assert np.isfinite(err).all() and err.mean() < 0.05, err.mean()


def test_update_engine_adds_router_terms(ckpt, lm):
    """``engine.accumulate_gradients`` over 2 microbatches of a MoE policy: ``router/*``
    metrics every step (the aux loss is the mean of the microbatches' transformers values);
    with ``router_aux_loss`` the loss gains coef x aux: the routers' gradients change, the last
    layer's experts (which feed no router) keep theirs."""
    from jaxrlvr.algos import engine

    ids = jnp.asarray(helpers.random_ids(4, 8, seed=13))
    mbs = engine.split_microbatches(ids, 2)

    def run(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def loss_fn(p, mb):
            hidden, _ = nnx.merge(graphdef, p).backbone(mb)
            return jnp.mean(hidden**2) / 2, {"loss": jnp.mean(hidden**2) / 2}

        return jax.jit(lambda p, m: engine.accumulate_gradients(loss_fn, p, m))(params, mbs)

    g_off, m_off = run(lm)
    # The aux-loss model also runs its scanned layers rematerialised (the path updates take).
    g_on, m_on = run(M.load_hf(ckpt.path, router_aux_loss=True, remat=True))
    expected = np.mean([float(moe.load_balancing_loss(backbone(lm, mb)[1])) for mb in mbs])
    np.testing.assert_allclose(float(m_off["router/aux_loss"]), expected, rtol=1e-5)
    assert {"router/load_max_over_mean", "router/layer1/load_entropy"} <= set(m_off)
    for key in m_off:
        np.testing.assert_allclose(m_on[key], m_off[key], rtol=1e-6)
    layers_off, layers_on = g_off["model"]["layers"], g_on["model"]["layers"]
    diff = np.abs(
        layers_on["mlp"]["gate"]["kernel"][...] - layers_off["mlp"]["gate"]["kernel"][...]
    )
    assert diff.max() > 1e-6
    last_on = layers_on["mlp"]["experts"]["down_proj"][...][-1]
    last_off = layers_off["mlp"]["experts"]["down_proj"][...][-1]
    # Remat recomputes in another order: ~1e-5 of the gradient's scale (the aux term itself
    # would add O(coef) here if it reached these experts).
    scale = float(np.abs(np.asarray(last_off)).max())
    np.testing.assert_allclose(last_on, last_off, rtol=0, atol=1e-5 * scale)
    with pytest.raises(M.ConfigError, match="router_aux_loss"):
        M.ModelConfig.tiny(router_aux_loss=True)


def test_lora_on_moe_adapts_attention_only(ckpt, tmp_path):
    """LoRA on a MoE model: the targets narrow to attention (router and experts stay frozen),
    and PEFT loads our adapters onto transformers' Qwen3MoeForCausalLM with our logits."""
    import copy

    from peft import PeftModel

    from jaxrlvr.model import lora, peft

    lm = M.load_hf(ckpt.path, lora=lora.LoRAConfig(rank=4, alpha=8.0))
    assert lm.config.lora.targets == lora.ATTENTION_TARGETS
    graphdef, params = nnx.split(lm, nnx.Param)
    params = nnx.State.merge(params, helpers.random_lora_b(nnx.state(lm, lora.LoRAParam), 14))
    peft.save_adapter(lm.config, params, tmp_path / "ours", base_model_name_or_path="tiny")
    model = PeftModel.from_pretrained(copy.deepcopy(ckpt.torch_model), tmp_path / "ours").eval()
    ids = helpers.random_ids(2, 10, seed=15)
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
    assert np.abs(theirs - helpers.torch_logits(ckpt.torch_model, ids)).max() > 0.1
    np.testing.assert_allclose(helpers.forward(nnx.merge(graphdef, params), ids), theirs, atol=1e-4)
    with pytest.raises(ValueError, match="experts and router take no adapters"):
        M.load_hf(ckpt.path, lora=lora.LoRAConfig(targets=("gate_proj",)))


def test_forced_routes_router_gradient_equals_reference(lm):
    """Under replay the router's gradient is that of an independent reference: the live float32
    softmax of h W_r gathered at the forced experts (most of them outside the live top-k, where a
    post-top-k zeroed distribution would give no gradient), renormalised, combined by the dense
    one-hot reference. Both differentiated with respect to the router kernel W_r."""
    from jaxrlvr.model import decoder

    cfg = lm.config
    layer = jax.tree.map(lambda a: a[0], nnx.state(lm.model.layers))
    layer = nnx.merge(nnx.graphdef(lm.model.layers), layer)
    mlp_def, mlp_params = nnx.split(layer.mlp, nnx.Param)
    h = jax.random.normal(jax.random.PRNGKey(19), (2, 5, cfg.hidden_size))
    cot = jax.random.normal(jax.random.PRNGKey(21), (2, 5, cfg.hidden_size))
    live = jax.lax.top_k(h.reshape(10, -1) @ layer.mlp.gate.kernel[...], 2)[1].reshape(2, 5, 2)
    forced = (live + 3) % 8  # other experts than the live top-2 on every token
    ex = layer.mlp.experts

    def ours(kernel):
        p = jax.tree.map(lambda a: a, mlp_params)  # a copy with the router kernel replaced
        p["gate"]["kernel"] = nnx.Param(kernel)
        y, _ = decoder._moe_mlp(nnx.merge(mlp_def, p), cfg, h, None, forced)
        return jnp.sum(y * cot)

    def reference(kernel):
        probs = jax.nn.softmax((h.reshape(10, -1) @ kernel).astype(jnp.float32), axis=-1)
        w = jnp.take_along_axis(probs, forced.reshape(10, 2), axis=-1)
        w = w / w.sum(-1, keepdims=True)  # the fixture's norm_topk_prob
        y = moe.dense_experts(
            h.reshape(10, -1),
            forced.reshape(10, 2),
            w,
            ex.gate_proj[...],
            ex.up_proj[...],
            ex.down_proj[...],
        )
        return jnp.sum(y * cot.reshape(10, -1))

    kernel = layer.mlp.gate.kernel[...]
    g_ours = np.asarray(jax.jit(jax.grad(ours))(kernel))
    g_ref = np.asarray(jax.jit(jax.grad(reference))(kernel))
    assert np.abs(g_ref).max() > 1e-3  # the reference's gradient is not trivially zero
    # float32, different summation orders (grouped vs dense): ~1e-6 of the gradient's scale
    np.testing.assert_allclose(g_ours, g_ref, atol=1e-5 * np.abs(g_ref).max(), rtol=1e-4)
