"""The decoder of Qwen2 / Qwen2.5, Qwen3 and Qwen3-MoE in Flax NNX, with a KV cache.

One decoder: the training forward, prefill and one-token decode all run ``_decoder_layer``; only
the form of the attention product differs with the shapes (see ``grouped_attention``). The
family is configuration (``ModelConfig.model_type``): q/k/v (and o) biases, Qwen3's per-head
``q_norm`` / ``k_norm`` (RMSNorm over head_dim, before RoPE), and for Qwen3-MoE the routed
expert block (``model.moe``) in place of the MLP of its sparse layers (every layer, or those
``ModelConfig.sparse_layers`` marks: a mixed layout runs two stacks, ``_run_mixed_layers``).

Attribute names mirror transformers' ``Qwen2ForCausalLM`` (``model.embed_tokens``,
``model.layers.self_attn.q_proj``, ``input_layernorm``, ``lm_head``) so the weight map in
``weights.py`` is mechanical. Decoder layers are stored stacked along a leading ``layers`` axis
and run with ``lax.scan``: one layer is traced and compiled, not L of them.

Semantics follow transformers: ``attention_mask`` [B, T] marks real tokens (1) and padding (0);
the causal mask is by index; ``position_ids`` default to ``arange(T)`` regardless of padding (pass
them explicitly for left padding). Norms, softmax and rotary tables are computed in float32.

Packed rows (an extension, not in transformers): ``segment_ids`` [B, T] (1, 2, ... per sequence,
0 on padding; ``algos.segments``) restrict attention to keys of the query's own segment, so
several sequences share a row without seeing each other; pass per-segment ``position_ids``.
Shared prompts (``prompt_group_ids`` [B, T], with ``segment_ids``): a group's prompt is laid out
once, its positions in segment 0 with the group's number (1, 2, ... in the row), and each of the
group's completions follows in a segment of its own carrying the same group number; a
completion's queries see its own segment and its group's prompt, the prompt's queries see the
prompt (``rollout.pack(share_prompts=...)``). Values equal those of each completion packed after
its own copy of the prompt.

MoE outputs: ``backbone(..., with_router=True)`` also returns a ``moe.RouterOutput`` (every
layer's chosen experts and load statistics, for the auxiliary loss, metrics and routing
replay); ``routes`` [L, B, T, k] (int, -1 = live top-k) forces the experts (routing replay).

Left out on purpose: sliding-window attention, rope scaling, dropout (Qwen2.5 and Qwen3 use none
of them).
"""

from __future__ import annotations

import functools
import itertools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from jaxrlvr.model import bits, expert_parallel, grad_sink, lora, moe, sharding
from jaxrlvr.model.config import ModelConfig

_MASK_VALUE = float(jnp.finfo(jnp.float32).min)


def _param(rngs: nnx.Rngs | None, shape, std, dtype, axes, init="normal") -> nnx.Param:
    if init == "normal":
        value = jax.random.normal(rngs.params(), shape, jnp.float32) * std
    elif init == "zeros":
        value = jnp.zeros(shape, jnp.float32)
    else:
        value = jnp.ones(shape, jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=axes)


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32, scaled by ``weight`` (HF Qwen2RMSNorm)."""

    def __init__(self, dim: int, eps: float, *, dtype, stack: int | None = None):
        shape, axes = ((stack, dim), ("layers", "norm")) if stack else ((dim,), ("norm",))
        self.weight = _param(None, shape, 0.0, dtype, axes, init="ones")
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight.get_value().astype(x.dtype) * x32.astype(x.dtype)


class Projection(nnx.Module):
    """A dense kernel of any shape (``kernel`` and optional ``bias``), used through einsum.

    With ``name`` among ``cfg.lora.targets``: float32 adapters ``lora_a`` [*in, r] and ``lora_b``
    [r, *out] (``lora.LoRAParam``, the kernel's logical axes, the rank axis replicated);
    ``num_in`` is how many leading kernel axes are inputs."""

    def __init__(
        self,
        kernel_shape,
        kernel_axes,
        bias_shape,
        bias_axes,
        *,
        cfg,
        rngs,
        stack,
        name=None,
        num_in=1,
    ):
        lead, lead_axes = ((stack,), ("layers",)) if stack else ((), ())
        dtype = cfg.storage_dtype
        self.kernel = _param(
            rngs, lead + tuple(kernel_shape), cfg.initializer_range, dtype, lead_axes + kernel_axes
        )
        if bias_shape is not None:
            self.bias = _param(
                None, lead + tuple(bias_shape), 0.0, dtype, lead_axes + bias_axes, "zeros"
            )
        else:
            self.bias = None
        if cfg.lora is not None and name in cfg.lora.targets:
            r = cfg.lora.rank
            in_shape, out_shape = tuple(kernel_shape[:num_in]), tuple(kernel_shape[num_in:])
            in_axes, out_axes = kernel_axes[:num_in], kernel_axes[num_in:]
            a_shape = lead + in_shape + (r,)
            self.lora_a = lora.LoRAParam(
                lora.init_a(lora.init_key(rngs, name), a_shape, num_in),
                logical_axes=lead_axes + in_axes + (None,),
            )
            self.lora_b = lora.LoRAParam(
                jnp.zeros(lead + (r,) + out_shape, jnp.float32),
                logical_axes=lead_axes + (None,) + out_axes,
            )
        else:
            self.lora_a = None
            self.lora_b = None


class Attention(nnx.Module):
    """q/k/v/o projections (biases as the family has them) and Qwen3's q_norm / k_norm."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        d, n, k, h = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = dict(cfg=cfg, rngs=rngs, stack=stack)
        qkv_bias = cfg.qkv_bias
        self.q_proj = Projection(
            (d, n, h),
            ("embed", "heads", "head_dim"),
            (n, h) if qkv_bias else None,
            ("heads", "head_dim"),
            **kw,
            name="q_proj",
        )
        self.k_proj = Projection(
            (d, k, h),
            ("embed", "kv_heads", "head_dim"),
            (k, h) if qkv_bias else None,
            ("kv_heads", "head_dim"),
            **kw,
            name="k_proj",
        )
        self.v_proj = Projection(
            (d, k, h),
            ("embed", "kv_heads", "head_dim"),
            (k, h) if qkv_bias else None,
            ("kv_heads", "head_dim"),
            **kw,
            name="v_proj",
        )
        self.o_proj = Projection(
            (n, h, d),
            ("heads", "head_dim", "embed"),
            (d,) if cfg.o_bias else None,
            ("embed",),
            **kw,
            name="o_proj",
            num_in=2,
        )
        if cfg.qk_norm:
            dtype = cfg.storage_dtype
            self.q_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, stack=stack)
            self.k_norm = RMSNorm(h, cfg.rms_norm_eps, dtype=dtype, stack=stack)
        else:
            self.q_norm = None
            self.k_norm = None


