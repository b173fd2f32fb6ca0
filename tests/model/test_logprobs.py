"""Chunked log-probs (model.logprobs.logprobs_from_hidden) equal the unchunked ones: values,
entropies and gradients (to params and to hidden states) in float32, for chunk sizes that do and
do not divide T, tied and untied heads, with and without an entropy gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import engine, grpo
from jaxrlvr.model import logprobs as logprobs_lib

B, T = 3, 11
TOL = 1e-6
# The parameter gradients sum B x T = 33 positions' terms (and, with a tied head, the embedding's
# and the head's); chunking changes that summation order, so float32 rounding (eps 1.2e-7) adds up
# to ~33 eps of the summed terms' scale. One CPU gave 1.1e-6 abs (1.0e-5 rel) on a 0.11 entry;
# a wrong chunk (a dropped or doubled position) moves entries by ~1e-1.
GRAD_TOL = 1e-5


def _setup(tie: bool, seed: int = 0):
    cfg = M.ModelConfig.tiny(tie_word_embeddings=tie)
    graphdef, params = nnx.split(M.init_model(cfg, seed=seed), nnx.Param)
    rng = np.random.default_rng(seed)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32))
    w = jnp.asarray(rng.normal(size=(2, B, T)).astype(np.float32))
    return graphdef, params, ids[:, :-1], ids[:, 1:], w


def _loss(graphdef, ids, labels, w, chunk_size, entropy_grad):
    """A scalar that weighs every position's log-prob and entropy differently."""

    def f(params):
        lm = nnx.merge(graphdef, params)
        hidden, _ = lm.backbone(ids)
        logp, ent = engine.token_logprobs_from_hidden(
            lm, hidden, labels, entropy_grad=entropy_grad, chunk_size=chunk_size
        )
        return jnp.sum(w[0] * logp) + jnp.sum(w[1] * ent), (logp, ent)

    return f


def _assert_close(a, b, tol=TOL):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


@pytest.mark.slow  # ~40 s per case on 2 shared cores (two compiled model gradients)
@pytest.mark.parametrize(
    "tie, chunk_size, entropy_grad", [(True, 5, True), (False, 4, False), (True, 11, False)]
)
def test_chunked_equals_unchunked(tie, chunk_size, entropy_grad):
    """Chunks of 5 and 4 do not divide T = 11; 11 is the one-chunk shortcut."""
    graphdef, params, ids, labels, w = _setup(tie)
    ref = jax.jit(
        jax.value_and_grad(_loss(graphdef, ids, labels, w, None, entropy_grad), has_aux=True)
    )
    got = jax.jit(
        jax.value_and_grad(_loss(graphdef, ids, labels, w, chunk_size, entropy_grad), has_aux=True)
    )
    (v_ref, aux_ref), g_ref = ref(params)
    (v_got, aux_got), g_got = got(params)
    _assert_close(aux_got, aux_ref)  # log-probs and entropies [B, T]
    _assert_close(v_got, v_ref)
    _assert_close(g_got, g_ref, GRAD_TOL)


@pytest.mark.parametrize("chunk_size", [1, 4, 5])
def test_hidden_gradient_and_padding_dropped(chunk_size):
    """The gradient to the hidden states matches, and the zero-padded tail of the last chunk
    (T = 11) leaves no trace in values or gradients."""
    rng = np.random.default_rng(1)
    d, v = 8, 19
    hidden = jnp.asarray(rng.normal(size=(B, T, d)).astype(np.float32))
    kernel = jnp.asarray(0.5 * rng.normal(size=(d, v)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, v, (B, T)).astype(np.int32))
    wt = jnp.asarray(rng.uniform(size=(B, T)).astype(np.float32))

    def f(h, k, chunk_size):
        logp, ent = logprobs_lib.logprobs_from_hidden(
            h, lambda x: x @ k, labels, chunk_size=chunk_size, entropy_grad=True
        )
        return jnp.sum(logp * wt) + jnp.sum(ent), (logp, ent)

    ref = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, kernel, None)
    got = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(hidden, kernel, chunk_size)
    assert got[0][1][0].shape == (B, T)
    _assert_close(got, ref)


