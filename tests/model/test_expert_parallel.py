"""Expert parallelism (``model.expert_parallel``) is exact: on fake CPU devices, a tiny Qwen3-MoE
whose experts are split over the ``expert`` mesh axis gives one device's logits, log-probs and
GRPO gradient, with routing replay on and off, packed rows with shared prompts, and LoRA.

Three meshes of 4 devices, each with its own batch: (expert=4) on left-padded rows; (expert=2,
fsdp=2) on packed rows with shared prompts and forced routes (replay, some tokens live);
(data=2, expert=2) on the same packed rows with LoRA adapters and live routing. Tolerance 1e-5:
float32 everywhere, the only difference is the order of the sums (the ring adds the devices'
partial outputs; the batch shards' gradients are reduced), ~1e-7 observed.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxrlvr import model as M
from jaxrlvr import rollout
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import engine, grpo, loss_config, step
from jaxrlvr.algos import state as state_lib
from jaxrlvr.model import expert_parallel, lora, moe

from . import helpers

CFG = M.ModelConfig(
    vocab_size=64,
    model_type="qwen3_moe",
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    norm_topk_prob=True,
)
LORA = lora.LoRAConfig(rank=4, alpha=8.0)
B, T, MICRO = 8, 16, 2


def _plain_batch():
    rng = np.random.default_rng(0)
    full = rng.integers(0, CFG.vocab_size, (B, T + 1)).astype(np.int32)
    resp = rng.integers(2, 10, B)
    pos = np.arange(T)[None, :]
    return batch_lib.Batch(
        input_ids=full[:, :-1],
        attention_mask=(pos < (4 + resp)[:, None]).astype(np.int32),
        labels=full[:, 1:],
        loss_mask=(pos >= 3) & (pos < (3 + resp)[:, None]),
        advantages=rng.normal(size=B).astype(np.float32),
        old_logp=(-4.0 + 0.3 * rng.normal(size=(B, T))).astype(np.float32),
    )


def _packed_batch(replay: bool):
    """4 prompts x 2 completions packed with shared prompts (``rollout.pack``); with ``replay``
    random distinct expert pairs forced on every token but the first of each sequence."""
    rng = np.random.default_rng(1)
    groups = [list(rng.integers(1, CFG.vocab_size, n)) for n in (3, 5, 4, 6)]
    prompts = [p for p in groups for _ in range(2)]
    comps = [list(rng.integers(1, CFG.vocab_size, n)) for n in (4, 2, 5, 3, 6, 2, 3, 4)]
    routes = None
    if replay:
        routes = []
        for p, c in zip(prompts, comps):
            n = len(p) + len(c) - 1
            r = np.stack([rng.permutation(8)[:2] for _ in range(n * 2)]).reshape(n, 2, 2)
            r[0] = -1  # live top-k on the first token
            routes.append(r.astype(np.int8))
        for i in range(1, 8, 2):  # a group's prompt routes are one prefill's
            n = len(prompts[i]) - 1
            routes[i][:n] = routes[i - 1][:n]
    packed = rollout.pack(
        prompts,
        comps,
        pad_id=0,
        segments=True,
        share_prompts=2,
        row_tokens=T,
        row_multiple=8,
        routes=routes,
    )
    n = len(prompts)
    return rollout.to_batch(
        packed,
        advantages=rng.normal(size=n).astype(np.float32),
        routes=packed.routes,
    )


CASES = {  # name: (mesh sizes, batch, lora)
    "expert4": (dict(expert=4), _plain_batch, False),
    "expert2_fsdp2_packed_replay": (dict(fsdp=2, expert=2), lambda: _packed_batch(True), False),
    "data2_expert2_packed_lora": (
        dict(data=2, fsdp=1, expert=2),
        lambda: _packed_batch(False),
        True,
    ),
}


def _run(mesh, batch, with_lora):
    """(logits [B, T, V], log-probs [B, T], the GRPO gradient, the new state) on ``mesh``, in
    one program: the forward, then the trainer's GRPO update (``grpo.make_grpo_update``, two
    microbatches) with plain SGD at learning rate 1, so params - new params is the gradient of
    the GRPO loss (of the adapters, under LoRA)."""
    cfg = dataclasses.replace(CFG, lora=LORA) if with_lora else CFG
    lm = M.init_model(cfg, seed=0, mesh=mesh)
    graphdef, params = nnx.split(lm, nnx.Param)
    if with_lora:
        b = helpers.random_lora_b(nnx.state(lm, lora.LoRAParam), 3)
        params = jax.device_put(nnx.State.merge(params, b), M.param_shardings(params, mesh))
    tx = optax.sgd(1.0)
    gcfg = grpo.GRPOUpdateConfig(
        loss=loss_config.PolicyLossConfig(aggregation="token_mean"), num_microbatches=MICRO
    )
    upd = grpo.make_grpo_update(graphdef, tx, gcfg, mesh=mesh)
    state = step.shard_state(state_lib.TrainState.create(graphdef, params, tx), mesh)

    @jax.jit
    def run(state, b):
        m = nnx.merge(graphdef, state.params)
        logp, _, hidden = engine.token_logprobs(m, b)
        new, metrics = upd(state, b)
        return m.lm_logits(hidden), logp, new, metrics

    logits, logp, new, metrics = run(state, step.shard_batch(batch, mesh))
    assert float(metrics["nonfinite"]) == 0
    before = jax.tree.map(np.asarray, lora.split_trainable(state.params)[0])
    after = jax.tree.map(np.asarray, lora.split_trainable(new.params)[0])
    grad = jax.tree.map(lambda a, b: a - b, before, after)
    return np.asarray(logits), np.asarray(logp), grad, new


def _mesh(sizes, n):
    return M.make_mesh(M.MeshConfig(**{"fsdp": 1, **sizes}), jax.devices()[:n])


@pytest.fixture(scope="module")
def single():
    """One device's results, per case (computed on first use)."""
    cache = {}

    def get(name):
        if name not in cache:
            _, make, with_lora = CASES[name]
            cache[name] = _run(_mesh({}, 1), make(), with_lora)
        return cache[name]

    return get