class SparseMoeBlock(nnx.Module):
    """Qwen3-MoE's routed experts (``model.moe``): the router ``gate`` (kernel [D, E], HF's
    ``mlp.gate.weight`` transposed) and ``experts`` (stacked [E, ...] kernels)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        d, e = cfg.hidden_size, cfg.num_experts
        self.gate = Projection(
            (d, e), ("embed", None), None, None, cfg=cfg, rngs=rngs, stack=stack, name="gate"
        )
        self.experts = Experts(cfg, rngs=rngs, stack=stack)


class Experts(nnx.Module):
    """The experts' SwiGLU kernels, ``gate_proj`` / ``up_proj`` [E, D, F] and ``down_proj``
    [E, F, D] (leading ``layers`` axis when stacked), the expert axis logically ``expert``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
        lead, lead_axes = ((stack,), ("layers",)) if stack else ((), ())
        std, dtype = cfg.initializer_range, cfg.storage_dtype
        in_axes = lead_axes + ("expert", "embed", "mlp")
        self.gate_proj = _param(rngs, lead + (e, d, f), std, dtype, in_axes)
        self.up_proj = _param(rngs, lead + (e, d, f), std, dtype, in_axes)
        self.down_proj = _param(
            rngs, lead + (e, f, d), std, dtype, lead_axes + ("expert", "mlp", "embed")
        )


class Qwen2MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, stack: int | None = None):
        d, f = cfg.hidden_size, cfg.intermediate_size
        kw = dict(cfg=cfg, rngs=rngs, stack=stack)
        self.gate_proj = Projection((d, f), ("embed", "mlp"), None, None, **kw, name="gate_proj")
        self.up_proj = Projection((d, f), ("embed", "mlp"), None, None, **kw, name="up_proj")
        self.down_proj = Projection((f, d), ("mlp", "embed"), None, None, **kw, name="down_proj")


class Qwen2DecoderLayers(nnx.Module):
    """Decoder layers of one kind, parameters stacked along a leading ``layers`` axis: every
    layer of a uniform model, or (a mixed Qwen3-MoE, ``ModelConfig.layer_stacks``) its
    ``num_layers`` sparse layers (``sparse``) or its dense ones."""

    def __init__(
        self,
        cfg: ModelConfig,
        *,
        rngs: nnx.Rngs,
        num_layers: int | None = None,
        sparse: bool | None = None,
    ):
        stack = cfg.num_hidden_layers if num_layers is None else num_layers
        self.self_attn = Attention(cfg, rngs=rngs, stack=stack)
        if cfg.is_moe if sparse is None else sparse:
            self.mlp = SparseMoeBlock(cfg, rngs=rngs, stack=stack)
        else:
            self.mlp = Qwen2MLP(cfg, rngs=rngs, stack=stack)
        self.input_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.storage_dtype, stack=stack
        )
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.storage_dtype, stack=stack
        )


