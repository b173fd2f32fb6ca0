"""Hugging Face checkpoint I/O: safetensors <-> the NNX decoder (Qwen2, Qwen3, Qwen3-MoE), exactly.

``load_hf`` reads config.json and single-file or index-sharded safetensors; every tensor is
validated (name set, shapes) before any array is built, so a bad checkpoint fails with one line
naming the file or tensor and nothing half-loaded. With a mesh, each parameter is assembled with
``jax.make_array_from_callback``: a device receives only its own shard, so a model larger than one
device never materialises whole on one device.

``save_hf_params`` is the one writer of HF files: ``save_hf`` (a model) and the vLLM weight
export (``sampling.weight_export``) call it. ``hf_state_dict`` gives transformers' names and
layouts; the map is one table, ``_TENSORS``: HF name template, our parameter path, and the
reshapes between HF's [out, in] matrices and our per-head einsum kernels. Each entry says which
configs have it (``when``: biases by family, Qwen3's q/k norms), which layers (``layers``: a
dense MLP's or the MoE block's, placed through ``ModelConfig.layer_stacks``) and how many
stacked axes it has (``stack``: 0 whole, 1 per layer ``{i}``, 2 per layer and expert
``{j}``: Qwen3-MoE checkpoints store one matrix per expert, ``mlp.experts.{j}.gate_proj.weight``,
the layout vLLM and the released checkpoints use; transformers >= 5 converts it on load).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxrlvr.model import lora as lora_lib
from jaxrlvr.model import sharding
from jaxrlvr.model.config import ConfigError, DTypeLike, ModelConfig, MoEImpl, dtype_name
from jaxrlvr.model.decoder import CausalLM
from jaxrlvr.model.lora import LoRAConfig

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_FILE = "model.safetensors"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# Non-parameter buffers some older checkpoints carry; safe to ignore.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
    "qwen.tiktoken",
)


class CheckpointError(RuntimeError, ValueError):
    """A checkpoint that cannot be written or read, or does not match the model it claims to be:
    a Hugging Face directory here, an orbax training checkpoint in ``jaxrlvr.checkpoint`` (which
    raises this same class). The message is one line; the CLI exits with status 1."""


@dataclasses.dataclass(frozen=True)
class _Tensor:
    hf_name: str  # may contain {i} (layer) and {j} (expert)
    path: tuple[str, ...]  # our parameter path in the NNX state
    to_ours: Callable  # (np array in HF layout, cfg) -> our per-layer layout
    to_hf: Callable  # (our per-layer array, cfg) -> HF layout
    stack: int = 1  # leading stacked axes of our array: 0, 1 (layers), 2 (layers, experts)
    when: Callable[[ModelConfig], bool] = lambda cfg: True  # noqa: E731
    # Which decoder layers have it: "all", "sparse" (the MoE block's) or "dense" (a dense MLP's).
    layers: Literal["all", "sparse", "dense"] = "all"


def _identity(w, cfg):
    return w


def _transpose(w, cfg):
    return w.T


def _q_in(w, cfg):  # [N*H, D] -> [D, N, H]
    return w.reshape(cfg.num_attention_heads, cfg.head_dim, -1).transpose(2, 0, 1)


def _kv_in(w, cfg):  # [K*H, D] -> [D, K, H]
    return w.reshape(cfg.num_key_value_heads, cfg.head_dim, -1).transpose(2, 0, 1)


def _heads_out(w, cfg):  # [D, X, H] -> [X*H, D]
    return w.transpose(1, 2, 0).reshape(-1, w.shape[0])


def _qb_in(w, cfg):
    return w.reshape(cfg.num_attention_heads, cfg.head_dim)


def _kvb_in(w, cfg):
    return w.reshape(cfg.num_key_value_heads, cfg.head_dim)


def _flatten(w, cfg):
    return w.reshape(-1)


def _o_in(w, cfg):  # [D, N*H] -> [N, H, D]
    return w.reshape(w.shape[0], cfg.num_attention_heads, cfg.head_dim).transpose(1, 2, 0)


def _o_out(w, cfg):  # [N, H, D] -> [D, N*H]
    return w.transpose(2, 0, 1).reshape(w.shape[2], -1)


_L = "model.layers.{i}."
_TENSORS: tuple[_Tensor, ...] = (
    _Tensor(
        "model.embed_tokens.weight",
        ("model", "embed_tokens", "embedding"),
        _identity,
        _identity,
        0,
    ),
    _Tensor("model.norm.weight", ("model", "norm", "weight"), _identity, _identity, 0),
    _Tensor(
        "lm_head.weight",
        ("lm_head", "kernel"),
        _transpose,
        _transpose,
        0,
        when=lambda cfg: not cfg.tie_word_embeddings,
    ),
    _Tensor(
        _L + "self_attn.q_proj.weight",
        ("model", "layers", "self_attn", "q_proj", "kernel"),
        _q_in,
        _heads_out,
    ),
    _Tensor(
        _L + "self_attn.q_proj.bias",
        ("model", "layers", "self_attn", "q_proj", "bias"),
        _qb_in,
        _flatten,
        when=lambda cfg: cfg.qkv_bias,
    ),
    _Tensor(
        _L + "self_attn.k_proj.weight",
        ("model", "layers", "self_attn", "k_proj", "kernel"),
        _kv_in,
        _heads_out,
    ),
    _Tensor(
        _L + "self_attn.k_proj.bias",
        ("model", "layers", "self_attn", "k_proj", "bias"),
        _kvb_in,
        _flatten,
        when=lambda cfg: cfg.qkv_bias,
    ),
    _Tensor(
        _L + "self_attn.v_proj.weight",
        ("model", "layers", "self_attn", "v_proj", "kernel"),
        _kv_in,
        _heads_out,
    ),
    _Tensor(
        _L + "self_attn.v_proj.bias",
        ("model", "layers", "self_attn", "v_proj", "bias"),
        _kvb_in,
        _flatten,
        when=lambda cfg: cfg.qkv_bias,
    ),
    _Tensor(
        _L + "self_attn.o_proj.weight",
        ("model", "layers", "self_attn", "o_proj", "kernel"),
        _o_in,
        _o_out,
    ),
    _Tensor(
        _L + "self_attn.o_proj.bias",
        ("model", "layers", "self_attn", "o_proj", "bias"),
        _identity,
        _identity,
        when=lambda cfg: cfg.o_bias,
    ),
    _Tensor(
        _L + "self_attn.q_norm.weight",
        ("model", "layers", "self_attn", "q_norm", "weight"),
        _identity,
        _identity,
        when=lambda cfg: cfg.qk_norm,
    ),
    _Tensor(
        _L + "self_attn.k_norm.weight",
        ("model", "layers", "self_attn", "k_norm", "weight"),
        _identity,
        _identity,
        when=lambda cfg: cfg.qk_norm,
    ),
    _Tensor(
        _L + "mlp.gate.weight",
        ("model", "layers", "mlp", "gate", "kernel"),
        _transpose,
        _transpose,
        layers="sparse",
    ),
    _Tensor(
        _L + "mlp.gate_proj.weight",
        ("model", "layers", "mlp", "gate_proj", "kernel"),
        _transpose,
        _transpose,
        layers="dense",
    ),
    _Tensor(
        _L + "mlp.experts.{j}.gate_proj.weight",
        ("model", "layers", "mlp", "experts", "gate_proj"),
        _transpose,
        _transpose,
        stack=2,
        layers="sparse",
    ),
    _Tensor(
        _L + "mlp.up_proj.weight",
        ("model", "layers", "mlp", "up_proj", "kernel"),
        _transpose,
        _transpose,
        layers="dense",
    ),
    _Tensor(
        _L + "mlp.experts.{j}.up_proj.weight",
        ("model", "layers", "mlp", "experts", "up_proj"),
        _transpose,
        _transpose,
        stack=2,
        layers="sparse",
    ),
    _Tensor(
        _L + "mlp.down_proj.weight",
        ("model", "layers", "mlp", "down_proj", "kernel"),
        _transpose,
        _transpose,
        layers="dense",
    ),
    _Tensor(
        _L + "mlp.experts.{j}.down_proj.weight",
        ("model", "layers", "mlp", "experts", "down_proj"),
        _transpose,
        _transpose,
        stack=2,
        layers="sparse",
    ),
    _Tensor(
        _L + "input_layernorm.weight",
        ("model", "layers", "input_layernorm", "weight"),
        _identity,
        _identity,
    ),
    _Tensor(
        _L + "post_attention_layernorm.weight",
        ("model", "layers", "post_attention_layernorm", "weight"),
        _identity,
        _identity,
    ),
)


def _active_tensors(cfg: ModelConfig):
    return [t for t in _TENSORS if t.when(cfg)]


def _placements(entry: _Tensor, cfg: ModelConfig):
    """(parameter path, decoder layer of each stacked row or None) of ``entry`` in ``cfg``'s
    model: one per layer stack that has the tensor (``ModelConfig.layer_stacks``: a mixed
    Qwen3-MoE keeps its dense layers under ``model.dense_layers``)."""
    if entry.stack == 0:
        return [(entry.path, None)]
    out = []
    for name, layers in cfg.layer_stacks.items():
        sparse = cfg.is_moe and name == "layers"
        if entry.layers == "all" or entry.layers == ("sparse" if sparse else "dense"):
            out.append(((entry.path[0], name, *entry.path[2:]), layers))
    return out


def _stack_indices(entry: _Tensor, cfg: ModelConfig):
    """(parameter path, index tuple, HF name) of every tensor of ``entry``: () for a whole
    tensor, (row,) per layer, (row, j) per layer and expert (row: the layer's place in its
    stack, i in the HF name)."""
    out = []
    for path, layers in _placements(entry, cfg):
        if layers is None:
            out.append((path, (), entry.hf_name))
        elif entry.stack == 1:
            out += [(path, (r,), entry.hf_name.format(i=i)) for r, i in enumerate(layers)]
        else:
            out += [
                (path, (r, j), entry.hf_name.format(i=i, j=j))
                for r, i in enumerate(layers)
                for j in range(cfg.num_experts)
            ]
    return out


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor a checkpoint of ``cfg`` must hold."""
    d, f, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    n, k, h = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    fe = cfg.moe_intermediate_size
    shapes_by_entry = {
        "model.embed_tokens.weight": (v, d),
        "model.norm.weight": (d,),
        "lm_head.weight": (v, d),
        "self_attn.q_proj.weight": (n * h, d),
        "self_attn.q_proj.bias": (n * h,),
        "self_attn.k_proj.weight": (k * h, d),
        "self_attn.k_proj.bias": (k * h,),
        "self_attn.v_proj.weight": (k * h, d),
        "self_attn.v_proj.bias": (k * h,),
        "self_attn.o_proj.weight": (d, n * h),
        "self_attn.o_proj.bias": (d,),
        "self_attn.q_norm.weight": (h,),
        "self_attn.k_norm.weight": (h,),
        "mlp.gate.weight": (cfg.num_experts, d),
        "mlp.gate_proj.weight": (f, d),
        "mlp.up_proj.weight": (f, d),
        "mlp.down_proj.weight": (d, f),
        "mlp.experts.{j}.gate_proj.weight": (fe, d),
        "mlp.experts.{j}.up_proj.weight": (fe, d),
        "mlp.experts.{j}.down_proj.weight": (d, fe),
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
    }
    shapes = {}
    for entry in _active_tensors(cfg):
        shape = shapes_by_entry[entry.hf_name.removeprefix(_L)]
        for _, _, name in _stack_indices(entry, cfg):
            shapes[name] = shape
    return shapes


