"""Qwen2 / Qwen2.5 in Flax NNX: config, model with KV cache, HF weight I/O, sharding rules.

from jaxrlvr import model
lm = model.load_hf("/path/to/Qwen2.5-Math-1.5B", mesh=model.make_mesh(model.MeshConfig()))
logits = lm(input_ids, attention_mask)          # [B, T, V] float32
model.save_hf(lm, "/tmp/out")                    # transformers / vLLM load this
"""

from jaxrlvr.model.config import ConfigError, ModelConfig, dtype_name
from jaxrlvr.model.decoder import CausalLM, KVCache, Qwen2ForCausalLM, init_cache
from jaxrlvr.model.sharding import (
    LOGICAL_RULES,
    MeshConfig,
    batch_sharding,
    logical_sharding,
    logical_shardings,
    logical_to_pspec,
    make_mesh,
    param_partition_specs,
    param_shardings,
)
from jaxrlvr.model.weights import (
    CheckpointError,
    hf_state_dict,
    init_model,
    load_hf,
    param_count,
    save_hf,
    save_hf_params,
)

__all__ = [
    "LOGICAL_RULES",
    "CheckpointError",
    "ConfigError",
    "KVCache",
    "MeshConfig",
    "ModelConfig",
    "CausalLM",
    "Qwen2ForCausalLM",
    "batch_sharding",
    "dtype_name",
    "hf_state_dict",
    "init_cache",
    "init_model",
    "load_hf",
    "logical_sharding",
    "logical_shardings",
    "logical_to_pspec",
    "make_mesh",
    "param_count",
    "param_partition_specs",
    "param_shardings",
    "save_hf",
    "save_hf_params",
]