class Embedding(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embedding = _param(
            rngs,
            (cfg.vocab_size, cfg.hidden_size),
            cfg.initializer_range,
            cfg.storage_dtype,
            ("vocab", "embed"),
        )


class Qwen2Model(nnx.Module):
    """Embedding, decoder layers and final norm. A mixed Qwen3-MoE layout
    (``ModelConfig.layer_stacks``) keeps its sparse layers in ``layers`` and its dense ones in
    ``dense_layers`` (None otherwise): two homogeneous stacks, each scannable."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.embed_tokens = Embedding(cfg, rngs=rngs)
        if cfg.mixed_layers:
            stacks = cfg.layer_stacks
            self.layers = Qwen2DecoderLayers(
                cfg, rngs=rngs, num_layers=len(stacks["layers"]), sparse=True
            )
            self.dense_layers = Qwen2DecoderLayers(
                cfg, rngs=rngs, num_layers=len(stacks["dense_layers"]), sparse=False
            )
        else:
            self.layers = Qwen2DecoderLayers(cfg, rngs=rngs)
            self.dense_layers = None
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=cfg.storage_dtype)


# Logical axes of one layer's cache (see ``KVCache``).
CACHE_K_AXES = ("batch", "kv_heads", "head_dim", "seq")
CACHE_V_AXES = ("batch", "kv_heads", "seq", "head_dim")


@struct.dataclass
class KVCache:
    """Keys and values of S slots, one array per layer: ``k[l]`` [B,K,H,S], ``v[l]`` [B,K,S,H].

    The layouts are those that one-token decode reads fastest: with one query per row, attention
    is a multiply-reduce per (row, kv head), and each layout keeps last (contiguous) the axis
    that its product does NOT reduce (S for scores = sum_H q k, H for out = sum_S p v), so both
    reductions vectorise. One array per layer, not one stacked array: decode updates one slot of
    each layer's cache in place inside the sampler's loop.
    """

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def max_length(self) -> int:
        return self.k[0].shape[-1]


def init_cache(cfg: ModelConfig, batch_size: int, max_length: int, dtype=None) -> KVCache:
    """An empty cache of ``max_length`` slots, in the compute dtype unless ``dtype`` is given."""
    k_shape = (batch_size, cfg.num_key_value_heads, cfg.head_dim, max_length)
    v_shape = (batch_size, cfg.num_key_value_heads, max_length, cfg.head_dim)
    dtype = cfg.compute_dtype if dtype is None else dtype
    layers = range(cfg.num_hidden_layers)
    return KVCache(
        k=tuple(jnp.zeros(k_shape, dtype) for _ in layers),
        v=tuple(jnp.zeros(v_shape, dtype) for _ in layers),
    )


def rotary_tables(positions: jax.Array, head_dim: int, theta: float):
    """cos and sin [B, T, H] in float32 (HF's non-interleaved "rotate_half" layout)."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, N, H]; cos/sin [B, T, H]."""
    half = x.shape[-1] // 2
    x32 = x.astype(jnp.float32)
    rotated = jnp.concatenate([-x32[..., half:], x32[..., :half]], axis=-1)
    out = x32 * cos[:, :, None, :] + rotated * sin[:, :, None, :]
    return out.astype(x.dtype)


def grouped_attention(
    q, k, v, mask_bts, *, cache_layout: bool = False, query_chunk: int | None = None
) -> jax.Array:
    """Grouped-query attention. q [B,T,N,H], mask [B,T,S] (True = attend); k/v [B,S,K,H], or
    with ``cache_layout`` the cache's k [B,K,H,S] / v [B,K,S,H].

    ``query_chunk`` (cache-free calls with T above it): the queries in blocks of that many
    positions, one block at a time (``_attention_by_query_blocks``), so only one block's scores
    exist, in the forward and, recomputed, in the backward; the same function.

    Scores and softmax are float32 whatever the compute dtype; the probabilities are cast to the
    value dtype before the product with the values, in every form. One query per row (decode)
    runs as a float32 multiply-reduce, which XLA's CPU backend runs far faster than ~B*K tiny
    batched matmuls; in float32 it is the same product, in bfloat16 the same inputs accumulated
    in float32 (as XLA:CPU's bf16 dot does) and rounded once.
    """
    b, t, n, h = q.shape
    if query_chunk is not None and not cache_layout and t > query_chunk:
        return _attention_by_query_blocks(q, k, v, mask_bts, query_chunk)
    kv = k.shape[1] if cache_layout else k.shape[2]
    q = q.reshape(b, t, kv, n // kv, h)
    f32 = jnp.float32
    if not cache_layout:
        scores = jnp.einsum("BTKGH,BSKH->BKGTS", q, k, preferred_element_type=f32)
    elif t == 1:
        # [B, K, G, S] = sum_H q * k, reducing over the middle axis of k [B, K, H, S].
        scores = jnp.sum(q[:, 0, ..., None].astype(f32) * k[:, :, None].astype(f32), axis=3)
        scores = scores[:, :, :, None, :]
    else:
        # float32 operands: bf16 x bf16 -> f32 in this layout is a dot XLA:CPU cannot run, and
        # products of bf16 values are exact in float32, so the result is the same.
        scores = jnp.einsum("BTKGH,BKHS->BKGTS", q.astype(f32), k.astype(f32))
    scores = scores * (h**-0.5)
    scores = jnp.where(mask_bts[:, None, None, :, :], scores, _MASK_VALUE)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    if not cache_layout:
        out = jnp.einsum("BKGTS,BSKH->BTKGH", probs, v)
    elif t == 1:
        # [B, K, G, H] = sum_S probs * v, reducing over the middle axis of v [B, K, S, H].
        out = jnp.sum(probs[:, :, :, 0, :, None].astype(f32) * v[:, :, None].astype(f32), axis=3)
        out = out.astype(v.dtype)[:, None]
    else:
        out = jnp.einsum("BKGTS,BKSH->BTKGH", probs.astype(f32), v.astype(f32)).astype(v.dtype)
    return out.reshape(b, t, n, h)


def _attention_by_query_blocks(q, k, v, mask_bts, block: int) -> jax.Array:
    """``grouped_attention`` (cache-free) over blocks of ``block`` query positions, run one after
    the other (``lax.map``) and rematerialised (``jax.checkpoint``): the [B, K, G, block, S]
    float32 scores and probabilities of one block exist at a time instead of [B, K, G, T, S], in
    the forward and in the backward, which recomputes them. Each query's softmax still runs
    over all S keys, so every output row is the unblocked one's; the price is the scores'
    recomputation. T is padded to whole blocks with queries that attend to nothing (their
    uniform softmax is sliced off)."""
    b, t, n, h = q.shape
    num = -(-t // block)
    pad = num * block - t
    q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0)))
    mask = jnp.pad(mask_bts, ((0, 0), (0, pad), (0, 0)))
    q_blocks = q.reshape(b, num, block, n, h).swapaxes(0, 1)
    mask_blocks = mask.reshape(b, num, block, mask.shape[-1]).swapaxes(0, 1)

    @jax.checkpoint
    def one(args):
        q_b, mask_b = args
        return grouped_attention(q_b, k, v, mask_b)

    out = jax.lax.map(one, (q_blocks, mask_blocks))
    return out.swapaxes(0, 1).reshape(b, num * block, n, h)[:, :t]


def dense(y: jax.Array, kernel: jax.Array, num_in: int, preferred_element_type=None) -> jax.Array:
    """y [B, T, *in] contracted with kernel [*in, *out] -> [B, T, *out], as ONE 2-D matmul.

    Written as [B*T, prod(in)] @ [prod(in), prod(out)]: XLA:CPU runs the backward pass of
    multi-axis einsums (two contracting dims for the weight gradient) 1.5x slower than the same
    product on flattened operands (measured on the update benchmark's MLP).
    """
    b, t = y.shape[:2]
    k_in = kernel.shape[:num_in]
    k_out = kernel.shape[num_in:]
    flat_in = 1
    for s in k_in:
        flat_in *= s
    y2 = y.reshape(b * t, flat_in)
    w2 = kernel.reshape(flat_in, -1)
    out = jnp.matmul(y2, w2, preferred_element_type=preferred_element_type)
    return out.reshape(b, t, *k_out)


def _fuse_qkv(mesh, cfg: ModelConfig) -> bool:
    """Whether q, k and v can come from one matmul without resharding: always without tensor
    parallelism, and with it when the tensor axis divides the kv heads (the joined kernel keeps
    the kv_heads axis, the one tensor parallelism shards)."""
    tp = 1 if mesh is None else mesh.shape.get("tensor", 1)
    return cfg.num_key_value_heads % tp == 0


def _project_qkv(attn: Attention, cfg, h):
    """q [B, T, N, H] and k, v [B, T, K, H] from ONE matmul.

    The kernels are joined along the query-group axis into [D, K, G + 2, H] (each kv head's G
    query heads, then its key and its value), so the kv_heads axis stays whole and one larger
    matmul replaces three (faster on CPU, the same math per output).
    """
    dtype = cfg.compute_dtype
    d, kv, hd = cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim
    g = cfg.num_attention_heads // kv
    b, t = h.shape[:2]

    def join(q, k, v, lead):
        q = q.reshape(*lead, kv, g, hd)
        return jnp.concatenate([q, k[..., None, :], v[..., None, :]], axis=-2).astype(dtype)

    kernel = join(*(p.kernel.get_value() for p in (attn.q_proj, attn.k_proj, attn.v_proj)), (d,))
    out = dense(h, kernel, 1)
    if attn.q_proj.bias is not None:
        out = out + join(*(p.bias.get_value() for p in (attn.q_proj, attn.k_proj, attn.v_proj)), ())
    q = out[:, :, :, :g].reshape(b, t, kv * g, hd)
    return q, out[:, :, :, g], out[:, :, :, g + 1]


def _decoder_layer(
    layer: Qwen2DecoderLayers,
    cfg,
    x,
    cos,
    sin,
    mask_bts,
    k_cache,
    v_cache,
    cache_index,
    mesh,
    dropout_key=None,
    valid_bt=None,
    routes_btk=None,
):
    """One decoder layer on per-layer parameters (``layer`` holds one slice of the stack).

    Returns (x, k_cache, v_cache, router): ``router`` is None for a dense MLP, else this layer's
    (expert ids [B, T, k], counts [E], prob_sum [E]) over the tokens ``valid_bt`` marks
    (``moe.RouterOutput``); ``routes_btk`` forces the experts (routing replay, -1 = live).

    Projections that read the same input run as one matmul: q/k/v (when ``_fuse_qkv``) and
    gate/up (kernels stacked as [D, 2, F], the sharded ``mlp`` axis untouched). LoRA adapters
    add ``scale * (x A) B`` to their projection's output (``lora.delta``); ``dropout_key`` (this
    layer's, training only) drops the adapter path's inputs.
    """
    dtype = cfg.compute_dtype
    attn, mlp = layer.self_attn, layer.mlp

    def adapter(p, y, index):
        """The projection's LoRA term, or None without adapters."""
        if p.lora_a is None:
            return None
        key = None if dropout_key is None else jax.random.fold_in(dropout_key, index)
        return lora.delta(p.lora_a.get_value(), p.lora_b.get_value(), y, cfg.lora, dtype, key)

    def plus(out, p, y, index):
        d = adapter(p, y, index)
        return out if d is None else out + d

    def proj(p, y, index):
        """y [B, T, *in] @ kernel [*in, *out] -> [B, T, *out] (+ bias) (+ LoRA)."""
        kernel = p.kernel.get_value().astype(dtype)
        out = dense(y, kernel, y.ndim - 2)
        out = out if p.bias is None else out + p.bias.get_value().astype(dtype)
        return plus(out, p, y, index)

    h = layer.input_layernorm(x)
    if _fuse_qkv(mesh, cfg):
        q, k, v = _project_qkv(attn, cfg, h)
        q, k, v = plus(q, attn.q_proj, h, 0), plus(k, attn.k_proj, h, 1), plus(v, attn.v_proj, h, 2)
    else:
        q, k, v = proj(attn.q_proj, h, 0), proj(attn.k_proj, h, 1), proj(attn.v_proj, h, 2)
    if attn.q_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q = sharding.constrain(q, ("batch", "seq", "heads", "head_dim"), mesh)
    if k_cache is not None:
        # The T new keys / values go to slots [cache_index, cache_index + T) (``KVCache``).
        k_cache = _write_slots(k_cache, k.transpose(0, 2, 3, 1), cache_index, axis=3)
        v_cache = _write_slots(v_cache, v.transpose(0, 2, 1, 3), cache_index, axis=2)
        k_cache = sharding.constrain(k_cache, CACHE_K_AXES, mesh)
        v_cache = sharding.constrain(v_cache, CACHE_V_AXES, mesh)
        k, v = k_cache.astype(dtype), v_cache.astype(dtype)
    out = grouped_attention(
        q,
        k,
        v,
        mask_bts,
        cache_layout=k_cache is not None,
        query_chunk=cfg.attention_query_chunk,
    )
    x = x + proj(attn.o_proj, out, 3)
    x = sharding.constrain(x, ("batch", "seq", "embed"), mesh)

    h = layer.post_attention_layernorm(x)
    if isinstance(mlp, SparseMoeBlock):
        y, router = _moe_mlp(mlp, cfg, h, valid_bt, routes_btk, mesh)
        x = x + y
        x = sharding.constrain(x, ("batch", "seq", "embed"), mesh)
        return x, k_cache, v_cache, router
    gate_up = jnp.stack([mlp.gate_proj.kernel.get_value(), mlp.up_proj.kernel.get_value()], axis=1)
    gate_up = dense(h, gate_up.astype(dtype), 1)
    gate, up = (
        plus(gate_up[:, :, 0], mlp.gate_proj, h, 4),
        plus(gate_up[:, :, 1], mlp.up_proj, h, 5),
    )
    act = jax.nn.silu(gate) * up
    act = sharding.constrain(act, ("batch", "seq", "mlp"), mesh)
    x = x + proj(mlp.down_proj, act, 6)
    x = sharding.constrain(x, ("batch", "seq", "embed"), mesh)
    return x, k_cache, v_cache, None


def _write_slots(cache: jax.Array, new: jax.Array, index, *, axis: int) -> jax.Array:
    """``cache`` with ``new`` written at [index, index + len) along ``axis``, in place.

    A 2-byte float cache is written as its bits (``bits.write_slice``): XLA:CPU runs no
    bfloat16 dynamic-update-slice, so it converted the whole cache to float32 and back at every
    write, a full copy of every layer's cache per decode step."""
    return bits.write_slice(cache, new, index, axis=axis)


def _moe_mlp(block: SparseMoeBlock, cfg: ModelConfig, h, valid_bt, routes_btk, mesh=None):
    """The routed expert block on h [B, T, D] (``model.moe``): (y [B, T, D], router stats).

    On a mesh whose batch axes split the rows, the tokens are dispatched per batch shard
    (``jax.shard_map`` over the batch axes, the router and expert kernels gathered whole, as
    fsdp gathers any layer's weights): each device sorts and runs only its own rows; with an
    ``expert`` mesh axis the experts stay split and the rows travel to them instead
    (``model.expert_parallel``). One sort
    over all B x T tokens made XLA replicate the microbatch's rows on every device
    (Qwen3-30B-A3B's GRPO update on 64 devices: each device ran all 1.3M slots)."""
    dtype = cfg.compute_dtype
    b, t, d = h.shape
    k = cfg.num_experts_per_tok
    ex = block.experts
    kernels = tuple(
        p.get_value().astype(dtype) for p in (block.gate.kernel, ex.gate_proj, ex.up_proj)
    ) + (ex.down_proj.get_value().astype(dtype),)

    def dispatch(h_btd, forced_btk, valid, gate, *experts):
        n = h_btd.shape[0] * t
        x = h_btd.reshape(n, d)
        logits = jnp.matmul(x, gate, preferred_element_type=jnp.float32)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        forced = None if forced_btk is None else forced_btk.reshape(n, k)
        ids, weights = moe.select_experts(probs, k, cfg.norm_topk_prob, forced)
        y = expert_parallel.routed_experts(
            x,
            ids,
            weights.astype(dtype),
            *experts,
            impl=cfg.moe_impl,
            mesh=mesh,
            split=bool(rows),
            valid_n=None if valid is None else valid.reshape(n),
        )
        return y.reshape(h_btd.shape), ids.reshape(-1, t, k), probs.reshape(-1, t, probs.shape[-1])

    rows = None if mesh is None else sharding.logical_to_pspec(("batch",), (b,), mesh)
    if (
        rows or expert_parallel.axis_size(mesh) > 1
    ):  # rows split, or experts (model.expert_parallel)
        spec = jax.sharding.PartitionSpec(rows[0] if rows else None)
        dispatch = jax.shard_map(
            dispatch,
            mesh=mesh,
            in_specs=(
                spec,
                None if routes_btk is None else spec,
                None if valid_bt is None else spec,
                *expert_parallel.kernel_specs(mesh),
            ),
            out_specs=(spec, spec, spec),
        )
    # Padding tokens (valid 0) skip the experts: their outputs feed no valid token.
    expert_valid = None if valid_bt is None else valid_bt > 0
    y, ids, probs = dispatch(h, routes_btk, expert_valid, *kernels)
    ids, probs = ids.reshape(b * t, k), probs.reshape(b * t, -1)
    valid = jnp.ones((b * t,), jnp.float32) if valid_bt is None else valid_bt.reshape(b * t)
    counts, prob_sum = moe.layer_stats(ids, probs, valid)
    return y.astype(h.dtype), (ids.reshape(b, t, k), counts, prob_sum)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _run_layers(
    graphdef,
    cfg,
    mesh,
    stacked,
    x,
    cos,
    sin,
    mask_bts,
    k_cache,
    v_cache,
    cache_index,
    grad_acc,
    dropout_keys=None,
    valid_bt=None,
    routes=None,
):
    """All decoder layers over the stacked parameters: ``lax.scan``, or unrolled when
    ``cfg.scan_layers`` is False. With ``grad_acc`` (accumulators claimed from a
    ``grad_sink.sink``; training forward only) the scan is ``grad_sink.scan_layers``: the
    gradient of ``stacked`` comes back already added to ``grad_acc``. One-token decode (a cache
    and T = 1) always runs unrolled on the per-layer caches: a scan would copy every layer's
    cache into its stacked output at every step, where the unrolled loop updates one slot of
    each in place.

    Returns (x, (k caches, v caches), router): ``router`` is each MoE layer's
    (expert ids, counts, prob_sum) stacked over layers, None for dense models. ``routes``
    [L, B, T, k]: forced experts per layer (routing replay); under ``grad_acc`` they are
    scanned beside the layers and the router statistics come back as the scan's per-layer
    outputs, so a MoE update accumulates its expert gradients in place too.

    Jitted with the static parts (graphdef, config, mesh) as the cache key, so an eager model
    call compiles the layer stack once per shape instead of retracing the scan every call; inside
    an outer ``jit`` it is simply inlined. ``dropout_keys`` [L, 2]: each layer's LoRA dropout key
    (training with ``lora.dropout`` > 0 only), scanned beside the layers.
    """

    def body(x, xs):
        layer_state, k_l, v_l, key_l, routes_l = xs
        layer = nnx.merge(graphdef, layer_state)
        x, k_l, v_l, router = _decoder_layer(
            layer,
            cfg,
            x,
            cos,
            sin,
            mask_bts,
            k_l,
            v_l,
            cache_index,
            mesh,
            key_l,
            valid_bt,
            routes_l,
        )
        return x, (k_l, v_l, router)

    if grad_acc is not None:
        if dropout_keys is not None:
            raise ValueError("LoRA dropout is not supported with in-place gradient accumulation")

        def layer_fn(layer_state, h, consts, routes_l):
            layer = nnx.merge(graphdef, layer_state)
            cos, sin, mask_bts, valid_bt = consts
            x, _, _, router = _decoder_layer(
                layer,
                cfg,
                h,
                cos,
                sin,
                mask_bts,
                None,
                None,
                cache_index,
                mesh,
                None,
                valid_bt,
                routes_l,
            )
            return x, router

        x, router = grad_sink.scan_layers(
            layer_fn, x, stacked, grad_acc, (cos, sin, mask_bts, valid_bt), routes
        )
        return x, (None, None), router
    if cfg.remat and k_cache is None:
        body = jax.checkpoint(body, policy=jax.checkpoint_policies.nothing_saveable)
    if k_cache is None:
        if cfg.scan_layers:
            x, (_, _, router) = jax.lax.scan(body, x, (stacked, None, None, dropout_keys, routes))
            return x, (None, None), router
    elif cfg.scan_layers and x.shape[1] > 1:
        # Prefill: scan over the caches stacked for the occasion (one copy per call).
        x, (k_new, v_new, router) = jax.lax.scan(
            body, x, (stacked, jnp.stack(k_cache), jnp.stack(v_cache), dropout_keys, routes)
        )
        return x, (tuple(k_new), tuple(v_new)), router
    # Unrolled: the same body on static slices of the stack and each layer's own cache.
    k_out, v_out, routers = [], [], []
    for i in range(cfg.num_hidden_layers):
        kv = (None, None) if k_cache is None else (k_cache[i], v_cache[i])
        key_i = None if dropout_keys is None else dropout_keys[i]
        routes_i = None if routes is None else routes[i]
        layer_i = jax.tree.map(lambda a, i=i: a[i], stacked)
        x, (k_l, v_l, router) = body(x, (layer_i, *kv, key_i, routes_i))
        k_out.append(k_l)
        v_out.append(v_l)
        routers.append(router)
    router = None if routers[0] is None else jax.tree.map(lambda *r: jnp.stack(r), *routers)
    return x, (None, None) if k_cache is None else (tuple(k_out), tuple(v_out)), router


def layer_segments(cfg: ModelConfig) -> tuple[tuple[tuple[bool, ...], int], ...]:
    """How the layer scan runs a mixed Qwen3-MoE layout: (pattern, repeats) segments covering
    the layers in order, each a ``lax.scan`` of ``repeats`` steps whose body runs the
    ``pattern``'s layers (True = sparse). A periodic layout is one segment over its smallest
    period (``decoder_sparse_step`` = 2: ((False, True), L / 2)); any other layout scans its
    runs of one kind (``mlp_only_layers`` = [0]: ((False,), 1), ((True,), L - 1)). A scan
    needs identical steps; both forms keep one traced body per distinct pattern, so the compile
    time stays independent of depth for the layouts Qwen3-MoE configs describe."""
    kinds = cfg.sparse_layers
    n = len(kinds)
    for p in range(1, n):
        if n % p == 0 and all(kinds[i] == kinds[i % p] for i in range(n)):
            return ((kinds[:p], n // p),)
    return tuple((kind, len(list(run))) for kind, run in itertools.groupby(kinds, lambda k: (k,)))


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _run_mixed_layers(
    sparse_def,
    dense_def,
    cfg,
    mesh,
    sparse_stack,
    dense_stack,
    x,
    cos,
    sin,
    mask_bts,
    k_cache,
    v_cache,
    cache_index,
    dropout_keys=None,
    valid_bt=None,
    routes=None,
):
    """``_run_layers`` for a mixed layout: the sparse layers' stack (``model.layers``) and the
    dense layers' (``model.dense_layers``) run interleaved in layer order. Scanned by
    ``layer_segments`` (each segment's slice of each stack reshaped to [repeats, per pattern,
    ...]), or unrolled as ``_run_layers`` is (``scan_layers`` False, one-token decode). Remat
    wraps each layer. The router output covers every layer's expert ids ([L, B, T, k], -1 on
    dense layers: the layout of ``routes``, whose dense-layer rows are ignored) and the sparse
    layers' counts and probability sums ([n_sparse, E])."""
    b, t = x.shape[:2]
    kinds = cfg.sparse_layers
    no_route = jnp.full((b, t, cfg.num_experts_per_tok), -1, jnp.int32)

    def layer(x, params, sparse, k_l, v_l, key_l, routes_l):
        module = nnx.merge(sparse_def if sparse else dense_def, params)
        x, k_l, v_l, router = _decoder_layer(
            module,
            cfg,
            x,
            cos,
            sin,
            mask_bts,
            k_l,
            v_l,
            cache_index,
            mesh,
            key_l,
            valid_bt,
            routes_l if sparse else None,
        )
        return x, k_l, v_l, router

    if cfg.remat and k_cache is None:
        layer = jax.checkpoint(
            layer, static_argnums=(2,), policy=jax.checkpoint_policies.nothing_saveable
        )

    def run(x, pattern, sparse_params, dense_params, k_c, v_c, keys, routes_p):
        """The layers of ``pattern`` on their parameters (leading axis: the pattern's sparse /
        dense layers) and per-layer caches, keys and routes (leading axis: the pattern)."""
        ks, vs, ids, counts, probs = [], [], [], [], []
        si = di = 0
        for j, sparse in enumerate(pattern):
            if sparse:
                params, si = jax.tree.map(lambda a, i=si: a[i], sparse_params), si + 1
            else:
                params, di = jax.tree.map(lambda a, i=di: a[i], dense_params), di + 1

            def pick(a, j=j):
                return a[j]

            x, k_l, v_l, router = layer(
                x,
                params,
                sparse,
                None if k_c is None else pick(k_c),
                None if v_c is None else pick(v_c),
                None if keys is None else pick(keys),
                None if routes_p is None else pick(routes_p),
            )
            ks.append(k_l)
            vs.append(v_l)
            if sparse:
                ids.append(router[0])
                counts.append(router[1])
                probs.append(router[2])
            else:
                ids.append(no_route)
        stack = lambda xs: None if not xs or xs[0] is None else jnp.stack(xs)  # noqa: E731
        return x, (stack(ks), stack(vs), stack(ids), stack(counts), stack(probs))

    def cat(parts):
        parts = [p for p in parts if p is not None]  # a dense-only segment has no counts
        return jnp.concatenate(parts) if parts else None

    has_cache = k_cache is not None
    if cfg.scan_layers and (not has_cache or t > 1):
        outs = []
        l0 = s0 = d0 = 0
        for pattern, repeats in layer_segments(cfg):
            p, ns = len(pattern), sum(pattern)
            nd = p - ns

            def group(tree, start, per, repeats=repeats):
                """Rows [start, start + repeats * per) of ``tree``'s leaves as [repeats, per]."""
                return jax.tree.map(
                    lambda a: a[start : start + repeats * per].reshape(repeats, per, *a.shape[1:]),
                    tree,
                )

            xs = (
                group(sparse_stack, s0, ns) if ns else None,
                group(dense_stack, d0, nd) if nd else None,
                group(jnp.stack(k_cache), l0, p) if has_cache else None,
                group(jnp.stack(v_cache), l0, p) if has_cache else None,
                None if dropout_keys is None else group(dropout_keys, l0, p),
                None if routes is None else group(routes, l0, p),
            )

            def body(x, xs, pattern=pattern):
                return run(x, pattern, *xs)

            x, seg = jax.lax.scan(body, x, xs)
            outs.append(
                jax.tree.map(lambda a: a.reshape(a.shape[0] * a.shape[1], *a.shape[2:]), seg)
            )
            l0, s0, d0 = l0 + repeats * p, s0 + repeats * ns, d0 + repeats * nd
        k_new, v_new, ids, counts, probs = (cat([o[i] for o in outs]) for i in range(5))
        caches = (tuple(k_new), tuple(v_new)) if has_cache else (None, None)
        return x, caches, (ids, counts, probs)
    # Unrolled: each layer on its static slice of its stack and its own cache.
    k_out, v_out, ids, counts, probs = [], [], [], [], []
    local = {True: 0, False: 0}
    for i, sparse in enumerate(kinds):
        stack_state = sparse_stack if sparse else dense_stack
        params = jax.tree.map(lambda a, j=local[sparse]: a[j], stack_state)
        local[sparse] += 1
        x, k_l, v_l, router = layer(
            x,
            params,
            sparse,
            None if not has_cache else k_cache[i],
            None if not has_cache else v_cache[i],
            None if dropout_keys is None else dropout_keys[i],
            None if routes is None else routes[i],
        )
        k_out.append(k_l)
        v_out.append(v_l)
        ids.append(router[0] if sparse else no_route)
        if sparse:
            counts.append(router[1])
            probs.append(router[2])
    caches = (tuple(k_out), tuple(v_out)) if has_cache else (None, None)
    return x, caches, (jnp.stack(ids), jnp.stack(counts), jnp.stack(probs))


def attention_mask_bts(
    b: int,
    t: int,
    attention_mask=None,
    *,
    segment_ids=None,
    prompt_group_ids=None,
    cache_length: int | None = None,
    cache_index=0,
) -> jax.Array:
    """The boolean attention mask [B, T, S] (True = attend) of ``CausalLM.backbone``: causal by
    index, keys where ``attention_mask`` is set; packed rows' segments and shared prompts (module
    docstring); with a cache of ``cache_length`` slots, queries at slots ``cache_index + t``."""
    if cache_length is None:
        s, query_slots = t, jnp.arange(t)
    else:
        s, query_slots = cache_length, cache_index + jnp.arange(t)
    key_valid = jnp.ones((b, s), bool) if attention_mask is None else attention_mask.astype(bool)
    slots = jnp.arange(s)
    mask_bts = (slots[None, :] <= query_slots[:, None])[None] & key_valid[:, None, :]
    if segment_ids is not None:
        if cache_length is not None:
            raise ValueError("segment_ids (packed rows) are for the cache-free forward")
        seg = segment_ids.astype(jnp.int32)
        same = seg[:, :, None] == seg[:, None, :]
        if prompt_group_ids is not None:
            grp = prompt_group_ids.astype(jnp.int32)
            shared_prompt = (seg == 0) & (grp != 0)  # keys of a group's shared prompt
            same = (same & (seg != 0)[:, :, None]) | (
                shared_prompt[:, None, :] & (grp[:, :, None] == grp[:, None, :])
            )
        mask_bts = mask_bts & same
    elif prompt_group_ids is not None:
        raise ValueError("prompt_group_ids (shared prompts) need segment_ids")
    return mask_bts


class CausalLM(nnx.Module):
    """The causal LM of every supported family.

    ``model(input_ids, attention_mask, position_ids)`` -> logits [B, T, V].

    With ``cache`` (a ``KVCache`` of S slots, ``init_cache``) and ``cache_index``, the T new tokens
    are written at slots [cache_index, cache_index + T) and attend to slots ``s <= cache_index + t``
    where ``attention_mask`` [B, S] (the cache's valid-slot mask, new tokens included) is set; the
    call then returns ``(logits, new_cache)``. The same call serves prefill (T prompt tokens) and
    decode (T = 1, ``cache_index`` traced so every step reuses one program); it runs the same
    layer function as the training forward. Every keyword of ``backbone`` is accepted.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs | None = None, mesh=None):
        rngs = rngs if rngs is not None else nnx.Rngs(0)
        self.config = cfg
        self.mesh = mesh
        self.model = Qwen2Model(cfg, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Projection(
                (cfg.hidden_size, cfg.vocab_size),
                ("embed", "vocab"),
                None,
                None,
                cfg=cfg,
                rngs=rngs,
                stack=None,
            )
        else:
            self.lm_head = None

    def backbone(
        self,
        input_ids,
        attention_mask=None,
        position_ids=None,
        *,
        segment_ids=None,
        prompt_group_ids=None,
        cache=None,
        cache_index=0,
        routes=None,
        with_router: bool = False,
    ):
        """Final hidden states [B, T, D] (after the last norm), and the updated cache or None.

        ``segment_ids`` [B, T] (packed rows, no cache): a query attends only to keys of its own
        segment (block-diagonal causal mask). ``prompt_group_ids`` [B, T] (with ``segment_ids``):
        shared prompts (module docstring), a query also attends to the keys of segment 0 that
        carry its group number.

        MoE only: ``routes`` [L, B, T, k] int forces each layer's experts (routing replay; a
        token with a -1 uses its live top-k); ``with_router``: return a third value, the
        ``moe.RouterOutput`` of the call (None for a dense model), its statistics over the
        tokens ``attention_mask`` marks (over the T new tokens of a cached call)."""
        cfg, mesh = self.config, self.mesh
        b, t = input_ids.shape
        if routes is not None and not cfg.is_moe:
            raise ValueError("routes (routing replay) need a MoE model (model_type qwen3_moe)")
        if position_ids is None:
            position_ids = jnp.broadcast_to(cache_index + jnp.arange(t, dtype=jnp.int32), (b, t))
        mask_bts = attention_mask_bts(
            b,
            t,
            attention_mask,
            segment_ids=segment_ids,
            prompt_group_ids=prompt_group_ids,
            cache_length=None if cache is None else cache.max_length,
            cache_index=cache_index,
        )
        valid_bt = None
        if cfg.is_moe and attention_mask is not None:
            valid_bt = attention_mask.astype(jnp.float32)
            if cache is not None:  # the cache's slot mask: the T new tokens' slots
                valid_bt = jax.lax.dynamic_slice_in_dim(valid_bt, cache_index, t, axis=1)

        embedding = self.model.embed_tokens.embedding.get_value()
        x = jnp.take(embedding, input_ids, axis=0).astype(cfg.compute_dtype)
        x = sharding.constrain(x, ("batch", "seq", "embed"), mesh)
        cos, sin = rotary_tables(position_ids, cfg.head_dim, cfg.rope_theta)

        graphdef, stacked = nnx.split(self.model.layers)
        kv_in = (None, None) if cache is None else (cache.k, cache.v)
        # In-place gradient accumulation (``grad_sink``) needs the scanned, rematerialised stack
        # of a uniform model (dense or all-MoE; its custom scan carries the forced routes in and
        # the router statistics out).
        fused = cache is None and cfg.scan_layers and cfg.remat and not cfg.mixed_layers
        grad_acc = grad_sink.claim(stacked) if fused else None
        # LoRA dropout: only inside an update's ``lora.dropout_rng`` block (training forward).
        key = lora.current_dropout_rng()
        dropout_keys = None
        if key is not None and cache is None and cfg.lora is not None and cfg.lora.dropout > 0:
            dropout_keys = jax.random.split(key, cfg.num_hidden_layers)
        if cfg.mixed_layers:
            dense_def, dense_stacked = nnx.split(self.model.dense_layers)
            x, (k_new, v_new), router = _run_mixed_layers(
                graphdef,
                dense_def,
                cfg,
                mesh,
                stacked,
                dense_stacked,
                x,
                cos,
                sin,
                mask_bts,
                *kv_in,
                cache_index,
                dropout_keys,
                valid_bt,
                routes,
            )
        else:
            x, (k_new, v_new), router = _run_layers(
                graphdef,
                cfg,
                mesh,
                stacked,
                x,
                cos,
                sin,
                mask_bts,
                *kv_in,
                cache_index,
                grad_acc,
                dropout_keys,
                valid_bt,
                routes,
            )
        x = self.model.norm(x)
        new_cache = None if cache is None else KVCache(k=k_new, v=v_new)
        if router is not None:
            ids, counts, prob_sum = router
            num_tokens = jnp.float32(b * t) if valid_bt is None else jnp.sum(valid_bt)
            layers = tuple(i for i, s in enumerate(cfg.sparse_layers) if s)
            router = moe.RouterOutput(ids, counts, prob_sum, num_tokens, layers=layers)
            if cache is None:
                moe.report(cfg, router)  # to an update's ``moe.collect_routers``, if open
        return (x, new_cache, router) if with_router else (x, new_cache)

    def lm_head_weight(self) -> jax.Array:
        """The output projection's stored (master) array: the tied embedding [V, D], or the
        lm_head kernel [D, V]."""
        if self.lm_head is None:
            return self.model.embed_tokens.embedding.get_value()
        return self.lm_head.kernel.get_value()

    def lm_logits(self, hidden: jax.Array, weight: jax.Array | None = None, dtype=jnp.float32):
        """Logits [B, T, V] from hidden states, accumulated in ``dtype`` (float32 by default);
        hidden states and weight enter the product in ``config.head_dtype``.
        ``weight``: ``lm_head_weight()`` passed explicitly (default: read here)."""
        cd = self.config.head_dtype
        w = (self.lm_head_weight() if weight is None else weight).astype(cd)
        if self.lm_head is None:
            w = w.T
        logits = dense(hidden.astype(cd), w, 1, preferred_element_type=dtype)
        return sharding.constrain(logits.astype(dtype), ("batch", "seq", "vocab"), self.mesh)

    def __call__(self, input_ids, attention_mask=None, position_ids=None, **kwargs):
        """Logits [B, T, V] float32 (``(logits, new_cache)`` with a cache; a router output last
        with ``with_router``); ``kwargs`` are ``backbone``'s."""
        hidden, *rest = self.backbone(input_ids, attention_mask, position_ids, **kwargs)
        logits = self.lm_logits(hidden)
        if kwargs.get("cache") is None:
            rest = rest[1:]
        return logits if not rest else (logits, *rest)


# The name the package used before Qwen3: kept so that code written against it keeps working.
Qwen2ForCausalLM = CausalLM
