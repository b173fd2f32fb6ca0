"""Weight export for vLLM reload: HF names, atomic replace, a loadable directory."""

import json
import os

import jax
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from jaxrlvr import model as jmodel
from jaxrlvr.sampling import weight_export


@pytest.fixture(scope="module")
def tiny(helpers):
    """The tiny config and two different random parameter sets (built once: init compiles)."""
    cfg = helpers.tiny_model_config()
    _, first = helpers.random_params(cfg, seed=1)
    _, second = helpers.random_params(cfg, seed=2)
    return cfg, first, second


def test_export_writes_hf_named_tensors_that_load_back_exactly(tmp_path, tiny):
    cfg, params, _ = tiny
    timings = weight_export.export_weights(cfg, params, tmp_path)

    files = sorted(os.listdir(tmp_path))
    assert files == ["config.json", "model.safetensors"]  # no temp file left behind
    for key in ("to_host_s", "write_s", "export_s"):
        assert timings[key] >= 0.0
    assert timings["num_params"] == cfg.num_params()
    assert timings["bytes"] == 4 * cfg.num_params()  # float32

    written = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    expected = jmodel.hf_state_dict(cfg, params)
    assert written.keys() == expected.keys()
    assert "model.layers.1.self_attn.q_proj.bias" in written and "lm_head.weight" in written
    for k, v in expected.items():
        np.testing.assert_array_equal(written[k], v)

    # The directory is a model jaxrlvr (and so vLLM) can load: same parameters, bit for bit.
    loaded = nnx.state(jmodel.load_hf(tmp_path), nnx.Param)
    for a, b in zip(jax.tree.leaves(loaded), jax.tree.leaves(params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == [
        "Qwen2ForCausalLM"
    ]


def test_second_export_replaces_the_weights(tmp_path, tiny):
    cfg, first, second = tiny
    weight_export.export_weights(cfg, first, tmp_path)
    weight_export.export_weights(cfg, second, tmp_path)
    written = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(
        written["lm_head.weight"], jmodel.hf_state_dict(cfg, second)["lm_head.weight"]
    )
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]


def test_default_export_dir_prefers_tmpfs():
    d = weight_export.default_export_dir()
    try:
        assert os.path.isdir(d)
        if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
            assert d.startswith("/dev/shm/")
    finally:
        os.rmdir(d)


def test_tied_model_is_exported_untied_with_the_same_logits(tmp_path, helpers):
    # vLLM's in-place reload loses the embedding/lm_head tie, so a tied model is served untied:
    # lm_head.weight is a copy of the embedding and config.json says tie_word_embeddings=false.
    cfg = helpers.tiny_model_config().replace(tie_word_embeddings=True)
    model = jmodel.init_model(cfg, seed=5)
    params = nnx.state(model, nnx.Param)
    weight_export.export_weights(cfg, params, tmp_path)
    written = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    np.testing.assert_array_equal(written["lm_head.weight"], written["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    served = jmodel.load_hf(tmp_path)
    ids = jax.numpy.arange(12, dtype=jax.numpy.int32).reshape(2, 6) % cfg.vocab_size
    # Same weights, a transposed matmul: equal up to float32 summation order.
    np.testing.assert_allclose(np.asarray(served(ids)), np.asarray(model(ids)), atol=1e-5)


def test_later_exports_write_the_weights_alone(tmp_path, tiny):
    # The per-step path keeps the config.json already there (written once, or by the caller).
    cfg, first, second = tiny
    weight_export.export_weights(cfg, first, tmp_path, write_config=False)
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    weight_export.export_weights(cfg, first, tmp_path)
    (tmp_path / "config.json").write_text('{"kept": true}')
    weight_export.export_weights(cfg, second, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == {"kept": True}
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
