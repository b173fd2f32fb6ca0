"""Logit parity with transformers' Qwen2ForCausalLM (float32 and bfloat16 compute)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrlvr import model as M

from . import helpers

# float32: both sides do the same float32 math in a different order; observed max |diff| is
# ~3e-7 on O(1) logits, so 1e-4 (the bar) leaves a wide margin yet catches any real
# mistake (a wrong rotary layout or mask shifts logits by O(0.1-1)).
F32_ATOL = 1e-4
B, T = 3, 16  # one shape for most tests: one compilation each


@pytest.fixture(scope="module")
def loaded(hf_untied, hf_tied):
    return {"untied": M.load_hf(hf_untied.path), "tied": M.load_hf(hf_tied.path)}


@pytest.fixture(params=["untied", "tied"])
def pair(request, loaded, hf_untied, hf_tied):
    ckpt = hf_untied if request.param == "untied" else hf_tied
    return loaded[request.param], ckpt.torch_model


def test_fixture_logits_are_order_one(pair):
    # Guards the meaning of the tolerance: with near-zero logits 1e-4 would prove nothing.
    _, torch_model = pair
    ref = helpers.torch_logits(torch_model, helpers.random_ids(B, T))
    assert ref.std() > 0.5


def test_tied_checkpoint_has_no_lm_head(loaded):
    assert loaded["tied"].lm_head is None
    assert loaded["untied"].lm_head is not None
    assert loaded["tied"].config.tie_word_embeddings
    assert not loaded["untied"].config.tie_word_embeddings


def test_no_mask(pair):
    lm, torch_model = pair
    ids = helpers.random_ids(B, T, seed=1)
    out = helpers.forward(lm, ids)
    ref = helpers.torch_logits(torch_model, ids)
    np.testing.assert_allclose(out, ref, atol=F32_ATOL, rtol=0)


def test_eager_call(loaded, hf_untied):
    # The plain eager call (no jit by the caller), with all defaults.
    lm, torch_model = loaded["untied"], hf_untied.torch_model
    ids = helpers.random_ids(B, T, seed=1)
    out = np.asarray(lm(jnp.asarray(ids)))
    ref = helpers.torch_logits(torch_model, ids)
    assert out.shape == ref.shape == (B, T, helpers.TINY_HF["vocab_size"])
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, ref, atol=F32_ATOL, rtol=0)


def test_right_padding(pair):
    lm, torch_model = pair
    ids = helpers.random_ids(B, T, seed=2)
    mask = np.ones_like(ids)
    mask[1, 9:] = 0
    mask[2, 4:] = 0
    out = helpers.forward(lm, ids, mask)
    ref = helpers.torch_logits(torch_model, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=F32_ATOL, rtol=0)
    # Padding must not leak into real tokens: row 2 equals its first 4 tokens with a full mask
    # and garbage after them.
    ids2 = ids.copy()
    ids2[2, 4:] = (ids2[2, 4:] + 1) % helpers.TINY_HF["vocab_size"]
    out2 = helpers.forward(lm, ids2, mask)
    np.testing.assert_allclose(out2[2, :4], out[2, :4], atol=F32_ATOL, rtol=0)


def test_left_padding_with_position_ids(pair):
    lm, torch_model = pair
    ids = helpers.random_ids(B, T, seed=3)
    mask, positions = helpers.left_padded([T, 7, 3], T)
    out = helpers.forward(lm, ids, mask, positions)
    ref = helpers.torch_logits(torch_model, ids, mask, positions)
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=F32_ATOL, rtol=0)
    # The pad tokens' ids do not matter to the real tokens.
    ids2 = np.where(real, ids, 0).astype(np.int32)
    out2 = helpers.forward(lm, ids2, mask, positions)
    np.testing.assert_allclose(out2[real], out[real], atol=F32_ATOL, rtol=0)


def test_left_padding_default_positions_follow_hf(pair):
    # HF semantics: without position_ids they are arange(T) whatever the padding.
    lm, torch_model = pair
    ids = helpers.random_ids(B, T, seed=9)
    mask, _ = helpers.left_padded([T, 10, 5], T)
    out = helpers.forward(lm, ids, mask)
    ref = helpers.torch_logits(torch_model, ids, mask)
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=F32_ATOL, rtol=0)


def test_arbitrary_position_ids(pair):
    # Rotary embeddings are relative, so a constant shift of positions changes nothing; gapped,
    # per-row different positions do. Both sides must agree on them.
    lm, torch_model = pair
    ids = helpers.random_ids(B, T, seed=4)
    rng = np.random.default_rng(4)
    positions = np.sort(rng.integers(0, 200, (B, T)), axis=1).astype(np.int32)
    out = helpers.forward(lm, ids, None, positions)
    ref = helpers.torch_logits(torch_model, ids, None, positions)
    np.testing.assert_allclose(out, ref, atol=F32_ATOL, rtol=0)
    default = helpers.forward(lm, ids)
    assert np.abs(out - default).max() > 1e-2  # the positions were really used


def test_backbone_plus_lm_logits_equals_call(pair):
    lm, _ = pair
    ids = jnp.asarray(helpers.random_ids(B, T, seed=6))
    hidden, cache = lm.backbone(ids)
    assert cache is None
    assert hidden.shape == (B, T, helpers.TINY_HF["hidden_size"])
    # Eager vs jit: XLA fuses differently, observed |diff| ~3e-6 on O(1) logits.
    np.testing.assert_allclose(
        np.asarray(lm.lm_logits(hidden)), helpers.forward(lm, ids), atol=1e-5, rtol=0
    )


def test_remat_does_not_change_logits(hf_untied):
    lm = M.load_hf(hf_untied.path, remat=True)
    assert lm.config.remat
    ids = helpers.random_ids(B, T, seed=7)
    ref = helpers.torch_logits(hf_untied.torch_model, ids)
    np.testing.assert_allclose(helpers.forward(lm, ids), ref, atol=F32_ATOL, rtol=0)


@pytest.mark.parametrize("remat", [False, True])
def test_unrolled_layers_match_transformers_and_scan(hf_untied, remat):
    # scan_layers=False runs the same stacked parameters through a Python loop; the logits and
    # the gradient must be those of the scanned model (same math, different buffers: observed
    # |diff| ~1e-7 relative, so 1e-5 of each gradient's scale leaves margin, while a wrong
    # layer order or a skipped layer moves them by O(0.1)).
    import jax
    from flax import nnx

    ids = helpers.random_ids(B, T, seed=8)
    unrolled = M.load_hf(hf_untied.path, scan_layers=False, remat=remat)
    scanned = M.load_hf(hf_untied.path, remat=remat)
    assert not unrolled.config.scan_layers and scanned.config.scan_layers
    ref = helpers.torch_logits(hf_untied.torch_model, ids)
    np.testing.assert_allclose(helpers.forward(unrolled, ids), ref, atol=F32_ATOL, rtol=0)

    def grads(lm):
        graphdef, params = nnx.split(lm, nnx.Param)

        def loss(p):
            logits = nnx.merge(graphdef, p)(jnp.asarray(ids))
            return jax.nn.log_softmax(logits)[..., 0].mean()

        return jax.jit(jax.grad(loss))(params)

    for a, b in zip(jax.tree.leaves(grads(unrolled)), jax.tree.leaves(grads(scanned))):
        a, b = np.asarray(a), np.asarray(b)
        scale = np.abs(b).max()
        assert scale > 0  # every parameter, the per-layer stacks included, gets a gradient
        np.testing.assert_allclose(a, b, atol=1e-5 * scale, rtol=0)


def test_separate_projection_path_matches_transformers(hf_untied, monkeypatch):
    # q/k/v normally come from one joined matmul; under tensor parallelism that does not divide
    # the kv heads the layer uses three matmuls instead. Both paths must give HF's logits.
    import jax

    from jaxrlvr.model import decoder

    lm = M.load_hf(hf_untied.path)
    ids = helpers.random_ids(B, T, seed=9)
    ref = helpers.torch_logits(hf_untied.torch_model, ids)
    assert decoder._fuse_qkv(None, lm.config)
    jax.clear_caches()  # the layer stack is jitted per config; recompile with the patch
    monkeypatch.setattr(decoder, "_fuse_qkv", lambda mesh, cfg: False)
    try:
        np.testing.assert_allclose(helpers.forward(lm, ids), ref, atol=F32_ATOL, rtol=0)
    finally:
        jax.clear_caches()


# bfloat16 has an 8-bit mantissa (relative rounding 2^-9 ~ 2e-3 per op). Over 2 layers of
# O(1)-scale matmuls the logits (std ~1-3 here) drift: observed max |diff| 0.079, mean 0.015,
# the same for float32 and bfloat16 storage (compute casts weights to bfloat16 either way).
# The bound is ~3x the observed maximum and far below the error of a real bug (O(1)).
BF16_ATOL = 0.25
BF16_MEAN_ATOL = 0.05


@pytest.mark.parametrize("param_dtype", ["float32", "bfloat16"])
def test_bfloat16_within_documented_tolerance(hf_untied, param_dtype):
    lm = M.load_hf(hf_untied.path, dtype="bfloat16", param_dtype=param_dtype)
    assert lm.model.layers.mlp.up_proj.kernel[...].dtype == jnp.dtype(param_dtype)
    ids = helpers.random_ids(B, T, seed=8)
    mask, positions = helpers.left_padded([T, 11, 5], T)
    out = helpers.forward(lm, ids, mask, positions)
    assert out.dtype == np.float32  # logits are float32 whatever the compute dtype
    ref = helpers.torch_logits(hf_untied.torch_model, ids, mask, positions)
    real = mask.astype(bool)
    err = np.abs(out[real] - ref[real])
    print(f"bf16 param_dtype={param_dtype}: max {err.max():.4f} mean {err.mean():.4f}")
    assert err.max() < BF16_ATOL, err.max()
    assert err.mean() < BF16_MEAN_ATOL, err.mean()  # no systematic drift
