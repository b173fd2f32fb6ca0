"""Model configuration of the one decoder (Qwen2 / Qwen2.5, Qwen3, Qwen3-MoE), from or to HF
config.json.

The family is configuration (``model_type``): Qwen3 adds per-head RMSNorm on queries and keys
(``qk_norm``), an explicit ``head_dim`` and ``attention_bias`` (q/k/v/o biases, off in every
released checkpoint; Qwen2 always has q/k/v biases and no o bias); Qwen3-MoE replaces the MLP by a
routed expert block (``num_experts``, ``num_experts_per_tok``, ``moe_intermediate_size``,
``norm_topk_prob``, ``router_aux_loss_coef``).

The dataclass holds exactly the fields the forward pass needs plus the numeric dtypes jaxrlvr adds
(compute ``dtype``, storage ``param_dtype``) and the layer-loop choices ``remat`` and
``scan_layers``. Fields that only matter to other tools
(token ids, ``torch_dtype``...) ride along in ``hf_config`` so ``to_hf_config`` round-trips them.

Qwen3-MoE may mix dense and sparse layers (transformers' rule: layer i runs the routed block iff
``i not in mlp_only_layers`` and ``(i + 1) % decoder_sparse_step == 0``, else a dense SwiGLU of
``intermediate_size``); ``ModelConfig.sparse_layers`` says which, and ``layer_stacks`` where each
layer's parameters live (``decoder``: the sparse layers in ``model.layers``, the dense ones in
``model.dense_layers``).

Refused in one line naming the field (``from_hf_config``): sliding-window attention, rope scaling
other than the default, activations other than SiLU, Qwen2-MoE's shared expert, and a Qwen3-MoE
layout without any sparse layer.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any, Literal, get_args

import jax
import jax.numpy as jnp

from jaxrlvr.model.lora import ATTENTION_TARGETS, LoRAConfig

DType = Literal["float32", "bfloat16"]
DTYPES: tuple[str, ...] = get_args(DType)
# What ``dtype_name`` accepts: a name ("float32", "bf16"), or a NumPy, JAX, ml_dtypes or torch dtype
# or scalar type (np.float32, jnp.bfloat16, jnp.dtype("bfloat16"), torch.bfloat16).
DTypeLike = jax.typing.DTypeLike
# Short spellings common in training configs (HF TrainingArguments' bf16, "fp32").
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "f32": "float32"}
_SUPPORTED_ROPE_TYPES = ("default",)
ModelType = Literal["qwen2", "qwen3", "qwen3_moe"]
# The MoE block's grouped-matmul kernel (``model.moe``).
MoEImpl = Literal["auto", "block_loop", "sorted_blocks", "dense", "ragged_dot"]
MODEL_TYPES: tuple[str, ...] = get_args(ModelType)
_ARCHITECTURES = {
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


class ConfigError(ValueError):
    """A model config that jaxrlvr cannot honour exactly."""


def dtype_name(value: DTypeLike, *, argument: str = "dtype") -> DType:
    """The canonical name ("float32" or "bfloat16") of any spelling of a supported dtype.

    The one place where the public API's dtype arguments are normalised (``ModelConfig``,
    ``load_hf``, presets and ``from_hf_config`` overrides all call it), so a config always holds a
    plain string. ``argument`` names the caller's argument in the error, e.g.
    ``load_hf(dtype=...): 'float64' is not supported; expected one of float32, bfloat16``.
    """
    expected = ", ".join(DTYPES)
    if isinstance(value, str) or type(value).__module__ == "torch":
        # torch dtypes print as "torch.bfloat16"; NumPy does not know them.
        text = str(value).strip().lower().removeprefix("torch.")
        text = _DTYPE_ALIASES.get(text, text)
    else:
        text = value
    try:
        name = None if value is None else jnp.dtype(text).name
    except TypeError:
        name = None
    if name is None:
        raise ConfigError(f"{argument}: {value!r} is not a dtype; expected one of {expected}")
    if name not in DTYPES:
        raise ConfigError(f"{argument}: {name!r} is not supported; expected one of {expected}")
    return name


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """The decoder's architecture (its family is ``model_type``) plus jaxrlvr's numeric and
    layer-loop choices.

    ``model_type``: "qwen2" (q/k/v biases), "qwen3" (per-head q/k RMSNorm before RoPE; biases on
    q/k/v/o when ``attention_bias``) or "qwen3_moe" (Qwen3's attention and, in sparse layers, the
    routed expert block of ``num_experts`` experts of width ``moe_intermediate_size``, each token
    sent to ``num_experts_per_tok`` of them; ``norm_topk_prob`` renormalises the chosen gate
    weights to sum to 1; ``router_aux_loss_coef`` is the checkpoint's load-balancing coefficient;
    ``router_aux_loss`` (jaxrlvr's switch, not in config.json; off by default, as RL stacks run
    it) adds ``router_aux_loss_coef`` x transformers' load-balancing loss to every update's loss,
    ``model.moe.add_router_terms``). ``decoder_sparse_step`` / ``mlp_only_layers``: which layers
    are sparse (``sparse_layers``; transformers' rule), the others a dense SwiGLU of
    ``intermediate_size``. ``moe_impl``: the MoE block's grouped-matmul kernel
    (``model.moe``; "auto" picks by backend, and on the CPU by shape).

    ``remat``: recompute each decoder layer's activations in the backward pass instead of
    keeping them. ``scan_layers``: run the stacked decoder layers with ``lax.scan`` (one layer
    traced and compiled: compile time independent of depth; the default) or, when False, as an
    unrolled loop over the same stacked parameters for full-sequence calls (training and
    log-probs): XLA then keeps each layer's activations as separate buffers instead of copying
    them into and out of per-layer stacks, which made the reference update step ~15% faster on
    CPU, at ~1.5x the compile time (MaxText's ``scan_layers`` makes the same trade). Calls with a
    KV cache always scan. Neither choice changes parameters, checkpoints or results.

    ``attention_query_chunk``: in cache-free calls (training forwards, log-prob passes) longer
    than this many positions, attention runs over blocks of that many queries one at a time,
    rematerialised, so that one block's float32 scores [B, heads, block, T] exist instead of the
    whole [B, heads, T, T] (memory-efficient attention, the same function; what flash attention
    buys on accelerators, in portable XLA). None: all queries at once (the fastest at short T).
    Not part of config.json.

    ``lora``: low-rank adapters on the projections (``model.lora.LoRAConfig``): the model then
    carries float32 ``LoRAParam`` leaves beside the kernels and only they are trained; None: a
    plain model. Not part of config.json (adapters are saved in PEFT's layout, ``model.peft``).

    ``dtype`` (compute) and ``param_dtype`` (storage) accept any spelling ``dtype_name`` does
    (``jnp.bfloat16``, ``np.float32``, ``"bf16"``...) and hold its canonical name afterwards.
    ``lm_head_dtype``: the output projection's product dtype when it should differ from
    ``dtype`` ("float32" with a bfloat16 model: the FP32 LM head of MiniMax-M1 and ScaleRL,
    TRL's ``cast_lm_head_to_fp32``: the last hidden states and the head's weight enter the
    product in float32 instead of being rounded to bfloat16); None: ``dtype``. The logits are
    accumulated in float32 either way. Not part of config.json.
    """

    vocab_size: int
    model_type: ModelType = "qwen2"
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim_override: int | None = None
    max_position_embeddings: int = 32768
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    initializer_range: float = 0.02
    attention_bias: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.001
    router_aux_loss: bool = False
    moe_impl: MoEImpl = "auto"
    dtype: DType = "float32"
    param_dtype: DType = "float32"
    lm_head_dtype: DType | None = None
    remat: bool = False
    scan_layers: bool = True
    attention_query_chunk: int | None = None
    lora: LoRAConfig | None = None
    hf_config: Mapping[str, Any] | None = dataclasses.field(
        default=None, compare=False, repr=False, hash=False
    )

    def __post_init__(self):
        for key in ("dtype", "param_dtype"):
            name = dtype_name(getattr(self, key), argument=f"ModelConfig({key}=...)")
            object.__setattr__(self, key, name)  # frozen: normalised once, here
        if self.lm_head_dtype is not None:
            name = dtype_name(self.lm_head_dtype, argument="ModelConfig(lm_head_dtype=...)")
            object.__setattr__(self, "lm_head_dtype", name)
        only = tuple(sorted({int(i) for i in self.mlp_only_layers}))
        object.__setattr__(self, "mlp_only_layers", only)  # hashable (a static jit argument)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
        ):
            if int(getattr(self, key)) <= 0:
                raise ConfigError(f"model.{key}={getattr(self, key)!r}: must be a positive integer")
        chunk = self.attention_query_chunk
        if chunk is not None and (isinstance(chunk, bool) or int(chunk) != chunk or chunk <= 0):
            raise ConfigError(
                f"model.attention_query_chunk={chunk!r}: must be a positive integer or null"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.head_dim_override is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.moe_impl not in get_args(MoEImpl):
            raise ConfigError(
                f"model.moe_impl={self.moe_impl!r}: expected one of {', '.join(get_args(MoEImpl))}"
            )
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"model.model_type={self.model_type!r}: expected one of {', '.join(MODEL_TYPES)}"
            )
        if self.model_type == "qwen2" and self.attention_bias:
            raise ConfigError(
                "model.attention_bias: Qwen2 has fixed q/k/v biases; set only for qwen3"
            )
        if self.is_moe:
            for key in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if int(getattr(self, key)) <= 0:
                    raise ConfigError(f"model.{key}={getattr(self, key)!r}: must be positive")
            if self.num_experts_per_tok > self.num_experts:
                raise ConfigError(
                    f"model.num_experts_per_tok={self.num_experts_per_tok} exceeds "
                    f"num_experts={self.num_experts}"
                )
            if int(self.decoder_sparse_step) <= 0:
                raise ConfigError(
                    f"model.decoder_sparse_step={self.decoder_sparse_step!r}: must be positive"
                )
            only = self.mlp_only_layers
            bad = [i for i in only if not 0 <= i < self.num_hidden_layers]
            if bad:
                raise ConfigError(
                    f"model.mlp_only_layers has {bad[0]}: not a layer of "
                    f"num_hidden_layers={self.num_hidden_layers}"
                )
            if not any(self.sparse_layers):
                raise ConfigError(
                    f"model.decoder_sparse_step={self.decoder_sparse_step}, mlp_only_layers="
                    f"{list(self.mlp_only_layers)}: no sparse layer left (use model_type qwen3)"
                )
        elif self.decoder_sparse_step != 1 or self.mlp_only_layers:
            raise ConfigError(
                "model.decoder_sparse_step / mlp_only_layers: need model_type='qwen3_moe'"
            )
        elif self.router_aux_loss:
            raise ConfigError("model.router_aux_loss: needs a MoE model (model_type qwen3_moe)")
        elif self.num_experts:
            raise ConfigError(
                f"model.num_experts={self.num_experts}: experts need model_type='qwen3_moe'"
            )
        if self.moe_impl not in get_args(MoEImpl):
            raise ConfigError(
                f"model.moe_impl={self.moe_impl!r}: expected one of {', '.join(get_args(MoEImpl))}"
            )
        if self.lora is not None and not isinstance(self.lora, LoRAConfig):
            raise ConfigError(f"model.lora={self.lora!r}: expected a LoRAConfig or None")
        if self.lora is not None and self.is_moe:
            # A MoE block has no dense projections: its router and experts take no adapters (as
            # PEFT's "all-linear" finds no nn.Linear in them), so the targets narrow, once, here.
            # The dense MLPs of a mixed layout take none either: an adapter on some layers only
            # is a layer subset, which PEFT's layout (``model.peft``) does not describe.
            kept = tuple(t for t in self.lora.targets if t in ATTENTION_TARGETS)
            if not kept:
                raise ConfigError(
                    f"model.lora.targets={list(self.lora.targets)}: a MoE model's experts and "
                    f"router take no adapters; target some of {list(ATTENTION_TARGETS)}"
                )
            if kept != self.lora.targets:
                object.__setattr__(self, "lora", dataclasses.replace(self.lora, targets=kept))
        if self.head_dim % 2:
            raise ConfigError(f"model head_dim={self.head_dim} must be even for rotary embeddings")

    # Derived values.
    @property
    def is_moe(self) -> bool:
        """A Qwen3-MoE: the routed expert block in its sparse layers (``sparse_layers``)."""
        return self.model_type == "qwen3_moe"

    @property
    def sparse_layers(self) -> tuple[bool, ...]:
        """Per layer, whether it runs the routed expert block (transformers'
        ``Qwen3MoeDecoderLayer``: ``i not in mlp_only_layers and (i + 1) %
        decoder_sparse_step == 0``); all False for a dense model."""
        if not self.is_moe:
            return (False,) * self.num_hidden_layers
        step, only = self.decoder_sparse_step, set(self.mlp_only_layers)
        return tuple(i not in only and (i + 1) % step == 0 for i in range(self.num_hidden_layers))

    @property
    def mixed_layers(self) -> bool:
        """A Qwen3-MoE with some dense layers (``sparse_layers`` not all True)."""
        return self.is_moe and not all(self.sparse_layers)

    @property
    def layer_stacks(self) -> dict[str, tuple[int, ...]]:
        """Where each decoder layer's parameters live: stack name (under ``model``) -> the
        layer indices it holds, in order. ``layers`` holds every layer of a uniform model; a
        mixed layout keeps its sparse layers there and its dense ones in ``dense_layers``."""
        if not self.mixed_layers:
            return {"layers": tuple(range(self.num_hidden_layers))}
        sparse = self.sparse_layers
        return {
            "layers": tuple(i for i, s in enumerate(sparse) if s),
            "dense_layers": tuple(i for i, s in enumerate(sparse) if not s),
        }

    @property
    def qk_norm(self) -> bool:
        """Per-head RMSNorm on queries and keys before RoPE (Qwen3)."""
        return self.model_type != "qwen2"

    @property
    def qkv_bias(self) -> bool:
        return self.model_type == "qwen2" or self.attention_bias

    @property
    def o_bias(self) -> bool:
        return self.model_type != "qwen2" and self.attention_bias

    @property
    def head_dim(self) -> int:
        if self.head_dim_override is not None:
            return self.head_dim_override
        return self.hidden_size // self.num_attention_heads

    @property
    def num_groups(self) -> int:
        """Query heads per key/value head (grouped-query attention)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def head_dtype(self):
        """The lm_head product's input dtype: ``lm_head_dtype``, else the compute dtype."""
        return jnp.dtype(self.lm_head_dtype or self.dtype)

    @property
    def storage_dtype(self):
        return jnp.dtype(self.param_dtype)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def num_params(self, *, active: bool = False) -> int:
        """Exact parameter count (the same number transformers reports). ``active``: only the
        parameters one token's forward uses (MoE: the router and ``num_experts_per_tok``
        experts; dense models: all)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        n, k, h = self.num_attention_heads, self.num_key_value_heads, self.head_dim
        attn = d * n * h + 2 * d * k * h + n * h * d
        if self.qkv_bias:
            attn += n * h + 2 * k * h
        if self.o_bias:
            attn += d
        if self.qk_norm:
            attn += 2 * h
        experts = self.num_experts_per_tok if active else self.num_experts
        sparse_mlp = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
        num_sparse = sum(self.sparse_layers)
        mlp = num_sparse * sparse_mlp + (self.num_hidden_layers - num_sparse) * 3 * d * f
        embed = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * (attn + 2 * d) + mlp + embed + d

    def num_non_embedding_params(self) -> int:
        return self.num_params() - self.vocab_size * self.hidden_size * (
            1 if self.tie_word_embeddings else 2
        )

    def flops_per_token(self, seq_len: int, *, training: bool = True) -> float:
        """Model FLOPs per token in rows of ``seq_len`` positions: the one formula behind every
        MFU figure (``bench update``, ``bench gpu_check``).

        Forward: 2 x the matmul parameters (the non-embedding parameters a token uses, for MoE
        its k experts and the router, plus the lm_head's V x D, which runs tied or not; the
        embedding lookup is no matmul) + attention's
        4 x layers x heads x head_dim x ``seq_len`` (scores and the weighted sum, PaLM's
        appendix B). ``training``: three times that (forward + backward). Rematerialisation's
        recompute is not counted, so a figure built on it is MFU, not hardware utilisation.
        """
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        matmul_params = self.num_params(active=True) - embed + self.vocab_size * self.hidden_size
        attention = 4 * self.num_hidden_layers * self.num_attention_heads * self.head_dim * seq_len
        forward = 2 * matmul_params + attention
        return float(3 * forward if training else forward)

    # Hugging Face interop.
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides) -> ModelConfig:
        """Builds the config from a parsed HF ``config.json`` (model_type qwen2, qwen3 or
        qwen3_moe); a field the decoder does not implement is refused in one line naming it."""
        model_type = hf.get("model_type")
        if model_type == "qwen2_moe":
            raise ConfigError(
                "config.json: model_type='qwen2_moe' is not supported (its shared expert, "
                "shared_expert_intermediate_size, is not implemented)"
            )
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"config.json: model_type={model_type!r}, expected one of {', '.join(MODEL_TYPES)}"
            )
        if hf.get("shared_expert_intermediate_size"):
            raise ConfigError(
                "config.json: shared_expert_intermediate_size="
                f"{hf['shared_expert_intermediate_size']!r}: a shared expert is not supported"
            )
        layer_types = hf.get("layer_types") or []
        other = sorted({t for t in layer_types if t != "full_attention"})
        if other:
            raise ConfigError(f"config.json: layer_types has {other[0]!r}; only full_attention")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default")) if rope else "default"
        if rope_type not in _SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"config.json: rope scaling type {rope_type!r} is not supported "
                f"(supported: {_SUPPORTED_ROPE_TYPES})"
            )
        if hf.get("rope_scaling") and hf.get("rope_scaling", {}).get("factor") not in (None, 1.0):
            raise ConfigError(f"config.json: rope_scaling={hf['rope_scaling']!r} is not supported")
        if hf.get("use_sliding_window"):
            raise ConfigError("config.json: use_sliding_window=true is not supported")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"config.json: hidden_act={act!r} is not supported (expected 'silu')")
        theta = rope.get("rope_theta", hf.get("rope_theta", 10000.0)) if rope else None
        if theta is None:
            theta = hf.get("rope_theta", 10000.0)
        fields = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads", hf["num_attention_heads"]),
            head_dim_override=hf.get("head_dim"),
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            initializer_range=float(hf.get("initializer_range", 0.02)),
            hf_config=dict(hf),
        )
        if model_type == "qwen3" and "head_dim" not in hf:
            fields["head_dim_override"] = 128  # Qwen3Config's default (null: hidden / heads)
        if fields["head_dim_override"] == fields["hidden_size"] // fields["num_attention_heads"]:
            fields["head_dim_override"] = None
        if model_type != "qwen2":
            fields["attention_bias"] = bool(hf.get("attention_bias", False))
        if model_type == "qwen3_moe":
            num_experts = hf.get("num_experts", hf.get("num_local_experts", 128))
            fields.update(
                model_type="qwen3_moe",
                num_experts=int(num_experts),
                num_experts_per_tok=int(hf.get("num_experts_per_tok", 8)),
                moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
                decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
                mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
                router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.001)),
            )
        else:
            fields["model_type"] = model_type
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def from_json(cls, path: str | os.PathLike, **overrides) -> ModelConfig:
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no config.json found")
        try:
            with open(path) as f:
                hf = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_config(hf, **overrides)

    def to_hf_config(self, *, untied: bool = False) -> dict[str, Any]:
        """A config.json dict that transformers' config class of ``model_type`` (and vLLM) load.

        ``untied``: say ``tie_word_embeddings: false`` whatever the model does, for a checkpoint
        that stores ``lm_head.weight`` as its own copy of the embedding (the vLLM export).
        """
        out = dict(self.hf_config or {})
        for stale in ("rope_scaling", "torch_dtype", "transformers_version", "_name_or_path"):
            out.pop(stale, None)
        out.update(
            architectures=[_ARCHITECTURES[self.model_type]],
            model_type=self.model_type,
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            max_position_embeddings=self.max_position_embeddings,
            rope_theta=self.rope_theta,
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta},
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings and not untied,
            initializer_range=self.initializer_range,
            hidden_act="silu",
            attention_dropout=0.0,
            use_sliding_window=False,
            dtype=self.param_dtype,
        )
        out.setdefault("sliding_window", None)
        out.setdefault("max_window_layers", self.num_hidden_layers)
        out["layer_types"] = ["full_attention"] * self.num_hidden_layers
        if self.head_dim_override is not None or self.model_type != "qwen2":
            out["head_dim"] = self.head_dim
        if self.model_type != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.is_moe:
            out.pop("num_local_experts", None)  # transformers >= 5.20's name for num_experts
            out.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                router_aux_loss_coef=self.router_aux_loss_coef,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
                output_router_logits=False,
            )
        return out

    # Presets.
    @classmethod
    def qwen2_5_1_5b(cls, **overrides) -> ModelConfig:
        """Qwen2.5-1.5B (its config.json): 1.5B parameters, vocabulary 151,936, tied embeddings.
        For abstract-shape benchmarks and export tests; real weights come from ``load_hf``."""
        fields = dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            max_position_embeddings=131072,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def qwen2_5_0_5b(cls, **overrides) -> ModelConfig:
        """Qwen2.5-0.5B (its config.json): 0.49B parameters, vocabulary 151,936, tied embeddings.
        For the weight-sync benchmark and abstract-shape checks; real weights come from
        ``load_hf``."""
        fields = dict(
            vocab_size=151936,
            hidden_size=896,
            intermediate_size=4864,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            max_position_embeddings=32768,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def qwen2_5_math_1_5b(cls, **overrides) -> ModelConfig:
        """Qwen2.5-Math-1.5B (the course's leaderboard model): Qwen2.5-1.5B's shapes with a
        4,096-token context and rope theta 10,000."""
        return cls.qwen2_5_1_5b(
            **{"max_position_embeddings": 4096, "rope_theta": 10000.0, **overrides}
        )

    @classmethod
    def qwen3_1_7b(cls, **overrides) -> ModelConfig:
        """Qwen3-1.7B (its config.json): 1.72B parameters (1.41B without the embedding),
        vocabulary 151,936, head_dim 128, tied embeddings. For abstract-shape benchmarks."""
        fields = dict(
            model_type="qwen3",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim_override=128,
            max_position_embeddings=40960,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=True,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def qwen3_30b_a3b(cls, **overrides) -> ModelConfig:
        """Qwen3-30B-A3B (its config.json): 30.5B parameters, 3.35B active per token; 48
        layers of 128 experts (width 768), top-8 renormalised. For abstract-shape benchmarks."""
        fields = dict(
            model_type="qwen3_moe",
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim_override=128,
            max_position_embeddings=40960,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            num_experts=128,
            num_experts_per_tok=8,
            moe_intermediate_size=768,
            norm_topk_prob=True,
        )
        fields.update(overrides)
        return cls(**fields)

    @classmethod
    def tiny(cls, **overrides) -> ModelConfig:
        """A ~0.1M-parameter model (vocabulary 128, hidden 64, 2 layers, 4 / 2 heads, tied): the
        one tiny config of the tests and benchmarks, which override its fields (a vocabulary,
        a head size) instead of spelling a config out."""
        fields = dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            tie_word_embeddings=True,
        )
        fields.update(overrides)
        return cls(**fields)
