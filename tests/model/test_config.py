"""ModelConfig: validation, HF config.json interop, and shape-only construction of the real
Qwen2.5-1.5B / 7B configs (no parameter memory allocated)."""

import json

import jax
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jaxrlvr import model as M

from . import helpers

# name -> (fixture file, parameter count transformers reports for the published checkpoint)
REAL = {
    "1.5b": ("qwen2.5-1.5b.json", 1_543_714_304),
    "7b": ("qwen2.5-7b.json", 7_615_616_512),
}


def fixture_config(name) -> dict:
    return json.loads((helpers.FIXTURES / REAL[name][0]).read_text())


@pytest.mark.parametrize("name", sorted(REAL))
def test_shape_only_parameter_count(name):
    hf = fixture_config(name)
    cfg = M.ModelConfig.from_hf_config(hf)
    abstract = nnx.eval_shape(lambda: M.Qwen2ForCausalLM(cfg))
    params = nnx.state(abstract, nnx.Param)
    leaves = jax.tree.leaves(params)
    # Nothing was allocated: every leaf is an abstract ShapeDtypeStruct.
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    count = M.param_count(params)

    # Independent count: transformers builds the same model on the meta device (no memory).
    with torch.device("meta"):
        reference = transformers.Qwen2ForCausalLM(
            transformers.Qwen2Config.from_json_file(helpers.FIXTURES / REAL[name][0])
        )
    assert count == sum(p.numel() for p in reference.parameters()) == REAL[name][1]
    assert cfg.num_params() == count  # the closed-form count agrees too


def test_fixture_fields():
    small, big = fixture_config("1.5b"), fixture_config("7b")
    cfg = M.ModelConfig.from_hf_config(small)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size) == (151936, 1536, 8960)
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (28, 12, 2)
    assert cfg.head_dim == 128 and cfg.num_groups == 6
    assert cfg.rope_theta == 1e6 and cfg.rms_norm_eps == 1e-6 and cfg.tie_word_embeddings
    cfg7 = M.ModelConfig.from_hf_config(big)
    assert (cfg7.hidden_size, cfg7.num_attention_heads, cfg7.num_key_value_heads) == (3584, 28, 4)
    assert cfg7.head_dim == 128 and not cfg7.tie_word_embeddings and cfg7.vocab_size == 152064


def test_to_hf_config_round_trip():
    cfg = M.ModelConfig.from_hf_config(fixture_config("1.5b"))
    out = cfg.to_hf_config()
    assert out["model_type"] == "qwen2" and out["architectures"] == ["Qwen2ForCausalLM"]
    assert out["bos_token_id"] == out["eos_token_id"] == 151643  # carried through hf_config
    assert M.ModelConfig.from_hf_config(out) == cfg
    hf = transformers.Qwen2Config(**out)
    assert hf.num_key_value_heads == 2 and hf.tie_word_embeddings
    assert hf.rope_parameters["rope_theta"] == 1e6


def test_from_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(fixture_config("7b")))
    cfg = M.ModelConfig.from_json(tmp_path, dtype="bfloat16")
    assert cfg.hidden_size == 3584 and cfg.dtype == "bfloat16"
    with pytest.raises(FileNotFoundError, match="config.json"):
        M.ModelConfig.from_json(tmp_path / "missing")


def test_tiny_preset_and_overrides():
    cfg = M.ModelConfig.tiny(num_hidden_layers=3)
    assert cfg.num_hidden_layers == 3 and cfg.vocab_size == 128
    assert cfg.replace(dtype="bfloat16").compute_dtype == jax.numpy.bfloat16


def test_frozen_and_keyword_only():
    cfg = M.ModelConfig.tiny()
    with pytest.raises(AttributeError):
        cfg.hidden_size = 8
    with pytest.raises(TypeError):
        M.ModelConfig(128, 64, 128, 2, 4, 2)


@pytest.mark.parametrize("key", ["dtype", "param_dtype"])
def test_dtype_literal_validated(key):
    with pytest.raises(M.ConfigError) as info:
        M.ModelConfig.tiny(**{key: "float16"})
    msg = str(info.value)
    assert f"ModelConfig({key}=...)" in msg and "'float16' is not supported" in msg
    assert "float32" in msg and "bfloat16" in msg


@pytest.mark.parametrize(
    "spelling, name",
    [
        ("float32", "float32"),
        ("bfloat16", "bfloat16"),
        ("bf16", "bfloat16"),
        ("fp32", "float32"),
        (jax.numpy.float32, "float32"),
        (jax.numpy.bfloat16, "bfloat16"),
        (np.float32, "float32"),
        (np.dtype("float32"), "float32"),
        (jax.numpy.dtype("bfloat16"), "bfloat16"),
        (torch.bfloat16, "bfloat16"),
        (torch.float32, "float32"),
    ],
)
def test_dtype_spellings_normalised_once(spelling, name):
    assert M.dtype_name(spelling) == name
    cfg = M.ModelConfig.tiny(dtype=spelling, param_dtype=spelling)
    # The config holds the canonical string: equal and hashable across spellings, and the
    # compute/storage dtypes and config.json follow.
    assert cfg.dtype == cfg.param_dtype == name
    assert cfg == M.ModelConfig.tiny(dtype=name, param_dtype=name)
    assert hash(cfg) == hash(M.ModelConfig.tiny(dtype=name, param_dtype=name))
    assert cfg.compute_dtype == jax.numpy.dtype(name) == cfg.storage_dtype
    assert cfg.to_hf_config()["dtype"] == name
    assert cfg.replace(remat=True).dtype == name
    hf = M.ModelConfig.tiny().to_hf_config()
    assert M.ModelConfig.from_hf_config(hf, dtype=spelling).dtype == name


@pytest.mark.parametrize(
    "value, says",
    [
        ("float64", "'float64' is not supported"),
        (np.float16, "'float16' is not supported"),
        (jax.numpy.int32, "'int32' is not supported"),
        ("nonsense", "'nonsense' is not a dtype"),
        (None, "None is not a dtype"),
    ],
)
def test_unsupported_dtype_names_the_argument(value, says):
    with pytest.raises(M.ConfigError) as info:
        M.dtype_name(value, argument="f(dtype=...)")
    assert str(info.value) == f"f(dtype=...): {says}; expected one of float32, bfloat16"


@pytest.mark.parametrize(
    "overrides,named",
    [
        (dict(num_attention_heads=4, num_key_value_heads=3), "num_key_value_heads"),
        (dict(hidden_size=66, num_attention_heads=4, num_key_value_heads=2), "hidden_size"),
        (dict(vocab_size=0), "vocab_size"),
        (dict(hidden_size=12, num_attention_heads=4, num_key_value_heads=2), "head_dim"),
    ],
)
def test_shape_validation(overrides, named):
    with pytest.raises(M.ConfigError, match=named):
        M.ModelConfig.tiny(**overrides)


def test_from_hf_rejections():
    base = fixture_config("1.5b")
    for changes, named in [
        ({"model_type": "llama"}, "model_type"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"use_sliding_window": True}, "use_sliding_window"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "yarn"),
    ]:
        with pytest.raises(M.ConfigError, match=named):
            M.ModelConfig.from_hf_config({**base, **changes})