@pytest.mark.slow  # 30-70 s a case at load ~3, 90-220 s at load ~11 (two compiles each)
@pytest.mark.parametrize("name", list(CASES))
def test_expert_parallel_equals_one_device(single, name):
    sizes, make, with_lora = CASES[name]
    batch = make()
    mesh = _mesh(sizes, 4)
    logits, logp, grad, state = _run(mesh, batch, with_lora)
    ref_logits, ref_logp, ref_grad, _ = single(name)
    real = np.asarray(batch.attention_mask).astype(bool)
    np.testing.assert_allclose(logits[real], ref_logits[real], atol=1e-5, rtol=0)
    np.testing.assert_allclose(logp[real], ref_logp[real], atol=1e-5, rtol=0)
    leaves, ref_leaves = jax.tree.leaves(grad), jax.tree.leaves(ref_grad)
    assert len(leaves) == len(ref_leaves)
    for a, b in zip(leaves, ref_leaves):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
    # Something moved, and the experts really are split by expert in the trained state.
    assert max(float(np.abs(a).max()) for a in leaves) > 1e-3
    gate = state.params["model"]["layers"]["mlp"]["experts"]["gate_proj"].get_value()
    assert "expert" in jax.tree.leaves(gate.sharding.spec[1])
    assert (
        gate.addressable_shards[0].data.shape[1]
        == 8 // mesh.shape["expert"] // (mesh.shape["fsdp"])
    )


def test_dispatch_follows_the_kernel_and_checks_refuse():
    assert expert_parallel.dispatch_for("sorted_blocks") == "ring"
    assert expert_parallel.dispatch_for("ragged_dot") == "ragged"
    assert expert_parallel.dispatch_for("auto") == "ring"  # on this CPU
    expert_parallel.check(CFG, 4)
    with pytest.raises(ValueError, match=r"mesh.expert=3 does not divide num_experts=8"):
        expert_parallel.check(CFG, 3)
    with pytest.raises(ValueError, match=r"mesh.expert=2: expert parallelism needs a MoE model"):
        expert_parallel.check(M.ModelConfig.tiny(), 2)
    with pytest.raises(ValueError, match=r"ragged_all_to_all dispatch does not compile on XLA:CPU"):
        expert_parallel.check(dataclasses.replace(CFG, moe_impl="ragged_dot"), 2)
    expert_parallel.check(dataclasses.replace(CFG, moe_impl="ragged_dot"), 2, backend="tpu")
    assert expert_parallel.kernel_specs(_mesh(dict(expert=2), 2))[1] == P("expert")


