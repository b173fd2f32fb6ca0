"""Hugging Face weight I/O: exact round trip, sharded checkpoints, one-line errors on bad input."""

import json
import pathlib
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxrlvr import model as M
from jaxrlvr.model import lora, weights

from . import helpers

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def all_tensors(directory: pathlib.Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory, whether single-file or sharded."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def params_equal(a, b) -> bool:
    la, lb = jax_leaves(a), jax_leaves(b)
    return len(la) == len(lb) and all(
        x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(la, lb)
    )


def jax_leaves(lm):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(lm, nnx.Param))]


def load_transformers(path) -> torch.nn.Module:
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def ids():
    return helpers.random_ids(2, 12, seed=21)


# ------------------------------------------------------------------------------------------------
# Round trip


def test_round_trip_bit_identical_and_transformers_loads(hf_ckpt, tmp_path, ids):
    lm = M.load_hf(hf_ckpt.path)
    out = pathlib.Path(M.save_hf(lm, tmp_path / "out"))
    assert (out / "config.json").exists() and (out / SINGLE).exists()
    assert not (out / INDEX).exists()

    original, saved = all_tensors(hf_ckpt.path), all_tensors(out)
    assert set(saved) == set(original)
    for name, arr in original.items():
        assert saved[name].dtype == arr.dtype == np.float32, name
        np.testing.assert_array_equal(saved[name], arr, err_msg=name)

    reloaded = load_transformers(out)
    assert reloaded.config.tie_word_embeddings == hf_ckpt.torch_model.config.tie_word_embeddings
    # Same weights, same transformers code: the logits are equal, not just close.
    np.testing.assert_array_equal(
        helpers.torch_logits(reloaded, ids), helpers.torch_logits(hf_ckpt.torch_model, ids)
    )


def test_hf_state_dict_matches_torch_state_dict(hf_ckpt):
    lm = M.load_hf(hf_ckpt.path)
    ours = M.hf_state_dict(lm.config, nnx.state(lm, nnx.Param))
    theirs = {
        k: v.detach().numpy()
        for k, v in hf_ckpt.torch_model.state_dict().items()
        if not (lm.config.tie_word_embeddings and k == "lm_head.weight")
    }
    assert set(ours) == set(theirs)
    for name, arr in theirs.items():
        np.testing.assert_array_equal(ours[name], arr, err_msg=name)


def test_saved_config_round_trips(hf_untied, tmp_path):
    lm = M.load_hf(hf_untied.path)
    M.save_hf(lm, tmp_path)
    again = M.load_hf(tmp_path)
    assert again.config == lm.config
    cfg = transformers.AutoConfig.from_pretrained(tmp_path)
    assert cfg.model_type == "qwen2"
    for key, value in helpers.TINY_HF.items():
        assert getattr(cfg, key, None) == value or cfg.rope_parameters["rope_theta"] == value, key
    assert params_equal(again, lm)


def test_load_bfloat16_checkpoint_upcasts_exactly(tmp_path):
    # Published Qwen2.5 checkpoints are bfloat16; float32 storage must hold them exactly.
    tm = helpers.make_torch_model(tie=True, seed=3).to(torch.bfloat16)
    tm.save_pretrained(tmp_path)
    lm = M.load_hf(tmp_path)
    emb = lm.model.embed_tokens.embedding[...]
    assert emb.dtype == np.float32
    np.testing.assert_array_equal(
        np.asarray(emb), tm.model.embed_tokens.weight.detach().float().numpy()
    )


def test_bfloat16_params_save_as_bfloat16(hf_untied, tmp_path, ids):
    lm = M.load_hf(hf_untied.path, param_dtype="bfloat16")
    M.save_hf(lm, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = all_tensors(tmp_path)
    assert all(a.dtype.name == "bfloat16" for a in tensors.values())
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.dtype == torch.bfloat16
    expected = hf_untied.torch_model.model.layers[0].mlp.up_proj.weight.detach().to(torch.bfloat16)
    assert torch.equal(reloaded.model.layers[0].mlp.up_proj.weight.detach(), expected)


@pytest.mark.parametrize("spelling", [jnp.bfloat16, np.dtype("bfloat16"), "bf16"])
def test_load_hf_accepts_numpy_and_jax_dtypes(hf_untied, spelling):
    lm = M.load_hf(hf_untied.path, dtype=jnp.float32, param_dtype=spelling)
    assert lm.config.dtype == "float32" and lm.config.param_dtype == "bfloat16"
    assert lm.model.embed_tokens.embedding[...].dtype == jnp.bfloat16


@pytest.mark.parametrize("key", ["dtype", "param_dtype"])
def test_load_hf_bad_dtype_names_the_argument_not_the_checkpoint(hf_untied, key):
    with pytest.raises(M.ConfigError) as info:
        M.load_hf(hf_untied.path, **{key: "float64"})
    assert not isinstance(info.value, M.CheckpointError)
    expected = f"load_hf({key}=...): 'float64' is not supported; expected one of float32, bfloat16"
    assert str(info.value) == expected


# ------------------------------------------------------------------------------------------------
# Sharded checkpoints


def test_sharded_transformers_checkpoint_loads(hf_untied, tmp_path):
    hf_untied.torch_model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / INDEX).exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    assert not (tmp_path / SINGLE).exists()
    assert params_equal(M.load_hf(tmp_path), M.load_hf(hf_untied.path))