def test_make_logprob_fn_chunked():
    """Chunked old/reference log-probs equal the unchunked ones on the loss mask (prompt
    positions, here the first chunk of every row, read 0)."""
    graphdef, params, ids, labels, _ = _setup(tie=True)
    loss_mask = (jnp.arange(T)[None, :] >= 3 + jnp.arange(B)[:, None]).astype(jnp.float32)
    batch = batch_lib.Batch(
        input_ids=ids,
        attention_mask=jnp.ones((B, T), jnp.int32),
        labels=labels,
        loss_mask=loss_mask,
    )
    ref = jax.jit(engine.make_logprob_fn(graphdef))(params, batch)
    got = jax.jit(engine.make_logprob_fn(graphdef, num_microbatches=3, chunk_size=3))(params, batch)
    _assert_close(got, jax.tree.map(lambda x: jnp.where(loss_mask > 0, x, 0.0), ref))


@pytest.mark.parametrize("bad", [0, -1, 2.5])
def test_chunk_size_is_checked(bad):
    with pytest.raises(ValueError, match="logprob_chunk_size"):
        grpo.GRPOUpdateConfig(logprob_chunk_size=bad)


def test_vocab_parallel_head_on_a_mesh():
    """The vocabulary-sharded head on 8 fake devices (rows and vocabulary over data x fsdp)
    gives the unchunked, single-program values and gradients."""
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=4, tensor=1))
    rng = np.random.default_rng(2)
    b, t, d, v = 8, 11, 8, 24
    rows = M.batch_sharding(mesh, 3)
    hidden = jax.device_put(jnp.asarray(rng.normal(size=(b, t, d)).astype(np.float32)), rows)
    weight = jnp.asarray(0.5 * rng.normal(size=(v, d)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, v, (b, t)).astype(np.int32))
    wt = jnp.asarray(rng.uniform(size=(b, t)).astype(np.float32))

    def f(h, w, parallel):
        head = logprobs_lib.vocab_parallel_head(v, mesh, jnp.float32) if parallel else None
        assert (head is not None) == parallel
        logp, ent = logprobs_lib.logprobs_from_hidden(
            h,
            head or (lambda x, w: x @ w.T),
            labels,
            chunk_size=4 if parallel else None,
            entropy_grad=True,
            weight=w,
        )
        return jnp.sum(logp * wt) + jnp.sum(ent), (logp, ent)

    ref = jax.jit(jax.value_and_grad(lambda h, w: f(h, w, False), (0, 1), has_aux=True))
    got = jax.jit(jax.value_and_grad(lambda h, w: f(h, w, True), (0, 1), has_aux=True))
    (loss, aux), grads = got(hidden, weight)
    (loss_ref, aux_ref), grads_ref = ref(hidden, weight)
    # Per-token values and gradients: 1e-6. The scalar loss sums every position's terms (~30 in
    # magnitude) in a different order on 8 shards than in one program: float32 rounding of such
    # a sum reaches ~1e-6 relative (4.6e-5 absolute measured once), so it gets rtol 1e-5.
    _assert_close((aux, grads), (aux_ref, grads_ref))
    np.testing.assert_allclose(float(loss), float(loss_ref), rtol=1e-5)
    one_shard = M.make_mesh(M.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1])
    assert logprobs_lib.vocab_parallel_head(v, one_shard, jnp.float32) is None
    assert logprobs_lib.vocab_parallel_head(23, mesh, jnp.float32) is None