def _ragged_all_to_all_from_gathers(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``jax.lax.ragged_all_to_all``'s documented semantics built from all-gathers (XLA:CPU
    cannot compile the op, jax-ml/jax#34755): on receiver j, for every source i,
    output[output_offsets_i[j] + r] = operand_i[input_offsets_i[j] + r] for r < send_sizes_i[j]."""
    ep, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)
    starts = jax.lax.all_gather(input_offsets, axis_name)[:, me]
    sizes = jax.lax.all_gather(send_sizes, axis_name)[:, me]
    lands = jax.lax.all_gather(output_offsets, axis_name)[:, me]
    pos = jnp.arange(output.shape[0])
    for i in range(ep):
        r = pos - lands[i]
        take = (r >= 0) & (r < sizes[i])
        src = jnp.clip(starts[i] + r, 0, operand.shape[0] - 1)
        output = jnp.where(take[:, None], operands[i][src], output)
    return output


@pytest.mark.slow  # ~60 s at load ~16 (three compiles of a 4-device shard_map and its grad)
def test_ragged_dispatch_bookkeeping(monkeypatch):
    """The accelerators' dispatch (sizes, offsets, the received rows' experts, the way back),
    with the collective replaced by its semantics from all-gathers: output and gradients equal
    ``moe.dense_experts`` on 4 devices (expert=4, 2 experts each), for a live routing and for
    every slot on one device (the worst-case receive buffer full), one compiled program for
    both. float32, sums in another order: 1e-5 absolute (~6e-6 observed) and 1e-5 relative
    (the skewed kernels' gradients reach ~40)."""
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", _ragged_all_to_all_from_gathers)
    mesh = _mesh(dict(expert=4), 4)
    n, d, f, e, k = 32, 16, 8, 8, 2
    ks = jax.random.split(jax.random.PRNGKey(0), 5)
    x = jax.random.normal(ks[0], (4 * n, d))
    kernels = [
        0.3 * jax.random.normal(kk, s) for kk, s in zip(ks[2:], [(e, d, f)] * 2 + [(e, f, d)])
    ]

    def ours(x, w, ids, *kernels):
        fn = jax.shard_map(
            lambda *a: expert_parallel.routed_experts(*a, impl="ragged_dot", mesh=mesh, split=True),
            mesh=mesh,
            in_specs=(P("expert"),) * 6,
            out_specs=P("expert"),
        )
        return fn(x, ids, w, *kernels)

    def reference(x, w, ids, *kernels):
        return moe.dense_experts(x, ids, w, *kernels)

    def both(fn):
        loss = lambda x, w, ids, *ker: jnp.sum(jnp.sin(fn(x, w, ids, *ker)))  # noqa: E731
        return jax.jit(lambda *a: (fn(*a), jax.grad(loss, argnums=(0, 1, 3, 4, 5))(*a)))

    ours, reference = both(ours), both(reference)
    probs = jax.nn.softmax(3 * jax.random.normal(ks[1], (4 * n, e)))
    skewed = probs.at[:, :2].add(10.0) / 21.0  # every token on experts 0 and 1: all to device 0
    for p in (probs, skewed):
        w, ids = jax.lax.top_k(p, k)
        args = (x, w, ids.astype(jnp.int32), *kernels)
        (y, g), (y_ref, g_ref) = ours(*args), reference(*args)
        np.testing.assert_allclose(y, y_ref, atol=1e-5, rtol=0)
        for a, b in zip(g, g_ref):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    assert bool(jnp.all(ids < 2))  # the skewed case was all on device 0
