"""Sharding equivalence: GRPO updates on a (data=2, fsdp=2, tensor=2) mesh of 8 fake CPU devices
give the same params as on one device, with params and optimiser state really sharded; in one
process, ``step.shard_local_batch`` builds the same global batch as ``step.shard_batch``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrlvr import model as M
from jaxrlvr.algos import algorithm, grpo, loss_config, optim, step
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import state as state_lib

B, T = 8, 16


def _batches(n):
    rng = np.random.default_rng(0)
    out = []
    for _ in range(n):
        full = rng.integers(0, 128, (B, T + 1)).astype(np.int32)
        resp = rng.integers(2, 10, B)
        pos = np.arange(T)[None, :]
        out.append(
            batch_lib.Batch(
                input_ids=full[:, :-1],
                attention_mask=(pos < (4 + resp)[:, None]).astype(np.int32),
                labels=full[:, 1:],
                loss_mask=(pos >= 3) & (pos < (3 + resp)[:, None]),
                advantages=rng.normal(size=B).astype(np.float32),
                old_logp=(-5.0 + 0.3 * rng.normal(size=(B, T))).astype(np.float32),
            )
        )
    return out


def _run(mesh, batches, logprob_chunk_size=None, remat=False, attention_query_chunk=None):
    cfg = M.ModelConfig.tiny(remat=remat, attention_query_chunk=attention_query_chunk)
    lm = M.init_model(cfg, seed=0, mesh=mesh)
    graphdef, params = nnx.split(lm, nnx.Param)
    # Adam's eps = 1e-4 instead of 1e-8: an update is lr * g / (|g| + eps), whose sensitivity to
    # float rounding of a near-zero gradient is up to lr / eps. With 1e-8 that turns ~1e-9
    # reduction-order noise into ~1e-4 parameter differences on a handful of elements; with
    # 1e-4 it stays below 1e-7, so the comparison tests the sharding, not Adam's conditioning.
    tx = optim.make_optimizer(optim.OptimizerConfig(learning_rate=1e-3, eps=1e-4))
    gcfg = grpo.GRPOUpdateConfig(
        loss=loss_config.PolicyLossConfig(aggregation="token_mean"),
        num_microbatches=2,
        logprob_chunk_size=logprob_chunk_size,
    )
    upd = grpo.make_grpo_update(graphdef, tx, gcfg)
    state = step.shard_state(state_lib.TrainState.create(graphdef, params, tx), mesh)
    ssh = step.state_shardings(state, mesh)
    # The bare update as a record whose rollouts are its batch, compiled as the driver compiles.
    record = algorithm.Algorithm(
        name="grpo",
        init=None,
        prepare=lambda state, batch: (batch, {}),
        update=upd,
        rollout_spec=upd.batch_spec,
    )
    compiled = step.CompiledAlgorithm(record, mesh, ssh)
    for b in batches:
        state, metrics = compiled.update(state, compiled.prepare(state, b)[0])
        assert float(metrics["nonfinite"]) == 0
    return state, ssh


def test_three_grpo_steps_sharded_equal_single_device():
    assert len(jax.devices()) == 8
    batches = _batches(3)
    one, _ = _run(M.make_mesh(M.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1]), batches)
    mesh8 = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    eight, ssh = _run(mesh8, batches)

    # float32 with different reduction orders across shards: differences ~1e-7 per step.
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
    assert int(eight.step) == 3

    # Really sharded: the MLP kernel [L, D, F] splits D over fsdp and F over tensor, both in
    # the params and in Adam's moments; each device holds a quarter.
    kernel = eight.params["model"]["layers"]["mlp"]["up_proj"]["kernel"]
    assert kernel.get_value().sharding.spec == PartitionSpec(None, "fsdp", "tensor")
    assert kernel.get_value().addressable_shards[0].data.shape == (2, 32, 64)
    adam = eight.opt_state[1][0]  # chain(clip, adamw) -> adamw -> ScaleByAdamState
    for moment in (adam.mu, adam.nu):
        mk = moment["model"]["layers"]["mlp"]["up_proj"]["kernel"].get_value()
        assert mk.sharding.spec == PartitionSpec(None, "fsdp", "tensor")
        assert mk.addressable_shards[0].data.shape == (2, 32, 64)
    n_sharded = sum(
        not s.is_fully_replicated
        for s in jax.tree.leaves(ssh.params) + jax.tree.leaves(ssh.opt_state)
    )
    assert n_sharded >= 2 * 10  # params and both moments (~10 sharded kernels each)

    # The state's shardings are the requested ones after the steps.
    got = jax.tree.map(lambda x: x.sharding, eight)
    assert jax.tree.leaves(got) == jax.tree.leaves(ssh)
    assert jnp.dtype(eight.step.dtype) == jnp.int32


def test_shard_local_batch_equals_shard_batch_in_one_process():
    """With one process, every row is local: the same global arrays, laid out the same way."""
    mesh8 = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    batch = _batches(1)[0]
    np.testing.assert_array_equal(step.process_batch_rows(mesh8, B), np.arange(B))
    local, full = step.shard_local_batch(batch, mesh8), step.shard_batch(batch, mesh8)
    assert jax.tree.structure(local) == jax.tree.structure(full)
    for a, b in zip(jax.tree.leaves(local), jax.tree.leaves(full)):
        assert a.shape == b.shape and a.dtype == b.dtype and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert len({s.data.shape for s in a.addressable_shards}) == 1  # B / 4 rows per shard
    assert local.input_ids.addressable_shards[0].data.shape == (B // 4, T)


@pytest.mark.parametrize(
    "change, match",
    [
        # 4 batch shards over (data=2, fsdp=2), all held by this one process.
        (lambda b: jax.tree.map(lambda x: x[:6], b), "6 local rows do not split evenly over the 4"),
        (lambda b: b.replace(advantages=b.advantages[:4]), "different row counts"),
    ],
)
def test_shard_local_batch_rejects_rows_that_do_not_split(change, match):
    mesh8 = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    with pytest.raises(batch_lib.BatchError, match=match):
        step.shard_local_batch(change(_batches(1)[0]), mesh8)
    with pytest.raises(batch_lib.BatchError, match="not divisible by the 4 batch shards"):
        step.process_batch_rows(mesh8, 6)


@pytest.mark.slow  # two update compilations: ~1 min on 2 shared cores
def test_chunked_vocab_parallel_grpo_sharded_equals_single_device_unchunked():
    """Chunked log-probs on the 8-device mesh run the vocabulary-parallel head (rows and
    vocabulary over data x fsdp); the parameters after two steps match the unchunked update on
    one device as closely as the plain sharded update does. The sharded run has remat on, so its
    layer and head gradients accumulate in place (``model.grad_sink``) on sharded accumulators,
    and runs attention over blocks of 6 queries (``model.attention_query_chunk``; heads split
    over tensor), against one device's attention over all 16 at once."""
    batches = _batches(2)
    one, _ = _run(M.make_mesh(M.MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1]), batches)
    mesh8 = M.make_mesh(M.MeshConfig(data=2, fsdp=2, tensor=2))
    eight, _ = _run(mesh8, batches, logprob_chunk_size=5, remat=True, attention_query_chunk=6)
    for a, b in zip(jax.tree.leaves(one.params), jax.tree.leaves(eight.params)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=0)