# ----------------------------------------------------------------------------------------------
# Loading


def _weight_files(path: str, handles: dict) -> dict[str, str]:
    """HF tensor name -> safetensors file, from the index or by scanning the files."""
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        return {name: os.path.join(path, fname) for name, fname in weight_map.items()}
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files and no {SAFETENSORS_INDEX}")
    out = {}
    for fname in files:
        full = os.path.join(path, fname)
        for name in _open(full, handles).keys():
            out[name] = full
    return out


def _open(file: str, handles: dict):
    """A safetensors handle, opened once per load (``handles`` lives only as long as the load,
    so no file stays open or mapped afterwards, e.g. after an export directory is replaced)."""
    if file not in handles:
        if not os.path.exists(file):
            raise CheckpointError(f"{file}: file listed in the checkpoint is missing")
        try:
            handles[file] = safe_open(file, framework="numpy")
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
    return handles[file]


def _validate(cfg: ModelConfig, files: dict[str, str], handles: dict) -> None:
    expected = expected_hf_shapes(cfg)
    present = {n for n in files if not n.endswith(_IGNORED_SUFFIXES)}
    if cfg.tie_word_embeddings:
        present.discard("lm_head.weight")  # some tied checkpoints store the shared matrix twice
    missing = sorted(set(expected) - present)
    if missing:
        raise CheckpointError(f"missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    unexpected = sorted(present - set(expected))
    if unexpected:
        raise CheckpointError(
            f"unexpected tensor {unexpected[0]!r} in {files[unexpected[0]]} "
            f"({len(unexpected)} unexpected in all)"
        )
    for name, shape in expected.items():
        try:
            found = tuple(_open(files[name], handles).get_slice(name).get_shape())
        except SafetensorError as e:
            raise CheckpointError(f"{files[name]}: cannot read tensor {name!r} ({e})") from None
        if found != shape:
            raise CheckpointError(
                f"tensor {name!r} in {files[name]} has shape {list(found)}, expected {list(shape)}"
            )


def _read(files, name, handles):
    try:
        return _open(files[name], handles).get_tensor(name)
    except SafetensorError as e:
        raise CheckpointError(f"{files[name]}: cannot read tensor {name!r} ({e})") from None


def load_hf(
    path: str | os.PathLike,
    *,
    dtype: DTypeLike = "float32",
    param_dtype: DTypeLike = "float32",
    mesh=None,
    remat: bool = False,
    scan_layers: bool = True,
    attention_query_chunk: int | None = None,
    moe_impl: MoEImpl = "auto",
    lora: LoRAConfig | None = None,
    lora_seed: int = 0,
    router_aux_loss: bool = False,
) -> CausalLM:
    """Loads a Hugging Face Qwen2 checkpoint directory into a ``CausalLM``.

    Args:
      path: directory with config.json and model.safetensors (or an index and its shards).
      dtype: compute dtype, float32 or bfloat16, in any spelling (``jnp.bfloat16``,
        ``np.float32``, ``"bf16"``...).
      param_dtype: storage dtype of the parameters (the same choices).
      mesh: a ('data', 'fsdp', 'tensor') mesh; parameters are placed with their rule-derived
        shardings, each device receiving only its shard. None: the default device.
      attention_query_chunk: attention over blocks of this many queries
        (``ModelConfig.attention_query_chunk``); None: all at once.
      moe_impl: MoE only, the expert block's kernel (``ModelConfig.moe_impl``).
      router_aux_loss: MoE only, add the load-balancing loss to updates
        (``ModelConfig.router_aux_loss``).
      lora: add fresh low-rank adapters (``model.lora``; A random from ``lora_seed``, B zero, so
        the model computes the checkpoint's function); ``model.peft.load_adapter`` loads saved
        ones.

    Raises:
      ConfigError: a bad argument (named in the message, e.g. ``load_hf(dtype=...)``).
      CheckpointError: a directory that is not a Qwen2 checkpoint jaxrlvr can load.
    """
    # The caller's arguments first, so that a bad one is never blamed on the checkpoint.
    dtype = dtype_name(dtype, argument="load_hf(dtype=...)")
    param_dtype = dtype_name(param_dtype, argument="load_hf(param_dtype=...)")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a checkpoint directory")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise CheckpointError(f"{path}: missing config.json")
    try:
        cfg = ModelConfig.from_json(
            path,
            dtype=dtype,
            param_dtype=param_dtype,
            remat=remat,
            scan_layers=scan_layers,
            attention_query_chunk=attention_query_chunk,
            moe_impl=moe_impl,
            lora=lora,
            router_aux_loss=router_aux_loss,
        )
    except ConfigError as e:
        raise CheckpointError(f"{os.path.join(path, 'config.json')}: {e}") from None
    handles: dict = {}
    files = _weight_files(path, handles)
    _validate(cfg, files, handles)

    abstract = nnx.eval_shape(lambda: CausalLM(cfg, rngs=nnx.Rngs(0), mesh=mesh))
    graphdef, abstract_params = nnx.split(abstract)
    if mesh is None:
        device_sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    storage = cfg.storage_dtype

    def build(entry: _Tensor, var: nnx.Variable, rows) -> jax.Array:
        """The parameter ``var`` of ``entry``; ``rows``: the decoder layer of each stacked row."""
        shape = var.get_value().shape
        if mesh is None:
            target = device_sharding
        else:
            target = sharding.logical_sharding(var.logical_axes, shape, mesh)

        @functools.lru_cache(maxsize=2 + (cfg.num_experts if entry.stack == 2 else 0))
        def tensor(*ij: int) -> np.ndarray:
            name = entry.hf_name.format(**dict(zip("ij", ij)))
            return np.asarray(entry.to_ours(_read(files, name, handles), cfg)).astype(storage)

        def callback(index):
            if entry.stack == 0:
                return tensor()[index]
            layers = [rows[r] for r in range(*index[0].indices(shape[0]))]
            if entry.stack == 1:
                return np.stack([tensor(i)[index[1:]] for i in layers])
            experts = range(*index[1].indices(shape[1]))
            return np.stack([np.stack([tensor(i, j)[index[2:]] for j in experts]) for i in layers])

        return jax.make_array_from_callback(shape, target, callback)

    params_by_path = {}
    for entry in _active_tensors(cfg):
        for path, rows in _placements(entry, cfg):
            var = abstract_params
            for key in path:
                var = var[key]
            params_by_path[path] = var.replace(build(entry, var, rows))
    if cfg.lora is not None:
        params_by_path.update(nnx.to_flat_state(init_adapters(cfg, seed=lora_seed, mesh=mesh)))

    return nnx.merge(graphdef, nnx.from_flat_state(params_by_path))


def init_compiler_options() -> dict[str, int] | None:
    """XLA options of the random-init programs (``init_state_fn``, ``init_adapters``): LLVM at
    -O1. They are threefry bit mixing and the normal distribution's transform, which compile in
    under half the default -O3's time (the demos' 2.3-2.6 s -> 1.0-1.2 s; 3.6 -> 1.7 s with
    LoRA) to the same bits (-O1, -O2 and -O3 agree on every parameter of six model configs,
    dense, MoE, bf16, scanned, LoRA; -O0 does not; tests/model/test_weights.py checks it). An
    ``xla_backend_optimization_level`` in ``XLA_FLAGS`` wins (None: the tests' -O0)."""
    if "xla_backend_optimization_level" in os.environ.get("XLA_FLAGS", ""):
        return None
    return {"xla_backend_optimization_level": 1}


def init_adapters(cfg: ModelConfig, *, seed: int = 0, mesh=None) -> nnx.State:
    """Fresh ``LoRAParam`` leaves of a model with ``cfg.lora`` (A from ``seed``'s ``lora``
    stream, B zero), sharded like the kernels when ``mesh`` is given. One jitted program: the
    random base it builds beside them is dead code and never computed."""

    @functools.partial(jax.jit, compiler_options=init_compiler_options())
    def create():
        model = CausalLM(cfg, rngs=nnx.Rngs(seed, lora=lora_lib.stream_seed(seed)), mesh=mesh)
        state = nnx.state(model, lora_lib.LoRAParam)
        if mesh is None:
            return state
        return jax.lax.with_sharding_constraint(state, sharding.param_shardings(state, mesh))

    return create()


# ----------------------------------------------------------------------------------------------
# Saving


def hf_state_dict(
    cfg: ModelConfig, params: nnx.State, *, dtype: DTypeLike | None = None
) -> dict[str, np.ndarray]:
    """HF tensor name -> numpy array (HF layout), one device transfer.

    ``dtype``: cast on the device before the transfer (e.g. bfloat16 for a bf16 vLLM server:
    half the bytes to move and write); None keeps the parameter storage dtype.
    """
    pure = nnx.to_pure_dict(params)
    if dtype is not None:
        target = jnp.dtype(dtype_name(dtype, argument="hf_state_dict(dtype=...)"))
        pure = jax.tree.map(lambda x: x.astype(target) if x.dtype != target else x, pure)
    host = jax.device_get(pure)
    out: dict[str, np.ndarray] = {}
    for entry in _active_tensors(cfg):
        for path, index, name in _stack_indices(entry, cfg):
            arr = host
            for key in path:
                arr = arr[key]
            out[name] = np.ascontiguousarray(entry.to_hf(np.asarray(arr)[index], cfg))
    return out


def _atomic_save_file(tensors: dict[str, np.ndarray], file: str) -> None:
    """``safetensors`` to a temporary name in the same directory, renamed into place: a reader
    (a vLLM server reloading, a loader) never sees a half-written file."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=os.path.dirname(file))
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.replace(tmp, file)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def _atomic_write_json(obj, file: str) -> None:
    tmp = file + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2)
    os.replace(tmp, file)


def save_state_dict(
    tensors: dict[str, np.ndarray],
    path: str,
    *,
    max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
) -> list[str]:
    """Writes safetensors, each file atomically; returns the file names.

    One ``model.safetensors`` unless the tensors exceed ``max_shard_bytes`` (None: never split),
    else ``model-0000i-of-0000n.safetensors`` shards and their index. Weight files of an earlier
    layout (a stale index, single file or shards) are removed, so a loader never mixes the two.
    """
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, arr in tensors.items():
        if max_shard_bytes is not None and shards[-1] and size + arr.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = arr
        size += arr.nbytes
    if len(shards) == 1:
        names = [SAFETENSORS_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for fname, shard in zip(names, shards):
        _atomic_save_file(shard, os.path.join(path, fname))
    index = os.path.join(path, SAFETENSORS_INDEX)
    if len(shards) > 1:
        weight_map = {k: fname for fname, shard in zip(names, shards) for k in shard}
        total = sum(a.nbytes for a in tensors.values())
        _atomic_write_json({"metadata": {"total_size": total}, "weight_map": weight_map}, index)
    elif os.path.exists(index):
        os.remove(index)
    for fname in os.listdir(path):
        stale = fname == SAFETENSORS_FILE or _SHARD_NAME.fullmatch(fname)
        if stale and fname not in names:
            os.remove(os.path.join(path, fname))
    return names


def copy_tokenizer(source, path: str) -> None:
    """Copies tokenizer files from a directory, or calls ``save_pretrained`` on a tokenizer."""
    if hasattr(source, "save_pretrained"):
        source.save_pretrained(path)
        return
    for fname in _TOKENIZER_FILES:
        src = os.path.join(os.fspath(source), fname)
        if os.path.exists(src):
            shutil.copy2(src, os.path.join(path, fname))


def save_hf_params(
    cfg: ModelConfig,
    params: nnx.State,
    path: str | os.PathLike,
    *,
    untied: bool = False,
    config: Literal["always", "if_missing", "never"] = "always",
    tokenizer_src=None,
    max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
    dtype: DTypeLike | None = None,
) -> dict[str, float]:
    """Writes ``params`` as a Hugging Face checkpoint directory: the one HF writer.

    ``save_hf`` (a model, for transformers) and ``sampling.weight_export.export_weights`` (every
    RL step, for a vLLM server to reload) both call this. Every file is written under a temporary
    name and renamed into place.

    Args:
      cfg: the model's config; params: its ``nnx.Param`` state (LoRA adapters in it are not
        written: the base weights are; ``save_hf`` merges them first).
      untied: for a tied model, also write ``lm_head.weight`` (a copy of the embedding) and say
        ``tie_word_embeddings: false`` in config.json.
      config: write config.json "always", only "if_missing" (a repeated export of new weights
        into the same directory skips it), or "never".
      tokenizer_src: a tokenizer directory or object whose files are copied alongside.
      max_shard_bytes: split the safetensors above this size (None: always one file).
      dtype: the tensors' dtype in the files (and config.json's ``dtype``); None: storage dtype.

    Returns:
      ``to_host_s`` (device -> NumPy in HF layout), ``write_s`` (files), ``num_params`` and
      ``bytes`` of the tensors written.
    """
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    t0 = time.perf_counter()
    tensors = hf_state_dict(cfg, params, dtype=dtype)
    if untied and cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    t1 = time.perf_counter()
    save_state_dict(tensors, path, max_shard_bytes=max_shard_bytes)
    config_file = os.path.join(path, "config.json")
    if config == "always" or (config == "if_missing" and not os.path.exists(config_file)):
        hf = cfg.to_hf_config(untied=untied)
        if dtype is not None:
            hf["dtype"] = dtype_name(dtype)
        _atomic_write_json(hf, config_file)
    if tokenizer_src is not None:
        copy_tokenizer(tokenizer_src, path)
    t2 = time.perf_counter()
    return {
        "to_host_s": t1 - t0,
        "write_s": t2 - t1,
        "num_params": float(sum(v.size for v in tensors.values())),
        "bytes": float(sum(v.nbytes for v in tensors.values())),
    }


def save_hf(
    model: CausalLM,
    path: str | os.PathLike,
    *,
    tokenizer_src=None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> str:
    """Writes config.json and safetensors that ``transformers.AutoModelForCausalLM`` loads.

    A model with LoRA adapters is written merged (``lora.merged``: each adapter folded into its
    kernel), a plain checkpoint of the function it computes; ``model.peft.save_adapter`` writes
    the adapters alone. (``save_hf_params`` / ``hf_state_dict`` write the base weights only.)"""
    params = nnx.state(model, nnx.Param)
    if model.config.lora is not None:
        params = lora_lib.merged(model.config.lora, params)
    save_hf_params(
        model.config,
        params,
        path,
        tokenizer_src=tokenizer_src,
        max_shard_bytes=max_shard_bytes,
    )
    return os.fspath(path)


def init_model(cfg: ModelConfig, *, seed: int = 0, mesh=None) -> CausalLM:
    """A randomly initialised model; with a mesh, created directly with its shardings.

    Creation runs as one jitted program (``init_state_fn``): eager construction would compile a
    random-number kernel per parameter shape (seconds each on a CPU). With or without a mesh the
    values are the same (to float32 rounding: XLA may fuse the scaling differently from eager
    construction).
    """
    abstract = nnx.eval_shape(
        lambda: CausalLM(cfg, rngs=nnx.Rngs(seed, lora=lora_lib.stream_seed(seed)), mesh=mesh)
    )
    graphdef, _ = nnx.split(abstract)
    return nnx.merge(graphdef, init_state_fn(cfg, seed=seed, mesh=mesh)())


def init_state_fn(cfg: ModelConfig, *, seed: int = 0, mesh=None):
    """The jitted program that ``init_model`` runs: ``() -> nnx.State`` of a new model, sharded
    by ``param_shardings`` when ``mesh`` is given (compiled with ``init_compiler_options``)."""

    @functools.partial(jax.jit, compiler_options=init_compiler_options())
    def create():
        model = CausalLM(cfg, rngs=nnx.Rngs(seed, lora=lora_lib.stream_seed(seed)), mesh=mesh)
        state = nnx.state(model)
        if mesh is None:
            return state
        shardings = sharding.param_shardings(state, mesh)
        return jax.lax.with_sharding_constraint(state, shardings)

    return create


def param_count(model_or_params) -> int:
    params = (
        model_or_params
        if isinstance(model_or_params, nnx.State)
        else nnx.state(model_or_params, nnx.Param)
    )
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))


__all__ = [
    "CheckpointError",
    "expected_hf_shapes",
    "hf_state_dict",
    "init_adapters",
    "init_model",
    "load_hf",
    "param_count",
    "save_hf",
    "save_hf_params",
    "save_state_dict",
]
