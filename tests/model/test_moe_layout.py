"""Qwen3-MoE layouts that mix dense and sparse layers (``decoder_sparse_step``,
``mlp_only_layers``): the layout against transformers' layers, logits within 1e-4 of
``Qwen3MoeForCausalLM`` (float32) with the periodic layout scanned by its period and the
irregular one scanned by runs, and unrolled; the weight round trip both ways; the JaxSampler's
KV-cache decode against one full forward, and its recorded routes (-1 on the dense layers)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from jaxrlvr import model as M
from jaxrlvr.algos import routing
from jaxrlvr.model import decoder, moe
from jaxrlvr.sampling import base, jax_sampler

from . import helpers

# As test_qwen3: float32 on both sides in a different order, observed max |diff| ~4e-6 on O(1)
# logits; a dense MLP run where the routed block belongs (or the reverse) moves them by O(1).
F32_ATOL = 1e-4
B, T = 3, 16

# (overrides, sparse layers, scan segments): decoder_sparse_step=2 on 4 layers is periodic (one
# scan over the period [dense, sparse]); mlp_only_layers=[0] on 3 layers is not (a scan per run).
LAYOUTS = {
    "step2": (
        {"num_hidden_layers": 4, "decoder_sparse_step": 2},
        (False, True, False, True),
        (((False, True), 2),),
    ),
    "only0": (
        {"num_hidden_layers": 3, "mlp_only_layers": [0]},
        (False, True, True),
        (((False,), 1), ((True,), 2)),
    ),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for i, (name, (overrides, _, _)) in enumerate(LAYOUTS.items()):
        path = tmp_path_factory.mktemp(name)
        ckpt = helpers.write_checkpoint(
            path, tie=False, seed=40 + i, family="qwen3_moe", **overrides
        )
        out[name] = (ckpt, M.load_hf(path))
    return out


def test_layout_follows_transformers(ckpts):
    for name, (ckpt, lm) in ckpts.items():
        _, sparse, segments = LAYOUTS[name]
        cfg = lm.config
        theirs = tuple(type(layer.mlp).__name__ for layer in ckpt.torch_model.model.layers)
        assert theirs == tuple(
            "Qwen3MoeSparseMoeBlock" if s else "Qwen3MoeMLP" for s in cfg.sparse_layers
        )
        assert cfg.sparse_layers == sparse and cfg.mixed_layers
        assert decoder.layer_segments(cfg) == segments
        stacks = cfg.layer_stacks
        assert stacks["layers"] == tuple(i for i, s in enumerate(sparse) if s)
        assert stacks["dense_layers"] == tuple(i for i, s in enumerate(sparse) if not s)
        assert lm.model.dense_layers.mlp.gate_proj.kernel.shape[0] == len(stacks["dense_layers"])
        assert cfg.num_params() == sum(p.numel() for p in ckpt.torch_model.parameters())
        assert M.param_count(lm) == cfg.num_params()
        assert M.ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg


@pytest.mark.parametrize(
    "name, scan",
    [("step2", True), ("step2", False), ("only0", True)],
    ids=["step2-scan", "step2-unrolled", "only0-scan"],
)
def test_logits_match_transformers(ckpts, name, scan):
    """The periodic layout scanned and unrolled, the irregular one scanned by runs (the unrolled
    loop is one code path for every layout)."""
    ckpt, lm = ckpts[name]
    if not scan:
        lm = M.load_hf(ckpt.path, scan_layers=False)
    ids = helpers.random_ids(B, T, seed=1)
    mask, positions = helpers.left_padded([T, 11, 5], T)
    ref = helpers.torch_logits(ckpt.torch_model, ids, mask, positions)
    assert ref.std() > 0.5
    out = helpers.forward(lm, ids, mask, positions)
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=F32_ATOL, rtol=0)


def test_round_trip_bit_identical_both_ways(ckpts, tmp_path):
    """HF -> ours -> HF gives the same tensors bit for bit (the dense layers' mlp.gate_proj /
    up_proj / down_proj, the sparse layers' router and experts), transformers rebuilds the same
    layout from our config.json, and ours -> HF -> ours holds the same arrays."""
    import transformers

    ckpt, lm = ckpts["only0"]
    M.save_hf(lm, tmp_path)
    theirs = load_file(str(ckpt.path / "model.safetensors"))
    ours = load_file(str(tmp_path / "model.safetensors"))
    assert set(ours) == set(theirs)
    assert "model.layers.0.mlp.gate_proj.weight" in ours
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in ours
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["mlp_only_layers"] == [0] and config["decoder_sparse_step"] == 1
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    ids = helpers.random_ids(2, 8, seed=2)
    np.testing.assert_array_equal(
        helpers.torch_logits(reloaded, ids), helpers.torch_logits(ckpt.torch_model, ids)
    )
    again = nnx.to_flat_state(nnx.state(M.load_hf(tmp_path), nnx.Param))
    mine = nnx.to_flat_state(nnx.state(lm, nnx.Param))
    assert [p for p, _ in again] == [p for p, _ in mine]
    for (path, a), (_, b) in zip(mine, again):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))


@jax.jit
def _full_forward(params, ids, mask):
    graphdef = nnx.graphdef(_SAMPLER_LM)
    logits, router = nnx.merge(graphdef, params)(ids, mask, with_router=True)
    return jax.nn.log_softmax(logits, axis=-1), router


_SAMPLER_LM = None


def test_sampler_decode_and_routes(ckpts):
    """The JaxSampler (prefill with a KV cache, then one-token decode) on the step2 layout: its
    log-probs equal one full forward's (1e-5), its routes equal that forward's expert ids, -1 on
    the dense layers (the ``routes`` layout: every layer), and the router statistics cover the
    sparse layers only."""
    global _SAMPLER_LM
    _, lm = ckpts["step2"]
    _SAMPLER_LM = lm
    cfg = lm.config
    prompts = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    sampler = jax_sampler.JaxSampler(lm, eos_token_ids=[])
    params = base.SamplingParams(max_tokens=6, temperature=1.0, seed=0, logprobs=True)
    completions = sampler.generate(prompts, 1, params)
    rows = [prompts[c.prompt_index] + c.token_ids for c in completions]
    t = max(len(r) for r in rows) - 1
    ids = np.zeros((len(rows), t), np.int32)
    mask = np.zeros((len(rows), t), np.int32)
    for i, r in enumerate(rows):  # right-padded: causal attention leaves real positions alone
        ids[i, : len(r) - 1], mask[i, : len(r) - 1] = r[:-1], 1
    logp, router = _full_forward(nnx.state(lm, nnx.Param), jnp.asarray(ids), jnp.asarray(mask))
    live = np.transpose(np.asarray(router.expert_ids), (1, 2, 0, 3))  # [B, T, L, k]
    dense = ~np.asarray(cfg.sparse_layers)
    for i, (c, full) in enumerate(zip(completions, rows)):
        n, m = len(prompts[c.prompt_index]), len(full) - 1
        want = np.asarray(logp)[i, np.arange(n - 1, m), c.token_ids]
        np.testing.assert_allclose(np.asarray(c.logprobs), want, atol=1e-5, rtol=0)
        assert c.routes.shape == (m, cfg.num_hidden_layers, cfg.num_experts_per_tok)
        np.testing.assert_array_equal(c.routes, live[i, :m])
        assert np.all(c.routes[:, dense] == -1)
        assert np.all((c.routes[:, ~dense] >= 0) & (c.routes[:, ~dense] < cfg.num_experts))
    assert router.counts.shape == (2, cfg.num_experts) and router.layers == (1, 3)
    # Every valid token makes k assignments in each sparse layer.
    np.testing.assert_allclose(np.asarray(router.counts).sum(-1), mask.sum() * 2)
    # The routing diagnostics compare the sparse layers only (the dense ones carry -1 here, 0
    # from vLLM): the sampler's routes are then all covered and all agree.
    recorded = np.full(live.shape, -1, np.int16)
    for i, c in enumerate(completions):
        recorded[i, : c.routes.shape[0]] = c.routes
    args = (jnp.asarray(recorded), jnp.asarray(live), jnp.asarray(mask))
    m = routing.disagreement(*args, (1, 3))
    assert float(m["routing/covered"]) == 1.0 and float(m["routing/disagree"]) == 0.0
    assert "routing/layer3/disagree" in m and "routing/layer2/disagree" not in m
    assert float(routing.disagreement(*args)["routing/covered"]) == 0.0
    metrics = moe.add_router_terms((jnp.float32(0), {}), [(cfg, router)], 1)[1]
    assert {"router/layer1/load_entropy", "router/layer3/load_entropy"} <= set(metrics)
    assert "router/layer0/load_entropy" not in metrics


def test_peft_adapters_cover_both_stacks(ckpts, tmp_path):
    """LoRA on a mixed layout: attention adapters in both stacks (the dense MLPs take none, as
    the experts), written under each layer's own index and read back bit for bit."""
    from jaxrlvr.model import lora, peft

    ckpt, _ = ckpts["only0"]
    lm = M.load_hf(ckpt.path, lora=lora.LoRAConfig(rank=2, alpha=4.0), lora_seed=1)
    assert lm.config.lora.targets == ("q_proj", "k_proj", "v_proj", "o_proj")
    params = nnx.State.merge(
        nnx.state(lm, nnx.Param), helpers.random_lora_b(nnx.state(lm, lora.LoRAParam), 3)
    )
    peft.save_adapter(lm.config, params, tmp_path)
    names = set(load_file(str(tmp_path / peft.WEIGHTS_FILE)))
    want = {
        f"{peft.PREFIX}{peft.module_name(t, i)}.lora_{ab}.weight"
        for t in lm.config.lora.targets
        for i in range(3)
        for ab in "AB"
    }
    assert names == want
    again = peft.load_adapter(tmp_path, lm.config, nnx.state(lm, nnx.Param))
    for (path, a), (_, b) in zip(
        nnx.to_flat_state(lora.adapters(params)), nnx.to_flat_state(lora.adapters(again))
    ):
        np.testing.assert_array_equal(np.asarray(a[...]), np.asarray(b[...]), err_msg=str(path))
