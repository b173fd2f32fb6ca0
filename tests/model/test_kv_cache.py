"""KV cache: prefill then one token at a time gives the full forward's logits."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import model as M

from . import helpers

# Cached and full forwards do the same float32 math with different shapes (the cached path
# attends over S slots, masked); observed max |diff| ~2e-7 on O(1) logits. 1e-5 is the bar.
ATOL = 1e-5
PROMPT, STEPS, SLOTS = 6, 5, 16


@pytest.fixture(scope="module")
def lm(hf_untied):
    return M.load_hf(hf_untied.path)


TRACES = []  # shapes seen while tracing ``_step``: one entry per compilation


@functools.partial(jax.jit, static_argnums=0)
def _step(graphdef, params, cache, ids, valid, positions, index):
    TRACES.append(ids.shape)  # runs only while tracing
    return nnx.merge(graphdef, params)(ids, valid, positions, cache=cache, cache_index=index)


def decode_logits(lm, ids, lengths, total_prompt):
    """Prefill ``total_prompt`` left-padded tokens, then feed the rest of ``ids`` one by one.

    Returns logits [B, T, V] assembled from the prefill and each step; ``cache_index`` is traced,
    so the step compiles once.
    """
    b, t = ids.shape
    mask, _ = helpers.left_padded(lengths, total_prompt)
    full_mask = np.concatenate([mask, np.ones((b, t - total_prompt), np.int32)], axis=1)
    positions = np.clip(np.cumsum(full_mask, axis=1) - 1, 0, None).astype(np.int32)
    valid = np.zeros((b, SLOTS), bool)
    graphdef, params = nnx.split(lm, nnx.Param)
    step = functools.partial(_step, graphdef)
    traces_before = len(TRACES)
    cache = M.init_cache(lm.config, b, SLOTS)
    cfg = lm.config
    assert len(cache.k) == len(cache.v) == cfg.num_hidden_layers
    kh, hd = cfg.num_key_value_heads, cfg.head_dim
    assert cache.k[0].shape == (b, kh, hd, SLOTS) and cache.v[0].shape == (b, kh, SLOTS, hd)
    valid[:, :total_prompt] = mask.astype(bool)
    logits, cache = step(
        params,
        cache,
        jnp.asarray(ids[:, :total_prompt]),
        jnp.asarray(valid),
        jnp.asarray(positions[:, :total_prompt]),
        jnp.int32(0),
    )
    out = [np.asarray(logits)]
    for i in range(total_prompt, t):
        valid[:, i] = True
        logits, cache = step(
            params,
            cache,
            jnp.asarray(ids[:, i : i + 1]),
            jnp.asarray(valid),
            jnp.asarray(positions[:, i : i + 1]),
            jnp.int32(i),
        )
        out.append(np.asarray(logits))
    # At most the prefill shape and one step shape compile: no retrace per cache_index.
    assert len(TRACES) - traces_before <= 2
    return np.concatenate(out, axis=1), full_mask, positions


def test_prefill_then_steps_equal_full_forward(lm):
    ids = helpers.random_ids(3, PROMPT + STEPS, seed=31)
    stepped, mask, positions = decode_logits(lm, ids, [PROMPT] * 3, PROMPT)
    full = helpers.forward(lm, ids)
    np.testing.assert_allclose(stepped, full, atol=ATOL, rtol=0)


def test_left_padded_prompts(lm, hf_untied):
    # Ragged prompts (6, 3 and 1 real tokens), left-padded, then shared decode steps.
    ids = helpers.random_ids(3, PROMPT + STEPS, seed=32)
    stepped, mask, positions = decode_logits(lm, ids, [PROMPT, 3, 1], PROMPT)
    full = helpers.forward(lm, ids, mask, positions)
    real = mask.astype(bool)
    np.testing.assert_allclose(stepped[real], full[real], atol=ATOL, rtol=0)
    # Independently of our own full forward: transformers on the same inputs.
    ref = helpers.torch_logits(hf_untied.torch_model, ids, mask, positions)
    np.testing.assert_allclose(stepped[real], ref[real], atol=1e-4, rtol=0)


def test_cache_is_written_at_cache_index(lm):
    # The T new tokens land at slots [index, index + T); other slots keep what they held.
    ids = jnp.asarray(helpers.random_ids(1, 3, seed=33))
    cache = M.init_cache(lm.config, 1, SLOTS)
    valid = jnp.zeros((1, SLOTS), bool).at[:, 4:7].set(True)
    _, new = lm(ids, valid, jnp.arange(3)[None], cache=cache, cache_index=4)
    k = np.stack(new.k)  # [L, B, K, H, S]
    v = np.stack(new.v)  # [L, B, K, S, H]
    assert np.abs(k[..., 4:7]).min() > 0 and np.abs(v[..., 4:7, :]).min() > 0
    assert not k[..., :4].any() and not k[..., 7:].any()
    assert not v[..., :4, :].any() and not v[..., 7:, :].any()
    # Keys of the first tokens equal those the full prefix would write at slot 0.
    _, ref = lm(ids, jnp.zeros((1, SLOTS), bool).at[:, :3].set(True), cache=cache, cache_index=0)
    np.testing.assert_allclose(k[..., 4:7], np.stack(ref.k)[..., :3], atol=1e-6, rtol=0)
    np.testing.assert_allclose(v[..., 4:7, :], np.stack(ref.v)[..., :3, :], atol=1e-6, rtol=0)


def test_bfloat16_cache_dtype(hf_untied):
    lm16 = M.load_hf(hf_untied.path, dtype="bfloat16")
    cache = M.init_cache(lm16.config, 1, 8)
    assert all(a.dtype == jnp.bfloat16 for a in cache.k + cache.v)
    assert M.init_cache(lm16.config, 1, 8, dtype=jnp.float32).k[0].dtype == jnp.float32


def test_unrolled_layers_cache_equals_full_forward(hf_untied):
    # scan_layers=False: prefill runs the layers unrolled too (decode always does).
    lm = M.load_hf(hf_untied.path, scan_layers=False)
    ids = helpers.random_ids(2, PROMPT + STEPS, seed=34)
    stepped, _, _ = decode_logits(lm, ids, [PROMPT, 4], PROMPT)
    mask, _ = helpers.left_padded([PROMPT, 4], PROMPT)
    full_mask = np.concatenate([mask, np.ones((2, STEPS), np.int32)], axis=1)
    positions = np.clip(np.cumsum(full_mask, axis=1) - 1, 0, None).astype(np.int32)
    full = helpers.forward(lm, ids, full_mask, positions)
    real = full_mask.astype(bool)
    np.testing.assert_allclose(stepped[real], full[real], atol=ATOL, rtol=0)


def test_bfloat16_cache_is_written_in_place_as_bits(hf_untied):
    """A bfloat16 cache is written as its bits: XLA:CPU runs no bfloat16 dynamic-update-slice
    and used to convert every layer's whole cache to float32 and back at each decode step. The
    compiled step writes uint16 slots and no float32 cache, and the slots written hold the new
    keys and values exactly (the float32 cache's values, rounded once to bfloat16)."""
    lm16 = M.load_hf(hf_untied.path, dtype="bfloat16")
    graphdef, params = nnx.split(lm16)
    cache = M.init_cache(lm16.config, 2, SLOTS)
    ids = jnp.asarray(helpers.random_ids(2, 1, seed=35))
    valid = jnp.zeros((2, SLOTS), bool).at[:, :4].set(True)
    args = (graphdef, params, cache, ids, valid, jnp.full((2, 1), 3), jnp.int32(3))
    hlo = _step.lower(*args).compile().as_text()
    writes = [line for line in hlo.splitlines() if "dynamic-update-slice(" in line]
    assert writes and all("= u16[" in line for line in writes), writes
    _, new = _step(*args)
    cache32 = M.init_cache(lm16.config, 2, SLOTS, dtype=jnp.float32)  # same step, float32 slots
    _, ref = _step(graphdef, params, cache32, *args[3:])
    for got, want in zip(new.k + new.v, ref.k + ref.v, strict=True):
        np.testing.assert_array_equal(
            np.asarray(got, np.float32), np.asarray(want.astype(jnp.bfloat16), np.float32)
        )