def test_save_hf_writes_sharded_index_transformers_loads(hf_ckpt, tmp_path, ids):
    lm = M.load_hf(hf_ckpt.path)
    M.save_hf(lm, tmp_path, max_shard_bytes=50_000)
    index = json.loads((tmp_path / INDEX).read_text())
    shards = sorted(tmp_path.glob("*.safetensors"))
    assert len(shards) > 1
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in all_tensors(tmp_path).values())
    for s in shards:  # no shard above the threshold unless it holds a single larger tensor
        t = load_file(s)
        assert len(t) == 1 or sum(a.nbytes for a in t.values()) <= 50_000
    assert params_equal(M.load_hf(tmp_path), lm)
    np.testing.assert_array_equal(
        helpers.torch_logits(load_transformers(tmp_path), ids),
        helpers.torch_logits(hf_ckpt.torch_model, ids),
    )


def test_resave_single_file_removes_stale_index(hf_untied, tmp_path):
    lm = M.load_hf(hf_untied.path)
    M.save_hf(lm, tmp_path, max_shard_bytes=50_000)
    M.save_hf(lm, tmp_path)
    assert not (tmp_path / INDEX).exists()
    # Stale shards go too: a loader scanning *.safetensors must not mix two layouts.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", SINGLE]
    assert params_equal(M.load_hf(tmp_path), lm)
    M.save_hf(lm, tmp_path, max_shard_bytes=50_000)
    assert not (tmp_path / SINGLE).exists() and (tmp_path / INDEX).exists()
    assert params_equal(M.load_hf(tmp_path), lm)


