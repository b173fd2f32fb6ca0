"""Memory-efficient attention (``model.attention_query_chunk``): the queries in blocks, one block
at a time and rematerialised, compute the same logits and gradients as all queries at once, on
packed rows with shared prompts and a T that is not a whole number of blocks, and the compiled
forward + backward holds one block's scores instead of all of them."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr.model.config import ConfigError


def _model(chunk, **overrides):
    cfg = M.ModelConfig.tiny(model_type="qwen3", attention_query_chunk=chunk, **overrides)
    return nnx.split(M.init_model(cfg, seed=3), nnx.Param)


def _packed(b=2, t=23, seed=0):
    """Two rows, each a shared prompt (segment 0, group g) and completions (segments 1..)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 128, (b, t)).astype(np.int32)
    seg = np.zeros((b, t), np.int32)
    grp = np.zeros((b, t), np.int32)
    seg[:, 6:13], seg[:, 13:20], seg[:, 20:] = 1, 2, 3
    grp[:, :20] = 1
    grp[1, 20:] = 0  # row 1 ends in padding of its own segment, outside any group
    pos = np.concatenate([np.arange(6), 6 + np.arange(7), 6 + np.arange(7), np.arange(3)])
    return dict(
        input_ids=jnp.asarray(ids),
        attention_mask=jnp.ones((b, t), jnp.int32),
        position_ids=jnp.asarray(np.broadcast_to(pos, (b, t)).astype(np.int32)),
        segment_ids=jnp.asarray(seg),
        prompt_group_ids=jnp.asarray(grp),
    )


def _loss(graphdef, batch):
    def loss(params):
        hidden, _ = nnx.merge(graphdef, params).backbone(**batch)
        return jnp.sum(jnp.sin(hidden) * jnp.arange(hidden.shape[-1]) / hidden.shape[-1])

    return jax.jit(jax.value_and_grad(loss))


@pytest.mark.parametrize("chunk", [1, 8, 16])
def test_blocked_queries_compute_the_same_function(chunk):
    """The loss equals the unblocked attention's to 2e-6 and every parameter's gradient to 2e-6
    of its largest entry (float32; each query's softmax runs over the same keys, so only
    rounding differs: the keys' and values' cotangents are now summed block by block)."""
    batch = _packed()
    graphdef, params = _model(None)
    want_value, want_grad = _loss(graphdef, batch)(params)
    graphdef_b, _ = _model(chunk)
    got_value, got_grad = _loss(graphdef_b, batch)(params)
    np.testing.assert_allclose(float(got_value), float(want_value), rtol=2e-6)
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad), strict=True):
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=2e-6 * scale)


def _temp_bytes(chunk, t=512):
    graphdef, params = _model(chunk, num_attention_heads=8, num_key_value_heads=2, hidden_size=32)
    ids = jnp.zeros((1, t), jnp.int32)
    loss = _loss(graphdef, dict(input_ids=ids, attention_mask=jnp.ones((1, t), jnp.int32)))
    return loss.lower(params).compile().memory_analysis().temp_size_in_bytes


def test_blocked_queries_hold_one_blocks_scores():
    """At T=512 with 8 heads, one layer's float32 scores are 8 MiB and the unblocked forward +
    backward keeps several such [8, 512, 512] values; in blocks of 64 queries they are 1 MiB
    each. XLA's memory analysis of the compiled program: under a third of the temporaries."""
    whole, blocked = _temp_bytes(None), _temp_bytes(64)
    assert whole > 3 * 8 * 2**20, whole
    assert blocked < whole / 3, (blocked, whole)


@pytest.mark.parametrize("bad", [0, -4, 2.5, True])
def test_bad_chunk_is_refused_in_one_line(bad):
    with pytest.raises(ConfigError, match=r"model.attention_query_chunk=.*positive integer"):
        M.ModelConfig.tiny(attention_query_chunk=bad)
