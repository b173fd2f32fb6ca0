"""Qwen3 and Qwen3-MoE in the one decoder: logits against transformers (float32, 1e-4), weight
round trips both ways, refusals of fields the decoder does not implement, PEFT adapters."""

import copy
import json

import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file

from jaxrlvr import model as M
from jaxrlvr.model import config as config_lib
from jaxrlvr.model import lora, peft

from . import helpers

# float32 on both sides in a different order: observed max |diff| ~4e-6 on O(1) logits (Qwen3,
# Qwen3-MoE); a wrong norm, bias, head_dim or expert weighting moves them by O(0.1-1).
F32_ATOL = 1e-4
B, T = 3, 16

# (family, tie, overrides): Qwen3 without and with attention_bias (q/k/v/o biases), tied and
# untied; Qwen3-MoE with and without norm_topk_prob.
CASES = {
    "qwen3": ("qwen3", False, {}),
    "qwen3_bias_tied": ("qwen3", True, {"attention_bias": True}),
    "moe": ("qwen3_moe", False, {}),
    "moe_nonorm_tied": ("qwen3_moe", True, {"norm_topk_prob": False}),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    out = {}
    for i, (name, (family, tie, overrides)) in enumerate(CASES.items()):
        path = tmp_path_factory.mktemp(name)
        ckpt = helpers.write_checkpoint(path, tie=tie, seed=20 + i, family=family, **overrides)
        out[name] = (ckpt, M.load_hf(path))
    return out


@pytest.fixture(params=list(CASES))
def case(request, ckpts):
    return request.param, *ckpts[request.param]


def test_config_reads_the_family(ckpts):
    cfg = ckpts["qwen3"][1].config
    assert cfg.model_type == "qwen3" and cfg.qk_norm and not cfg.qkv_bias and not cfg.o_bias
    assert cfg.head_dim == 32 and cfg.head_dim_override == 32
    cfg = ckpts["qwen3_bias_tied"][1].config
    assert cfg.qkv_bias and cfg.o_bias and cfg.tie_word_embeddings
    cfg = ckpts["moe"][1].config
    assert cfg.is_moe and (cfg.num_experts, cfg.num_experts_per_tok) == (8, 2)
    assert cfg.moe_intermediate_size == 32 and cfg.norm_topk_prob
    assert cfg.router_aux_loss_coef == 0.001
    assert not ckpts["moe_nonorm_tied"][1].config.norm_topk_prob
    for ckpt, lm in ckpts.values():
        # num_params is transformers' count.
        assert lm.config.num_params() == sum(p.numel() for p in ckpt.torch_model.parameters())
        assert M.param_count(lm) == lm.config.num_params()


def test_logits_match_transformers(case):
    name, ckpt, lm = case
    ids = helpers.random_ids(B, T, seed=1)
    mask, positions = helpers.left_padded([T, 11, 5], T)
    ref = helpers.torch_logits(ckpt.torch_model, ids, mask, positions)
    assert ref.std() > 0.5  # O(1) logits: the tolerance means something
    out = helpers.forward(lm, ids, mask, positions)
    real = mask.astype(bool)
    np.testing.assert_allclose(out[real], ref[real], atol=F32_ATOL, rtol=0)


def test_round_trip_bit_identical_both_ways(case, tmp_path):
    """HF -> ours -> HF gives the same tensors bit for bit (names and values), and transformers
    loads what we wrote into the same function."""
    name, ckpt, lm = case
    M.save_hf(lm, tmp_path)
    theirs = load_file(str(ckpt.path / "model.safetensors"))
    ours = load_file(str(tmp_path / "model.safetensors"))
    assert set(ours) == set(theirs)
    for key, value in theirs.items():
        np.testing.assert_array_equal(ours[key], value, err_msg=key)
    import transformers

    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == CASES[name][0]
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(reloaded) is type(ckpt.torch_model)
    ids = helpers.random_ids(2, 8, seed=2)
    np.testing.assert_array_equal(
        helpers.torch_logits(reloaded, ids), helpers.torch_logits(ckpt.torch_model, ids)
    )
    # And ours -> HF -> ours: the reloaded model holds the same arrays.
    again = M.load_hf(tmp_path)
    for a, b in zip(
        nnx.to_flat_state(nnx.state(lm, nnx.Param)), nnx.to_flat_state(nnx.state(again, nnx.Param))
    ):
        assert a[0] == b[0]
        np.testing.assert_array_equal(np.asarray(a[1][...]), np.asarray(b[1][...]))


QWEN3 = {"model_type": "qwen3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32}
QWEN3.update(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=8)
MOE = {**QWEN3, "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2}
MOE["moe_intermediate_size"] = 8


@pytest.mark.parametrize(
    "hf, named",
    [
        ({**QWEN3, "use_sliding_window": True}, "use_sliding_window"),
        ({**QWEN3, "layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ({**MOE, "mlp_only_layers": [0, 1]}, "no sparse layer"),
        ({**MOE, "decoder_sparse_step": 3}, "no sparse layer"),
        ({**MOE, "mlp_only_layers": [2]}, "mlp_only_layers"),
        ({**MOE, "model_type": "qwen2_moe"}, "shared_expert"),
        ({**MOE, "shared_expert_intermediate_size": 8}, "shared_expert_intermediate_size"),
        ({**QWEN3, "hidden_act": "gelu"}, "hidden_act"),
        ({**QWEN3, "model_type": "llama"}, "model_type"),
    ],
)
def test_unimplemented_fields_are_refused_in_one_line(hf, named):
    with pytest.raises(config_lib.ConfigError, match=named) as err:
        M.ModelConfig.from_hf_config(hf)
    assert "\n" not in str(err.value)


def test_config_defaults_follow_transformers():
    # Qwen3Config's head_dim defaults to 128; Qwen3MoeConfig has none (hidden / heads);
    # transformers >= 5.20 writes num_experts as num_local_experts.
    assert M.ModelConfig.from_hf_config({**QWEN3, "head_dim": None} | {}).head_dim == 8
    no_head_dim = {k: v for k, v in QWEN3.items() if k != "head_dim"}
    assert M.ModelConfig.from_hf_config(no_head_dim).head_dim == 128
    moe = {k: v for k, v in MOE.items() if k not in ("head_dim", "num_experts")}
    cfg = M.ModelConfig.from_hf_config({**moe, "num_local_experts": 4})
    assert cfg.head_dim == 8 and cfg.num_experts == 4
    assert cfg.to_hf_config()["num_experts"] == 4
    with pytest.raises(config_lib.ConfigError, match="num_experts_per_tok"):
        M.ModelConfig.tiny(
            model_type="qwen3_moe", num_experts=2, num_experts_per_tok=3, moe_intermediate_size=8
        )
    with pytest.raises(config_lib.ConfigError, match="attention_bias"):
        M.ModelConfig.tiny(attention_bias=True)


def test_peft_adapters_on_qwen3_both_ways(ckpts, tmp_path):
    """Qwen3 (dense): our adapters load in PEFT with our logits, PEFT's load in ours."""
    from peft import LoraConfig, PeftModel, get_peft_model

    ckpt, _ = ckpts["qwen3"]
    cfg = lora.LoRAConfig(rank=4, alpha=8.0)
    lm = M.load_hf(ckpt.path, lora=cfg, lora_seed=1)
    graphdef, params = nnx.split(lm, nnx.Param)
    # Non-zero B so the adapters change the function.
    params = nnx.State.merge(params, helpers.random_lora_b(nnx.state(lm, lora.LoRAParam), 5))
    peft.save_adapter(lm.config, params, tmp_path / "ours", base_model_name_or_path="tiny")
    model = PeftModel.from_pretrained(copy.deepcopy(ckpt.torch_model), tmp_path / "ours").eval()
    ids = helpers.random_ids(2, 10, seed=3)
    with torch.no_grad():
        theirs = model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
    ours = helpers.forward(nnx.merge(graphdef, params), ids)
    assert np.abs(theirs - helpers.torch_logits(ckpt.torch_model, ids)).max() > 0.1
    np.testing.assert_allclose(ours, theirs, atol=F32_ATOL)

    peft_cfg = LoraConfig(r=8, lora_alpha=4, target_modules="all-linear", init_lora_weights=False)
    theirs_model = get_peft_model(copy.deepcopy(ckpt.torch_model), peft_cfg).eval()
    theirs_model.save_pretrained(tmp_path / "theirs")
    with torch.no_grad():
        theirs = theirs_model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()
    loaded = peft.load_peft(ckpt.path, tmp_path / "theirs")
    np.testing.assert_allclose(helpers.forward(loaded, ids), theirs, atol=F32_ATOL)


def test_config_round_trips_through_config_json():
    """to_hf_config -> from_hf_config is the identity for every family (what checkpoints and
    ``jaxrlvr export`` rely on); active parameters count k of E experts."""
    for cfg in (
        M.ModelConfig.tiny(model_type="qwen3", head_dim_override=32, attention_bias=True),
        M.ModelConfig.tiny(
            model_type="qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            router_aux_loss_coef=0.01,
        ),
    ):
        assert M.ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    # 2 layers x (8 - 2) inactive experts x 3 kernels of 64 x 32.
    assert cfg.num_params() - cfg.num_params(active=True) == 2 * (8 - 2) * 3 * 64 * 32


def test_presets_count_the_published_sizes():
    # Qwen3-1.7B: 1.7B (1.4B non-embedding); Qwen3-30B-A3B: 30.5B total, 3.3B activated.
    assert M.ModelConfig.qwen3_1_7b().num_params() == 1_720_574_976
    assert M.ModelConfig.qwen3_1_7b().num_non_embedding_params() == 1_409_410_048
    big = M.ModelConfig.qwen3_30b_a3b()
    assert big.num_params() == 30_532_122_624
    assert big.num_params(active=True) == 3_353_032_704
