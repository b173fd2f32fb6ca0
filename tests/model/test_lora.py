"""LoRA adapters (``model.lora``): the adapted forward, merging, the frozen-base update of every
method, dropout, and PEFT parity both ways (``model.peft``).

Tolerances: logits of our float32 port match transformers' within 1e-4 (``test_parity``'s
bound, logits of order 1); merging changes only the float summation order (W x + s (x A) B versus
(W + s A B) x), well inside the same bound.
"""

import copy
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrlvr import model as M
from jaxrlvr.algos import algorithm, grpo, optim, ppo, preference, sft
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.model import lora, peft

from . import helpers

LORA = lora.LoRAConfig(rank=4, alpha=8.0)
B, T = 8, 12


def _randomize_adapters(params, seed=0, scale=0.2):
    """Non-zero B (and new A) so the adapters change the function."""
    ad = lora.adapters(params)
    leaves, treedef = jax.tree.flatten(ad)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    new = [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge_state(lora.base(params), jax.tree.unflatten(treedef, new))


@pytest.fixture(scope="module")
def adapted(hf_untied):
    """(config, graphdef, params with random adapters) of the untied tiny checkpoint."""
    lm = M.load_hf(hf_untied.path, lora=LORA)
    graphdef, params = nnx.split(lm, nnx.Param)
    return lm.config, graphdef, _randomize_adapters(params)


def test_fresh_adapters_leave_the_function_and_merge_exactly(hf_untied, adapted):
    """B = 0 at creation: the adapted model is the checkpoint. With random adapters, the
    forward with adapters equals the plain model on ``lora.merged`` weights."""
    ids = helpers.random_ids(2, 10)
    fresh = M.load_hf(hf_untied.path, lora=LORA)
    plain = M.load_hf(hf_untied.path)
    np.testing.assert_allclose(helpers.forward(fresh, ids), helpers.forward(plain, ids), atol=0)
    cfg, graphdef, params = adapted
    with_adapters = helpers.forward(nnx.merge(graphdef, params), ids)
    plain_graph, _ = nnx.split(plain, nnx.Param)
    merged = helpers.forward(nnx.merge(plain_graph, lora.merged(cfg.lora, params)), ids)
    assert np.abs(with_adapters - helpers.forward(plain, ids)).max() > 0.1  # they do change it
    np.testing.assert_allclose(with_adapters, merged, atol=1e-4)


def test_adapters_are_float32_beside_a_bfloat16_base(hf_untied):
    lm = M.load_hf(hf_untied.path, lora=LORA, param_dtype="bfloat16", dtype="bfloat16")
    params = nnx.state(lm, nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(lora.adapters(params))} == {jnp.dtype("float32")}
    assert {x.dtype for x in jax.tree.leaves(lora.base(params))} == {jnp.dtype("bfloat16")}


def test_bad_lora_settings_are_one_line_errors():
    with pytest.raises(ValueError, match=r"lora.targets=\['lm_head'\]"):
        lora.LoRAConfig(targets=("lm_head",))
    with pytest.raises(ValueError, match="lora.rank=0"):
        lora.LoRAConfig(rank=0)
    with pytest.raises(ValueError, match="lora.dropout=1.0"):
        lora.LoRAConfig(dropout=1.0)
    assert lora.LoRAConfig(targets="all-linear").targets == lora.TARGETS
    assert lora.LoRAConfig(targets=("v_proj", "q_proj")).targets == ("q_proj", "v_proj")


# ---------------------------------------------------------------------------------------------
# PEFT parity both ways.


def test_peft_loads_ours_and_matches_our_logits(hf_untied, adapted, tmp_path):
    """Our adapter directory, loaded by ``peft.PeftModel`` onto the transformers model, gives
    our logits (float32, 1e-4)."""
    import torch
    from peft import PeftModel

    cfg, graphdef, params = adapted
    peft.save_adapter(cfg, params, tmp_path / "adapter", base_model_name_or_path="tiny")
    written = json.loads((tmp_path / "adapter" / peft.CONFIG_FILE).read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 8.0
    base = copy.deepcopy(hf_untied.torch_model)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    ids = helpers.random_ids(2, 10, seed=3)
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
    ours = helpers.forward(nnx.merge(graphdef, params), ids)
    assert np.abs(theirs - helpers.torch_logits(hf_untied.torch_model, ids)).max() > 0.1
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "down_proj"], "all-linear"])
def test_we_load_what_peft_wrote(hf_untied, tmp_path, targets):
    """An adapter PEFT created (random A and B) and saved, loaded by ``peft.load_peft``: our
    logits match PEFT's (float32, 1e-4); the config's rank, alpha and targets come through."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = copy.deepcopy(hf_untied.torch_model)
    peft_cfg = LoraConfig(
        r=8, lora_alpha=4, target_modules=targets, lora_dropout=0.0, init_lora_weights=False
    )
    model = get_peft_model(base, peft_cfg).eval()
    model.save_pretrained(tmp_path / "theirs")
    ids = helpers.random_ids(2, 10, seed=4)
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
    ours_lm = peft.load_peft(hf_untied.path, tmp_path / "theirs")
    expected = lora.TARGETS if targets == "all-linear" else tuple(targets)
    assert ours_lm.config.lora.targets == tuple(t for t in lora.TARGETS if t in expected)
    assert ours_lm.config.lora.rank == 8 and ours_lm.config.lora.scale == 0.5
    np.testing.assert_allclose(helpers.forward(ours_lm, ids), theirs, atol=1e-4)


def test_unsupported_adapter_settings_are_refused(hf_untied, adapted, tmp_path):
    cfg, _, params = adapted
    peft.save_adapter(cfg, params, tmp_path)
    raw = json.loads((tmp_path / peft.CONFIG_FILE).read_text())
    (tmp_path / peft.CONFIG_FILE).write_text(json.dumps({**raw, "use_dora": True}))
    with pytest.raises(peft.AdapterError, match="use_dora=True is not supported"):
        peft.load_peft(hf_untied.path, tmp_path)
    (tmp_path / peft.CONFIG_FILE).write_text(json.dumps({**raw, "r": 8}))
    with pytest.raises(peft.AdapterError, match="rank=8 but the model's lora.rank=4"):
        peft.load_adapter(tmp_path, cfg, params)


# ---------------------------------------------------------------------------------------------
# Every method trains the adapters only.


def _rollouts(vocab: int, seed: int = 0) -> batch_lib.Batch:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    loss_mask[:, 4:] = 1.0
    return batch_lib.Batch(
        input_ids=ids,
        attention_mask=np.ones((B, T), np.int32),
        labels=np.roll(ids, -1, axis=1),
        loss_mask=loss_mask,
        advantages=rng.normal(size=B).astype(np.float32),
        rewards=rng.normal(size=B).astype(np.float32),
        correct=np.asarray([1, 0, 1, 1, 0, 0, 1, 0], np.float32),
    )


@pytest.fixture(scope="module")
def tiny_lora():
    cfg = M.ModelConfig.tiny(lora=lora.LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "up_proj")))
    graphdef, params = nnx.split(M.init_model(cfg, seed=0), nnx.Param)
    return cfg, graphdef, _randomize_adapters(params, scale=0.05)


def _algo(method, graphdef, params):
    opt = optim.OptimizerConfig(learning_rate=1e-2)
    two = dict(num_microbatches=2)
    if method == "sft":
        return sft.sft_algorithm(graphdef, opt, sft.SFTUpdateConfig(**two))
    if method == "grpo":
        return grpo.grpo_algorithm(graphdef, opt, grpo.GRPOUpdateConfig(**two))
    if method == "ppo":
        shape = jax.eval_shape(lambda p: p, params)
        return ppo.ppo_algorithm(graphdef, opt, ppo.PPOUpdateConfig(**two), params_shape=shape)
    loss = preference.PreferenceLossConfig(kind="dpo")
    return preference.preference_algorithm(
        graphdef, opt, preference.PreferenceUpdateConfig(loss=loss, **two)
    )


def _sft_loss(graphdef, join, batch):
    """The SFT loss (mean NLL over loss tokens) as a function of the adapters alone."""

    def loss(p):
        lm = nnx.merge(graphdef, join(p))
        logits = lm(batch.input_ids, batch.attention_mask)
        logp = jax.nn.log_softmax(logits, -1)
        tok = jnp.take_along_axis(logp, batch.labels[..., None], -1)[..., 0]
        return -jnp.sum(tok * batch.loss_mask) / jnp.sum(batch.loss_mask)

    return loss


@pytest.mark.slow  # four methods compiled: ~45 s on the loaded 2-core machine
# Expert iteration is SFT's update on filtered rows (the same make_update call): not repeated.
@pytest.mark.parametrize("method", ["sft", "grpo", "ppo", "dpo"])
def test_every_method_trains_only_the_adapters(tiny_lora, method):
    """One update of each method's record on a LoRA model: the base leaves come back bitwise
    unchanged, every adapter moves, and the optimiser state holds exactly the adapters' sizes
    (AdamW: two moments per adapter element). For SFT, the update's pre-clip ``grad_norm`` is the
    norm of d loss / d adapters computed directly (2 microbatches summed: 1e-5 relative for
    float32 summation order)."""
    cfg, graphdef, params = tiny_lora
    algo = _algo(method, graphdef, params)
    state = algo.init(jax.tree.map(jnp.copy, params), 0)
    opt_elems = sum(x.size for x in jax.tree.leaves(state.opt_state) if x.ndim > 0)
    assert opt_elems == 2 * lora.num_adapter_params(params)
    rollouts = _rollouts(cfg.vocab_size)
    if method == "dpo":
        rollouts = rollouts.replace(advantages=None, rewards=None, correct=None)
    batch, _ = algo.prepare(state, algorithm.select_fields(rollouts, algo.rollout_spec))
    new, metrics = jax.jit(algo.update)(state, batch)
    assert float(metrics["nonfinite"]) == 0.0
    for a, b in zip(jax.tree.leaves(lora.base(params)), jax.tree.leaves(lora.base(new.params))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    moved = zip(jax.tree.leaves(lora.adapters(params)), jax.tree.leaves(lora.adapters(new.params)))
    for a, b in moved:
        assert np.abs(np.asarray(a) - np.asarray(b)).max() > 0
    if method == "sft":
        trainable, join = lora.split_trainable(params)
        g = jax.grad(_sft_loss(graphdef, join, batch))(trainable)
        norm = float(jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g))))
        assert float(metrics["grad_norm"]) == pytest.approx(norm, rel=1e-5)


def test_the_reference_holds_the_adapters_only_and_stays_the_initial_policy(tiny_lora):
    """With adapters, the KL / DPO reference keeps a copy of the initial adapters only (the
    frozen base is the policy's own, not held twice), and its log-probs stay those of the
    initial policy after the policy's adapters move (exactly: the same computation)."""
    cfg, graphdef, params = tiny_lora
    algo = _algo("dpo", graphdef, params)
    state = algo.init(jax.tree.map(jnp.copy, params), 0)
    held = sum(x.size for x in jax.tree.leaves(state.ref_params))
    assert held == lora.num_adapter_params(params)
    rollouts = _rollouts(cfg.vocab_size).replace(advantages=None, rewards=None, correct=None)
    rollouts = algorithm.select_fields(rollouts, algo.rollout_spec)
    before, _ = algo.prepare(state, rollouts)
    trainable, join = lora.split_trainable(state.params)
    moved = state.replace(params=join(jax.tree.map(lambda x: x + 0.3, trainable)))
    after, _ = algo.prepare(moved, rollouts)
    np.testing.assert_array_equal(np.asarray(before.ref_logp), np.asarray(after.ref_logp))
    policy, _ = algo.prepare(moved.replace(ref_params=lora.trainable(moved.params)), rollouts)
    assert np.abs(np.asarray(policy.ref_logp) - np.asarray(before.ref_logp)).max() > 1e-3


def test_dropout_applies_in_updates_only(tiny_lora):
    """With ``dropout`` 0.5 the update's loss depends on the state's rng (a fresh mask per
    step) and differs from the dropout-free loss; model calls outside ``lora.dropout_rng``
    (samplers, old / reference log-probs) drop nothing: they equal the dropout-free model's."""
    cfg, graphdef, params = tiny_lora
    drop = lora.LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "up_proj"), dropout=0.5)
    abstract = nnx.eval_shape(lambda: M.Qwen2ForCausalLM(cfg.replace(lora=drop)))
    drop_graph, _ = nnx.split(abstract, nnx.Param)
    ids = jnp.asarray(helpers.random_ids(2, 8, vocab=cfg.vocab_size))
    np.testing.assert_array_equal(
        np.asarray(nnx.merge(drop_graph, params)(ids)), np.asarray(nnx.merge(graphdef, params)(ids))
    )
    algo = sft.sft_algorithm(drop_graph, optim.OptimizerConfig(learning_rate=1e-3))
    rollouts = algorithm.select_fields(_rollouts(cfg.vocab_size), algo.rollout_spec)
    batch, _ = algo.prepare(None, rollouts)
    update = jax.jit(algo.update)
    losses = [
        float(update(algo.init(jax.tree.map(jnp.copy, params), seed), batch)[1]["loss"])
        for seed in (0, 1)
    ]
    trainable, join = lora.split_trainable(params)
    no_drop = float(jax.jit(_sft_loss(graphdef, join, batch))(trainable))
    assert losses[0] != losses[1]
    assert abs(losses[0] - no_drop) > 1e-4 and abs(losses[1] - no_drop) > 1e-4