def test_masked_chunks_are_skipped_and_exact_on_the_mask():
    """With a mask, positions outside it read 0 and chunks outside it in every row skip the
    head; on the mask, values and gradients equal the unchunked, unmasked computation."""
    rng = np.random.default_rng(3)
    d, v = 8, 19
    hidden = jnp.asarray(rng.normal(size=(B, T, d)).astype(np.float32))
    kernel = jnp.asarray(0.5 * rng.normal(size=(d, v)).astype(np.float32))
    labels = jnp.asarray(rng.integers(0, v, (B, T)).astype(np.int32))
    mask = np.zeros((B, T), bool)
    mask[0, 5:7] = True  # chunks of 4: [0, 4) and [8, 11) are outside the mask in every row
    mask[2, 6] = True
    mask = jnp.asarray(mask)

    def head(x):
        return x @ kernel

    def f(h, k, chunk_size, m):
        logp, ent = logprobs_lib.logprobs_from_hidden(
            h, lambda x: x @ k, labels, chunk_size=chunk_size, entropy_grad=True, mask_bt=m
        )
        return jnp.sum(logp * mask) + jnp.sum(ent * mask), (logp, ent)

    (v_ref, (lp_ref, ent_ref)), g_ref = jax.value_and_grad(f, (0, 1), has_aux=True)(
        hidden, kernel, None, None
    )
    (v_got, (lp_got, ent_got)), g_got = jax.value_and_grad(f, (0, 1), has_aux=True)(
        hidden, kernel, 4, mask
    )
    _assert_close((v_got, g_got), (v_ref, g_ref))
    _assert_close(lp_got, jnp.where(mask, lp_ref, 0.0))
    _assert_close(ent_got, jnp.where(mask, ent_ref, 0.0))
    # The chunk loop branches on each chunk's mask (lax.cond), so unmasked chunks run no head.
    jaxpr = jax.make_jaxpr(
        lambda h: logprobs_lib.logprobs_from_hidden(h, head, labels, chunk_size=4, mask_bt=mask)
    )(hidden)
    assert "cond" in str(jaxpr)


def test_fp32_lm_head_of_a_bf16_model():
    # model.lm_head_dtype=float32 (ScaleRL's FP32 LM head): a bf16 model's last hidden states
    # and the float32 master weight enter the head's product in float32, the weight unrounded;
    # the default head rounds it to bf16 first. Same parameters, same hidden states.
    bf16 = M.ModelConfig.tiny(tie_word_embeddings=False, dtype="bfloat16")
    fp32_head = bf16.replace(lm_head_dtype="float32")
    assert fp32_head.head_dtype == jnp.float32 and bf16.head_dtype == jnp.bfloat16
    rng = np.random.default_rng(0)

    def graph_and_params(cfg):
        """The model's graph (traced only: a random init costs seconds on a loaded CPU) and
        random float32 parameters of its shapes."""
        graphdef, shapes = nnx.split(nnx.eval_shape(lambda: M.init_model(cfg, seed=0)), nnx.Param)
        return graphdef, jax.tree.map(
            lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), shapes
        )

    graphdef, params = graph_and_params(bf16)
    lm = nnx.merge(graphdef, params)
    lm32 = nnx.merge(graph_and_params(fp32_head)[0], params)  # the same parameters
    # bf16 hidden states as the backbone hands them over (the head is all this test runs).
    hidden = jnp.asarray(rng.normal(size=(B, T, bf16.hidden_size)), jnp.bfloat16)
    w = np.asarray(lm.lm_head_weight(), np.float32)
    w_dv = w  # the untied kernel [D, V] (a tied head reads the same weight transposed)
    h = np.asarray(hidden.astype(jnp.float32))
    want = np.einsum("btd,dv->btv", h.astype(np.float64), w_dv.astype(np.float64))
    got32 = np.asarray(lm32.lm_logits(hidden))
    got16 = np.asarray(lm.lm_logits(hidden))
    assert got32.dtype == np.float32 and got16.dtype == np.float32
    np.testing.assert_allclose(got32, want, rtol=1e-5, atol=1e-5)
    # Rounding the weight to bf16 costs ~1e-3 relative per product: far above float32's error.
    assert np.max(np.abs(got16 - want)) > 20 * np.max(np.abs(got32 - want))
