"""Sharding: the golden parameter -> PartitionSpec table, mesh building, and sharded execution on
8 fake CPU devices (set in tests/conftest.py)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrlvr import model as M

from . import helpers

# Golden table: parameter path -> (logical axes, PartitionSpec on the mesh data=1, fsdp=4,
# tensor=2). A change here changes how every checkpoint is laid out on devices: update it only
# on purpose.
GOLDEN = {
    "lm_head/kernel": (("embed", "vocab"), P("fsdp", "tensor")),
    "model/embed_tokens/embedding": (("vocab", "embed"), P("tensor", "fsdp")),
    "model/norm/weight": (("norm",), P()),
    "model/layers/input_layernorm/weight": (("layers", "norm"), P()),
    "model/layers/post_attention_layernorm/weight": (("layers", "norm"), P()),
    "model/layers/self_attn/q_proj/kernel": (
        ("layers", "embed", "heads", "head_dim"),
        P(None, "fsdp", "tensor"),
    ),
    "model/layers/self_attn/q_proj/bias": (("layers", "heads", "head_dim"), P(None, "tensor")),
    "model/layers/self_attn/k_proj/kernel": (
        ("layers", "embed", "kv_heads", "head_dim"),
        P(None, "fsdp", "tensor"),
    ),
    "model/layers/self_attn/k_proj/bias": (("layers", "kv_heads", "head_dim"), P(None, "tensor")),
    "model/layers/self_attn/v_proj/kernel": (
        ("layers", "embed", "kv_heads", "head_dim"),
        P(None, "fsdp", "tensor"),
    ),
    "model/layers/self_attn/v_proj/bias": (("layers", "kv_heads", "head_dim"), P(None, "tensor")),
    "model/layers/self_attn/o_proj/kernel": (
        ("layers", "heads", "head_dim", "embed"),
        P(None, "tensor", None, "fsdp"),
    ),
    "model/layers/mlp/gate_proj/kernel": (("layers", "embed", "mlp"), P(None, "fsdp", "tensor")),
    "model/layers/mlp/up_proj/kernel": (("layers", "embed", "mlp"), P(None, "fsdp", "tensor")),
    "model/layers/mlp/down_proj/kernel": (("layers", "mlp", "embed"), P(None, "tensor", "fsdp")),
}
# Logical-name rules with no mesh to filter them (what the table above is derived from).
GOLDEN_RULES = {
    "batch": ("data", "fsdp", "expert"),
    "seq": None,
    "layers": None,
    "embed": ("fsdp", "expert"),
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    # MoE experts [E, ...]: whole experts per (expert x fsdp) shard; expert=1: per fsdp shard
    "expert": ("expert", "fsdp"),
}


def _is_spec(x):
    return isinstance(x, P)


def flat(state, is_leaf=None) -> dict:
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_leaf)[0]
    return {jax.tree_util.keystr(p, simple=True, separator="/"): leaf for p, leaf in leaves}


def abstract_params(cfg):
    return nnx.state(nnx.eval_shape(lambda: M.Qwen2ForCausalLM(cfg)), nnx.Param)


@pytest.fixture(scope="module")
def mesh():
    assert jax.device_count() == 8, "tests/conftest.py should give 8 fake CPU devices"
    return M.make_mesh(M.MeshConfig(data=1, fsdp=4, tensor=2))


def test_rules_table():
    assert M.LOGICAL_RULES == GOLDEN_RULES


def test_golden_logical_axes_and_specs_tiny(mesh):
    params = abstract_params(M.ModelConfig.tiny(tie_word_embeddings=False))
    axes = {
        path: v.get_metadata()["logical_axes"]
        for path, v in flat(params, lambda x: isinstance(x, nnx.Variable)).items()
    }
    assert axes == {k: v[0] for k, v in GOLDEN.items()}
    specs = flat(M.param_partition_specs(params, mesh), _is_spec)
    assert specs == {k: v[1] for k, v in GOLDEN.items()}


def test_logical_shardings_one_rule_for_params_and_anything_around_them(mesh):
    # The one implementation behind param_shardings, algos.step.state_shardings and load_hf:
    # Variables by their logical axes (the golden table), every other leaf replicated.
    params = abstract_params(M.ModelConfig.tiny(tie_word_embeddings=False))
    tree = {"params": params, "step": jnp.zeros((), jnp.int32), "rng": jax.random.key(0)}
    is_var = lambda x: isinstance(x, nnx.Variable)
    out = M.logical_shardings(tree, mesh)
    got = {k: v.get_value() for k, v in flat(out["params"], is_var).items()}
    assert got == {k: NamedSharding(mesh, v[1]) for k, v in GOLDEN.items()}
    assert out["step"] == out["rng"] == NamedSharding(mesh, P())
    same = flat(M.param_shardings(params, mesh), is_var)
    assert {k: v.get_value() for k, v in same.items()} == got
    # A single array: a KV cache [B, K, H, S] gets batch over fsdp and kv heads over tensor.
    cache = M.logical_sharding(("batch", "kv_heads", "head_dim", "seq"), (8, 2, 16, 32), mesh)
    assert cache == NamedSharding(mesh, P("fsdp", "tensor"))
    assert M.logical_sharding(None, (3,), mesh) == NamedSharding(mesh, P())


def test_golden_specs_qwen25_1_5b(mesh):
    # The real 1.5B shapes divide evenly on this mesh: the same table, lm_head absent (tied).
    hf = json.loads((helpers.FIXTURES / "qwen2.5-1.5b.json").read_text())
    params = abstract_params(M.ModelConfig.from_hf_config(hf))
    specs = flat(M.param_partition_specs(params, mesh), _is_spec)
    assert specs == {k: v[1] for k, v in GOLDEN.items() if k != "lm_head/kernel"}


def test_non_divisible_dims_are_replicated():
    # Qwen2.5-1.5B has 2 kv heads: on tensor=4 they cannot split, so k/v are replicated over
    # 'tensor' (heads=12 still split). Also data=2 leaves fsdp=1: 'fsdp' drops out of specs.
    hf = json.loads((helpers.FIXTURES / "qwen2.5-1.5b.json").read_text())
    params = abstract_params(M.ModelConfig.from_hf_config(hf))
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=1, tensor=4))
    specs = flat(M.param_partition_specs(params, mesh), _is_spec)
    assert specs["model/layers/self_attn/k_proj/kernel"] == P()
    assert specs["model/layers/self_attn/k_proj/bias"] == P()
    assert specs["model/layers/self_attn/q_proj/kernel"] == P(None, None, "tensor")
    assert specs["model/embed_tokens/embedding"] == P("tensor")


def test_logical_to_pspec_without_mesh():
    # 'embed' wants 'fsdp', already used by 'batch' in the same array: replicated instead.
    assert M.logical_to_pspec(("batch", "seq", "embed")) == P(("data", "fsdp", "expert"))
    assert M.logical_to_pspec(("layers", "embed", "mlp")) == P(None, ("fsdp", "expert"), "tensor")
    with pytest.raises(KeyError, match="nonsense"):
        M.logical_to_pspec(("nonsense",))


def test_mesh_config():
    assert M.MeshConfig().resolve(8) == (1, 8, 1, 1)
    assert M.MeshConfig(data=2, fsdp=-1, tensor=2).resolve(8) == (2, 2, 1, 2)
    assert M.MeshConfig(data=-1, fsdp=2, tensor=1).resolve(8) == (4, 2, 1, 1)
    assert M.MeshConfig(fsdp=2, expert=-1).resolve(8) == (1, 2, 4, 1)
    mesh = M.make_mesh(M.MeshConfig(data=2, fsdp=-1, tensor=2))
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    assert dict(mesh.shape) == {"data": 2, "fsdp": 2, "expert": 1, "tensor": 2}
    with pytest.raises(ValueError, match="at most one axis"):
        M.MeshConfig(data=-1, fsdp=-1)
    with pytest.raises(ValueError, match="mesh.tensor"):
        M.MeshConfig(tensor=0)
    with pytest.raises(ValueError, match="mesh.expert"):
        M.MeshConfig(expert=0)
    with pytest.raises(ValueError, match="not divisible"):
        M.MeshConfig(tensor=3).resolve(8)
    with pytest.raises(ValueError, match="need 4 devices"):
        M.MeshConfig(data=2, fsdp=2, tensor=1).resolve(8)


@pytest.fixture(scope="module")
def sharded_and_single(hf_untied, mesh):
    return M.load_hf(hf_untied.path, mesh=mesh), M.load_hf(hf_untied.path)


def test_load_hf_places_shards(sharded_and_single, mesh):
    sharded, single = sharded_and_single
    values = flat(nnx.state(sharded, nnx.Param), lambda x: isinstance(x, nnx.Variable))
    reference = flat(nnx.state(single, nnx.Param), lambda x: isinstance(x, nnx.Variable))
    n_split = 0
    for path, var in values.items():
        arr = var[...]
        spec = GOLDEN[path][1]
        assert arr.sharding == NamedSharding(mesh, spec), path
        shard_shape = arr.sharding.shard_shape(arr.shape)
        shards = arr.addressable_shards
        assert len(shards) == 8
        assert all(s.data.shape == shard_shape for s in shards), path
        if spec != P():
            n_split += 1
            # Every device holds 1/2, 1/4 or 1/8 of the tensor, never all of it.
            assert np.prod(shard_shape) * 2 <= np.prod(arr.shape), path
        # The assembled value is exactly the single-device one.
        np.testing.assert_array_equal(np.asarray(arr), np.asarray(reference[path][...]), path)
    assert n_split == 12


def test_sharded_logits_equal_single_device(sharded_and_single, mesh):
    sharded, single = sharded_and_single
    ids = helpers.random_ids(4, 12, seed=41)
    mask, positions = helpers.left_padded([12, 9, 5, 12], 12)
    graphdef, params = nnx.split(sharded, nnx.Param)

    @jax.jit
    def forward(params, ids, mask, positions):
        return nnx.merge(graphdef, params)(ids, mask, positions)

    put = lambda x: jax.device_put(jnp.asarray(x), M.batch_sharding(mesh, 2))
    logits = forward(params, put(ids), put(mask), put(positions))
    # The activation constraints keep logits batch-sharded over fsdp and vocab over tensor.
    assert logits.sharding.spec == P("fsdp", None, "tensor")
    reference = helpers.forward(single, ids, mask, positions)
    real = mask.astype(bool)
    # Sharded matmuls sum partial products in another order: observed max |diff| ~5e-7.
    np.testing.assert_allclose(np.asarray(logits)[real], reference[real], atol=1e-5, rtol=0)


@pytest.mark.slow  # compiling the random init (threefry) takes 10-40 s on a loaded 2-core CPU
def test_init_model_with_mesh_is_sharded(mesh):
    cfg = M.ModelConfig.tiny(tie_word_embeddings=False)
    lm = M.init_model(cfg, seed=3, mesh=mesh)
    is_var = lambda x: isinstance(x, nnx.Variable)
    for path, var in flat(nnx.state(lm, nnx.Param), is_var).items():
        arr = var[...]
        assert arr.sharding == NamedSharding(mesh, GOLDEN[path][1]), path
        assert arr.dtype == np.float32
    shardings = flat(M.param_shardings(nnx.state(lm, nnx.Param), mesh), is_var)
    assert shardings["lm_head/kernel"].get_value() == NamedSharding(mesh, P("fsdp", "tensor"))
    # Random normal kernels with the configured std (0.02): 16384 draws, std within 5%.
    std = float(np.asarray(lm.model.layers.mlp.up_proj.kernel[...]).std())
    assert abs(std - cfg.initializer_range) < 0.05 * cfg.initializer_range
    assert np.all(np.asarray(lm.model.norm.weight[...]) == 1.0)
    assert not np.asarray(lm.model.layers.self_attn.q_proj.bias[...]).any()
