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


def test_in_place_export_overwrites_the_same_file_with_the_new_weights(tmp_path, tiny):
    # Every sync after the first rewrites the tensor bytes of the existing file (same inode, no
    # temporary file) at the offsets its header gives; the result must load as the new weights.
    cfg, first, second = tiny
    assert weight_export.export_weights(cfg, first, tmp_path, in_place=True)["in_place"] == 0.0
    file = tmp_path / "model.safetensors"
    inode, size = file.stat().st_ino, file.stat().st_size
    timings = weight_export.export_weights(cfg, second, tmp_path, in_place=True)
    assert timings["in_place"] == 1.0 and timings["bytes"] == 4 * cfg.num_params()
    assert file.stat().st_ino == inode and file.stat().st_size == size
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    written = safetensors.numpy.load_file(file)
    expected = jmodel.hf_state_dict(cfg, second)
    assert written.keys() == expected.keys()
    for k, v in expected.items():
        np.testing.assert_array_equal(written[k], v, err_msg=k)
    # ...and back again: nothing of the first write is left over.
    weight_export.export_weights(cfg, first, tmp_path, in_place=True)
    written = safetensors.numpy.load_file(file)
    for k, v in jmodel.hf_state_dict(cfg, first).items():
        np.testing.assert_array_equal(written[k], v, err_msg=k)


def test_in_place_export_of_a_tied_model_keeps_lm_head_equal_to_the_embedding(tmp_path, helpers):
    cfg = helpers.tiny_model_config().replace(tie_word_embeddings=True)
    first = nnx.state(jmodel.init_model(cfg, seed=5), nnx.Param)
    second = nnx.state(jmodel.init_model(cfg, seed=6), nnx.Param)
    weight_export.export_weights(cfg, first, tmp_path, in_place=True)
    assert weight_export.export_weights(cfg, second, tmp_path, in_place=True)["in_place"] == 1.0
    written = safetensors.numpy.load_file(tmp_path / "model.safetensors")
    embed = jmodel.hf_state_dict(cfg, second)["model.embed_tokens.weight"]
    np.testing.assert_array_equal(written["model.embed_tokens.weight"], embed)
    np.testing.assert_array_equal(written["lm_head.weight"], embed)


def test_in_place_export_falls_back_to_a_new_file_when_the_layout_differs(tmp_path, tiny):
    # Another dtype (other sizes and header), or a file that is not the export's: write anew.
    cfg, first, second = tiny
    weight_export.export_weights(cfg, first, tmp_path)
    file = tmp_path / "model.safetensors"
    timings = weight_export.export_weights(cfg, second, tmp_path, dtype="bfloat16", in_place=True)
    assert timings["in_place"] == 0.0
    written = safetensors.numpy.load_file(file)
    expected = jmodel.hf_state_dict(cfg, second, dtype="bfloat16")
    assert written["lm_head.weight"].dtype == expected["lm_head.weight"].dtype
    np.testing.assert_array_equal(written["lm_head.weight"], expected["lm_head.weight"])

    safetensors.numpy.save_file({"x": np.zeros(3, np.float32)}, file)
    assert weight_export.export_weights(cfg, first, tmp_path, in_place=True)["in_place"] == 0.0
    assert safetensors.numpy.load_file(file).keys() == jmodel.hf_state_dict(cfg, first).keys()
    # A bfloat16 file rewritten in place with bfloat16 weights.
    weight_export.export_weights(cfg, first, tmp_path, dtype="bfloat16")
    again = weight_export.export_weights(cfg, second, tmp_path, dtype="bfloat16", in_place=True)
    assert again["in_place"] == 1.0
    np.testing.assert_array_equal(
        safetensors.numpy.load_file(file)["lm_head.weight"], expected["lm_head.weight"]
    )


def test_overwrite_tensors_refuses_a_mismatch_and_writes_nothing(tmp_path):
    file = tmp_path / "w.safetensors"
    assert not weight_export.overwrite_tensors(file, {"a": np.ones(2, np.float32)})  # missing
    safetensors.numpy.save_file({"a": np.zeros(4, np.float32), "b": np.zeros(2, np.float32)}, file)
    before = file.read_bytes()
    for bad in (
        {"a": np.ones(4, np.float32)},  # a name missing
        {"a": np.ones(4, np.float32), "b": np.ones(2, np.float16)},  # dtype
        {"a": np.ones((2, 2), np.float32), "b": np.ones(2, np.float32)},  # shape
        {"a": np.ones(4, np.float32), "b": np.ones(2, np.float32), "c": np.ones(1, np.float32)},
    ):
        assert not weight_export.overwrite_tensors(file, bad)
        assert file.read_bytes() == before
    new = {"a": np.arange(4, dtype=np.float32), "b": np.array([7.0, 8.0], np.float32)}
    assert weight_export.overwrite_tensors(file, new)
    back = safetensors.numpy.load_file(file)
    np.testing.assert_array_equal(back["a"], new["a"])
    np.testing.assert_array_equal(back["b"], new["b"])