def test_save_hf_params_untied_writes_a_loadable_untied_copy(hf_tied, tmp_path, ids):
    lm = M.load_hf(hf_tied.path)
    assert lm.config.tie_word_embeddings
    M.save_hf_params(lm.config, nnx.state(lm, nnx.Param), tmp_path, untied=True)
    tensors = load_file(tmp_path / SINGLE)
    np.testing.assert_array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"])
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    reloaded = load_transformers(tmp_path)
    with torch.no_grad():
        expected = hf_tied.torch_model(torch.as_tensor(np.asarray(ids))).logits.numpy()
        got = reloaded(torch.as_tensor(np.asarray(ids))).logits.numpy()
    np.testing.assert_allclose(got, expected, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Tokenizer files


def _tokenizer():
    import tokenizers
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>", "<|endoftext|>"])
    tok.train_from_iterator(["the quick brown fox", "jumps over the lazy dog"] * 4, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


@pytest.mark.parametrize("as_directory", [True, False])
def test_save_hf_copies_tokenizer(hf_untied, tmp_path, as_directory):
    tok = _tokenizer()
    src = tmp_path / "tok"
    tok.save_pretrained(src)
    M.save_hf(
        M.load_hf(hf_untied.path), tmp_path / "out", tokenizer_src=src if as_directory else tok
    )
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    text = "the lazy fox"
    assert loaded(text)["input_ids"] == tok(text)["input_ids"]
    assert loaded.eos_token == "<|endoftext|>"


# ------------------------------------------------------------------------------------------------
# Bad input: each a one-line CheckpointError naming the file or tensor.


@pytest.fixture
def broken(hf_untied, tmp_path):
    """A private copy of the untied checkpoint to damage."""
    dst = tmp_path / "ckpt"
    shutil.copytree(hf_untied.path, dst)
    return dst


def load_error(path) -> str:
    with pytest.raises(M.CheckpointError) as info:
        M.load_hf(path)
    message = str(info.value)
    assert "\n" not in message, message
    return message


def _edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def _edit_tensors(path, edit):
    tensors = load_file(path / SINGLE)
    edit(tensors)
    save_file(tensors, path / SINGLE, metadata={"format": "pt"})


def test_missing_config(broken):
    (broken / "config.json").unlink()
    msg = load_error(broken)
    assert "config.json" in msg and str(broken) in msg


def test_not_a_directory(tmp_path):
    msg = load_error(tmp_path / "nowhere")
    assert "nowhere" in msg


def test_other_model_type(broken):
    _edit_config(broken, model_type="llama")
    msg = load_error(broken)
    assert "config.json" in msg and "model_type" in msg and "llama" in msg


@pytest.mark.parametrize(
    "changes,named",
    [
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
        ({"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}, "linear"),
    ],
)
def test_unsupported_rope_scaling(broken, changes, named):
    _edit_config(broken, **changes)
    msg = load_error(broken)
    assert "config.json" in msg and named in msg and "rope" in msg


def test_sliding_window_rejected(broken):
    _edit_config(broken, use_sliding_window=True, sliding_window=8)
    assert "use_sliding_window" in load_error(broken)


def test_missing_tensor(broken):
    name = "model.layers.1.mlp.up_proj.weight"
    _edit_tensors(broken, lambda t: t.pop(name))
    msg = load_error(broken)
    assert name in msg and "missing" in msg


def test_unexpected_tensor(broken):
    name = "model.layers.0.mlp.extra_proj.weight"
    _edit_tensors(broken, lambda t: t.__setitem__(name, np.zeros((4, 4), np.float32)))
    msg = load_error(broken)
    assert name in msg and "unexpected" in msg and SINGLE in msg


def test_shape_mismatch(broken):
    name = "model.layers.0.self_attn.k_proj.weight"
    _edit_tensors(broken, lambda t: t.__setitem__(name, np.zeros((48, 64), np.float32)))
    msg = load_error(broken)
    assert name in msg and "[48, 64]" in msg and "[32, 64]" in msg


def test_truncated_safetensors(broken):
    data = (broken / SINGLE).read_bytes()
    (broken / SINGLE).write_bytes(data[: len(data) // 2])
    assert SINGLE in load_error(broken)


def test_garbage_safetensors(broken):
    (broken / SINGLE).write_bytes(b"this is not a safetensors file at all" * 10)
    assert SINGLE in load_error(broken)


def test_empty_safetensors(broken):
    (broken / SINGLE).write_bytes(b"")
    assert SINGLE in load_error(broken)


def test_no_weights(broken):
    (broken / SINGLE).unlink()
    assert "safetensors" in load_error(broken)


def test_sharded_missing_shard_file(hf_untied, tmp_path):
    hf_untied.torch_model.save_pretrained(tmp_path, max_shard_size="50KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[-1]
    shard.unlink()
    assert shard.name in load_error(tmp_path)


def test_sharded_truncated_shard(hf_untied, tmp_path):
    hf_untied.torch_model.save_pretrained(tmp_path, max_shard_size="50KB")
    shard = sorted(tmp_path.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) - 100])
    assert shard.name in load_error(tmp_path)


def test_corrupt_index(hf_untied, tmp_path):
    hf_untied.torch_model.save_pretrained(tmp_path, max_shard_size="50KB")
    (tmp_path / INDEX).write_text("{not json")
    assert INDEX in load_error(tmp_path)


def test_random_init_compiles_at_o1_to_the_default_bits(monkeypatch):
    """``init_compiler_options``: the random-init program at LLVM -O1 (compiled in under half
    the default's time) gives the bits of XLA's default -O3, on a Qwen3-MoE with LoRA (its
    base kernels, experts, router, norms and adapters; bf16 compute); ``XLA_FLAGS``' own
    level wins (the tests run at -O0, ``tests/conftest.py``)."""
    assert weights.init_compiler_options() is None
    monkeypatch.setenv("XLA_FLAGS", "")
    assert weights.init_compiler_options() == {"xla_backend_optimization_level": 1}
    cfg = M.ModelConfig.tiny(
        model_type="qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        dtype="bfloat16",
        lora=lora.LoRAConfig(rank=4, alpha=8.0),
    )
    lowered = weights.init_state_fn(cfg, seed=5).lower()
    o1, o3 = (
        jax.tree.leaves(lowered.compile({"xla_backend_optimization_level": level})())
        for level in (1, 3)
    )
    assert len(o1) == len(o3) > 10
    for a, b in zip(o1, o3, strict=True):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))
