"""Low-rank adapters (LoRA, Hu et al. 2021) on the Qwen2 projections.

A targeted projection ``y = x @ W (+ b)`` becomes ``y = x @ W (+ b) + scale * (drop(x) @ A) @ B``
with ``A`` [*in, r], ``B`` [r, *out] and ``scale = alpha / r`` (``alpha / sqrt(r)`` with
``use_rslora``, Kalajdzievski 2023). ``A`` starts uniform in +-1/sqrt(fan_in) (what PEFT's
``kaiming_uniform_(a=sqrt(5))`` gives) and ``B`` at zero, so a fresh adapter is the base model.
The adapters are applied in the forward pass, never merged per step: the product through rank r
costs ``2 r (in + out)`` FLOPs per token next to the kernel's ``2 in out``.

Where the adapters live: ``A`` and ``B`` are ``LoRAParam`` variables (an ``nnx.Param`` subtype)
beside each targeted ``kernel`` in ``decoder.Projection``, stacked over layers like the kernel and
carrying the kernel's logical axes (rank axis replicated), always float32 whatever the base's
storage dtype. So ``nnx.split(model, nnx.Param)`` (the train state's ``params``, every sampler's
weights, checkpoints) holds base and adapters together, and any code that runs the model runs
the adapted model: the JAX sampler needs nothing LoRA-specific.

What makes the base frozen: ``split_trainable(params)`` returns only the ``LoRAParam`` leaves
when there are any (and every leaf otherwise). The update engine differentiates those, the
optimiser state is initialised on them (``algos.state.TrainState.create``), and the base leaves
pass through the update untouched (one implementation for every method: the engine's
``make_update`` / ``finish_update``).

Dropout (``dropout`` > 0) applies to a targeted projection's input on the adapter path only, in
training updates: the engine opens ``dropout_rng(key)`` around each microbatch's loss and the
model reads that key when traced (``current_dropout_rng``), splits it per layer and per
projection. Inference (samplers, old / reference log-probs) traces no key and drops nothing.

Left out: LoRA on the embedding or the lm_head, DoRA, per-module ranks (PEFT's
``rank_pattern``), bias training.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

TARGETS: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoRAConfig:
    """Which projections get adapters and of what size.

    rank: r, the inner dimension of A [in, r] and B [r, out].
    alpha: scale numerator: the update is ``alpha / r * x A B`` (``alpha / sqrt(r)`` with
        ``use_rslora``).
    dropout: dropout rate on the adapter path's input during updates (0: none).
    targets: projection names among ``TARGETS`` (Hugging Face's names); "all-linear" means all
        seven.
    use_rslora: rank-stabilised scaling ``alpha / sqrt(r)``.
    """

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = TARGETS
    use_rslora: bool = False

    def __post_init__(self):
        targets = self.targets
        if isinstance(targets, str):
            targets = TARGETS if targets == "all-linear" else (targets,)
        targets = tuple(targets)
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets:
            raise ValueError(
                f"lora.targets={list(targets)!r}: expected a non-empty subset of {list(TARGETS)} "
                "or 'all-linear'"
            )
        # Canonical order, no duplicates: equal configs hash alike (ModelConfig is a jit key).
        object.__setattr__(self, "targets", tuple(t for t in TARGETS if t in targets))
        if not (isinstance(self.rank, int) and self.rank >= 1):
            raise ValueError(f"lora.rank={self.rank!r}: must be an integer >= 1")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha={self.alpha!r}: must be > 0")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout={self.dropout!r}: must be in [0, 1)")

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


class LoRAParam(nnx.Param):
    """An adapter matrix (A or B): trainable while the other ``nnx.Param`` leaves stay frozen."""


def init_a(rng: jax.Array, shape: tuple[int, ...], num_in: int) -> jax.Array:
    """A [*lead, *in, r]: uniform in +-1/sqrt(fan_in), fan_in = prod(in) (PEFT's default)."""
    fan_in = math.prod(shape[len(shape) - 1 - num_in : -1])
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(rng, shape, jnp.float32, -bound, bound)


def stream_seed(seed: int) -> jax.Array:
    """The ``lora`` stream's key for a model seeded with ``seed`` (``nnx.Rngs(seed,
    lora=stream_seed(seed))``): independent of the base weights' draws."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), 0x10A)


def init_key(rngs: nnx.Rngs, name: str) -> jax.Array:
    """The key of projection ``name``'s A: from the ``lora`` stream when ``rngs`` has one, else
    from a fixed seed and the name. Never from the ``params`` stream, so the base weights a seed
    draws are the same with or without adapters."""
    if "lora" in rngs:
        return rngs.lora()
    return jax.random.fold_in(jax.random.PRNGKey(0x10A), TARGETS.index(name))


def _matmul(y: jax.Array, w: jax.Array, num_in: int) -> jax.Array:
    """y [B, T, *in] @ w [*in, *out] -> [B, T, *out] as one 2-D matmul."""
    b, t = y.shape[:2]
    k_in, k_out = w.shape[:num_in], w.shape[num_in:]
    flat = math.prod(k_in)
    return (y.reshape(b * t, flat) @ w.reshape(flat, -1)).reshape(b, t, *k_out)


def delta(
    a: jax.Array,
    b: jax.Array,
    y: jax.Array,
    cfg: LoRAConfig,
    dtype,
    key: jax.Array | None = None,
) -> jax.Array:
    """``scale * (drop(y) @ A) @ B``: y [B, T, *in], A [*in, r], B [r, *out] -> [B, T, *out] in
    ``dtype`` (the adapters are cast like the kernels; the rank-r product is small)."""
    num_in = a.ndim - 1
    if key is not None and cfg.dropout > 0:
        keep = jax.random.bernoulli(key, 1.0 - cfg.dropout, y.shape)
        y = jnp.where(keep, y / (1.0 - cfg.dropout), 0).astype(y.dtype)
    low = _matmul(y.astype(dtype), a.astype(dtype), num_in)
    return _matmul(low, b.astype(dtype), 1) * jnp.asarray(cfg.scale, dtype)


# ---------------------------------------------------------------------------------------------
# Trainable / frozen split (the update engine and the optimiser state use these).


def has_adapters(params: Any) -> bool:
    """Whether an ``nnx.State`` holds ``LoRAParam`` leaves (static: read from the tree)."""
    if not isinstance(params, nnx.State):
        return False
    return any(isinstance(v, LoRAParam) for _, v in nnx.to_flat_state(params))


def split_trainable(params: Any) -> tuple[Any, Callable[[Any], Any]]:
    """``(trainable, join)``: with adapters, the ``LoRAParam`` sub-state and a function that
    puts new adapter values back beside the unchanged base; without, ``params`` itself and the
    identity. ``join(trainable)`` has the structure of ``params``."""
    if not has_adapters(params):
        return params, lambda p: p
    trainable, frozen = nnx.split_state(params, LoRAParam, ...)

    def join(new_trainable):
        return nnx.merge_state(frozen, new_trainable)

    return trainable, join


def trainable(params: Any) -> Any:
    """The leaves an update trains: the adapters when there are any, else every leaf."""
    return split_trainable(params)[0]


def adapters(params: nnx.State) -> nnx.State:
    """The ``LoRAParam`` sub-state (empty without adapters)."""
    return params.filter(LoRAParam)


def base(params: nnx.State) -> nnx.State:
    """Every leaf but the adapters."""
    return params.filter(nnx.Not(LoRAParam))


def merged(cfg: LoRAConfig, params: nnx.State) -> nnx.State:
    """The base params with each adapter folded into its kernel (``W + scale * A @ B``, computed
    in float32 and stored in the kernel's dtype) and no ``LoRAParam`` leaves: the state of a
    plain model (``ModelConfig(lora=None)``) that computes the adapted function."""
    flat = dict(nnx.to_flat_state(params))
    out = {}
    for path, var in flat.items():
        if isinstance(var, LoRAParam):
            continue
        if path[-1] == "kernel" and path[:-1] + ("lora_a",) in flat:
            a = flat[path[:-1] + ("lora_a",)].get_value()
            b = flat[path[:-1] + ("lora_b",)].get_value()
            w = var.get_value()
            stacked = a.ndim + b.ndim - w.ndim - 2  # leading layer axes (0 or 1)
            lead = a.shape[:stacked]
            a2 = a.reshape(*lead, math.prod(a.shape[stacked:-1]), a.shape[-1])
            b2 = b.reshape(*lead, b.shape[stacked], -1)
            d = jnp.matmul(a2.astype(jnp.float32), b2.astype(jnp.float32)) * cfg.scale
            new = (w.astype(jnp.float32) + d.reshape(w.shape)).astype(w.dtype)
            var = var.replace(new)
        out[path] = var
    return nnx.from_flat_state(out)


def num_adapter_params(params: nnx.State) -> int:
    return sum(int(x.size) for x in jax.tree.leaves(adapters(params)))


# ---------------------------------------------------------------------------------------------
# Dropout key for the adapter path (set by the update engine around a microbatch's loss).

_local = threading.local()


@contextlib.contextmanager
def dropout_rng(key: jax.Array | None) -> Iterator[None]:
    """Model calls traced inside the block apply LoRA dropout with ``key`` (split per layer and
    projection). The model reads the key in the traced scope of the caller and passes it to its
    layer loop as an argument, so compiled layer programs never capture a stale key."""
    previous = getattr(_local, "key", None)
    _local.key = key
    try:
        yield
    finally:
        _local.key = previous


def current_dropout_rng() -> jax.Array | None:
    """The key of the innermost open ``dropout_rng`` block, or None."""
    return getattr(_local, "key", None)


__all__ = [
    "ATTENTION_TARGETS",
    "TARGETS",
    "LoRAConfig",
    "LoRAParam",
    "adapters",
    "base",
    "current_dropout_rng",
    "delta",
    "dropout_rng",
    "has_adapters",
    "init_a",
    "init_key",
    "merged",
    "num_adapter_params",
    "split_trainable",
    "stream_seed",
    "trainable",
]