def test_adapters_shard_like_their_kernels():
    """Golden partition specs on a (fsdp 4, tensor 2) mesh: A shares the kernel's input axes
    (embed over fsdp, heads over tensor), B its output axes; the rank axis is replicated. Shapes
    only (no compile)."""
    cfg = M.ModelConfig.tiny(lora=lora.LoRAConfig(rank=4))
    mesh = M.make_mesh(M.MeshConfig(data=1, fsdp=4, tensor=2), jax.devices()[:8])
    abstract = nnx.eval_shape(lambda: M.Qwen2ForCausalLM(cfg, mesh=mesh))
    specs = M.param_partition_specs(lora.adapters(nnx.state(abstract, nnx.Param)), mesh)
    attn, mlp = specs["model"]["layers"]["self_attn"], specs["model"]["layers"]["mlp"]
    P = jax.sharding.PartitionSpec
    assert attn["q_proj"]["lora_a"] == P(None, "fsdp")  # [L, D, r]
    assert attn["q_proj"]["lora_b"] == P(None, None, "tensor")  # [L, r, N, H]
    assert attn["o_proj"]["lora_a"] == P(None, "tensor")  # [L, N, H, r]
    assert attn["o_proj"]["lora_b"] == P(None, None, "fsdp")  # [L, r, D]
    assert mlp["up_proj"]["lora_b"] == P(None, None, "tensor")  # [L, r, F]
    assert mlp["down_proj"]["lora_a"] == P(None, "tensor")  # [L, F, r]
