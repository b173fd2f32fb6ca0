"""The padded training batch, its field registry and its host-side validation.

Each row is right-padded ``[prompt][completion][pad]`` and already shifted for next-token
training (``losses.tokenize_prompt_and_output``): ``labels[b, t]`` is the token that follows
``input_ids[b, t]``, and ``loss_mask[b, t]`` marks the positions whose label is a response token.
Per-token arrays (log-probs, values) are indexed like ``labels``.

``validate_batch(batch, spec)`` checks field presence, shapes and dtypes on the host and raises
one ``BatchError`` naming the field, so a malformed batch fails before anything is traced or
compiled. Each update factory publishes the ``BatchSpec`` it needs as ``update.batch_spec``.

Packed batches (``algos.segments``): ``segment_ids`` [B, T] int32 (1, 2, ... per sequence in a
row, 0 on padding) and ``positions`` [B, T] int32 (restarting at 0 in every segment) put several
rollouts in one row; both or neither are given, and every update accepts them. Per-sequence
fields (``advantages``, ``rewards``, ``correct``) are then per token, [B, T]: each token holds
its sequence's value. Without segment ids they may be [B] (one sequence per row) or [B, T].
Shared prompts (``rollout.pack(share_prompts=...)``): ``prompt_group_ids`` [B, T] int32 as well
(``model.decoder``): a group's prompt is laid out once, in segment 0 (no loss, no sequence), and
its completions' segments attend to it.

Pass fields: a feature that adds data to the rollouts (a rollout pass, ``jaxrlvr.passes``)
declares each of its fields in its own module with ``register_field(name, layout, kind, *,
model=False)``: its layout ("bt", "btk", "btlk"), its dtype class ("int", "float", "route") and
whether the model's forward (or the update's engine beside it) reads it, so every update accepts
it. ``Batch`` holds them in one pytree field, ``extra`` (name -> array), and reads and writes them
like its own: ``Batch(..., name=x)``, ``batch.name`` (None when absent), ``batch.replace(name=x)``
(None removes it). Jit, sharding, microbatch splitting, padding (``step.pad_rows``: a field's
``Field.fill``) and validation treat them as every other field; this module names none of them.

Not here: building batches from rollouts (the driver) and length bucketing.
"""

import dataclasses
from typing import Any, Literal, get_args

import jax
import numpy as np
from flax import struct

# A field's rank: "bt" = [B, T], "b" = [B] (or [B, T] per token), "btk" = [B, T, K] with any K,
# "btlk" = [B, T, L, k] with any L, k.
Layout = Literal["b", "bt", "btk", "btlk"]
# A field's dtype class: int32, float32, a mask (bool, integer or floating), MoE expert ids
# (int8, int16 or int32; -1 = none).
Kind = Literal["int", "float", "mask", "route"]


@dataclasses.dataclass(frozen=True)
class Field:
    """One batch field: its ``name``, ``layout`` and dtype class (``kind``); ``model``: read by
    the model's forward or by the update's engine beside it, so accepted by every update."""

    name: str
    layout: Layout
    kind: Kind = "float"
    model: bool = False

    @property
    def fill(self) -> int:
        """What padding rows and positions hold (``step.pad_rows``): -1 for expert ids (the
        "no recorded expert"), else 0."""
        return -1 if self.kind == "route" else 0


# The core fields, in ``Batch``'s order.
_CORE = {
    f.name: f
    for f in (
        Field("input_ids", "bt", "int"),
        Field("attention_mask", "bt", "mask"),
        Field("labels", "bt", "int"),
        Field("loss_mask", "bt", "mask"),
        Field("advantages", "b"),
        Field("old_logp", "bt"),
        Field("ref_logp", "bt"),
        Field("sampler_logp", "bt"),
        Field("behaviour_logp", "bt"),
        Field("rewards", "b"),
        Field("old_values", "bt"),
        Field("correct", "b"),
        Field("segment_ids", "bt", "int"),
        Field("positions", "bt", "int"),
        Field("prompt_group_ids", "bt", "int"),
    )
}
# The pass fields, in registration order (``register_field``).
_REGISTERED: dict[str, Field] = {}
# Fields every update needs.
BASE_FIELDS = ("input_ids", "attention_mask", "labels", "loss_mask")
# Packed rows: optional for every update; segment ids and positions both or neither, prompt
# group ids (shared prompts) only with them.
PACKING_FIELDS = ("segment_ids", "positions", "prompt_group_ids")
_ROUTE_DTYPES = (np.int8, np.int16, np.int32)


class BatchError(ValueError):
    """A batch whose fields do not match what the update needs."""


def register_field(
    name: str, layout: Layout, kind: Kind = "float", *, model: bool = False
) -> Field:
    """Declare a pass field (module docstring) and return it; called once, at import, by the
    module that owns the field. Registering the same declaration again is a no-op.

    Raises:
      ValueError: a bad name, layout or kind, a core field's name, or a name registered with
        another declaration.
    """
    if not name.isidentifier() or name.startswith("_") or name == "extra":
        raise ValueError(f"register_field: {name!r} is not a usable field name")
    if layout not in get_args(Layout) or kind not in get_args(Kind):
        raise ValueError(
            f"register_field {name!r}: layout must be one of {get_args(Layout)} and kind one of "
            f"{get_args(Kind)}, got {layout!r}, {kind!r}"
        )
    field = Field(name, layout, kind, model)
    if name in _CORE:
        raise ValueError(f"register_field: {name!r} is a core Batch field")
    if _REGISTERED.get(name, field) != field:
        raise ValueError(f"batch field {name!r} registered twice: {_REGISTERED[name]}, {field}")
    _REGISTERED[name] = field
    return field


def known_fields() -> dict[str, Field]:
    """Every field by name: the core fields in ``Batch``'s order, then the registered ones."""
    return {**_CORE, **_REGISTERED}


def get_field(name: str) -> Field:
    """The declaration of field ``name``; ``BatchError`` (one line) when no field has it."""
    got = _CORE.get(name) or _REGISTERED.get(name)
    if got is None:
        raise BatchError(f"unknown batch field {name!r}; known: {sorted(known_fields())}")
    return got


def model_fields() -> tuple[str, ...]:
    """The registered fields the model's forward (or its engine) reads: every update accepts
    them."""
    return tuple(n for n, f in _REGISTERED.items() if f.model)


@struct.dataclass
class Batch:
    """One optimiser step's data. Shapes: B rows, T positions.

    input_ids: int32 [B, T]; attention_mask: [B, T] (1 = real token, bool/int/float);
    labels: int32 [B, T] (next token); loss_mask: [B, T] (1 where the label is a response token);
    advantages: float32 [B] per-sequence advantage (GRPO/REINFORCE);
    old_logp: float32 [B, T] log pi_old(labels) from the trainer before this rollout's updates;
    ref_logp: float32 [B, T] reference-model log-probs (KL penalty), optional;
    sampler_logp: float32 [B, T] the sampler's log-probs (off-policy correction), optional;
    behaviour_logp: float32 [B, T] the trainer's log-probs under the parameter version that
    sampled the rollouts (stale batches; ``algos.importance``), optional;
    rewards: float32 [B] task rewards (PPO); old_values: float32 [B, T] the value head's
    predictions at rollout time (PPO); correct: float32 [B], 1 where the verifier accepted the
    completion (expert iteration's filter).
    segment_ids, positions: int32 [B, T], packed rows (module docstring); then the per-sequence
    fields advantages, rewards and correct are per token, [B, T].
    prompt_group_ids: int32 [B, T], packed rows whose groups share one copy of their prompt.
    extra: the pass fields present (name -> array; ``register_field``), each read as
    ``batch.<name>`` and given as ``Batch(<name>=...)`` / ``replace(<name>=...)``; their
    declarations are with their features (``known_fields`` lists them).
    """

    input_ids: jax.Array
    attention_mask: jax.Array
    labels: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array | None = None
    old_logp: jax.Array | None = None
    ref_logp: jax.Array | None = None
    sampler_logp: jax.Array | None = None
    behaviour_logp: jax.Array | None = None
    rewards: jax.Array | None = None
    old_values: jax.Array | None = None
    correct: jax.Array | None = None
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    prompt_group_ids: jax.Array | None = None
    extra: dict[str, Any] = struct.field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        # Reached only for names that are not dataclass fields: a registered pass field.
        if name in _REGISTERED:
            return self.__dict__.get("extra", {}).get(name)
        raise AttributeError(
            f"Batch has no field {name!r} (core fields and registered pass fields: "
            f"{sorted(known_fields())})"
        )

    def as_dict(self) -> dict[str, Any]:
        """The fields present (not None) by name: the core fields in order, then the pass
        fields."""
        out = {n: getattr(self, n) for n in _CORE}
        out.update(self.extra)
        return {n: x for n, x in out.items() if x is not None}


_dataclass_init = Batch.__init__


def _batch_init(self, *args, extra: dict[str, Any] | None = None, **fields: Any) -> None:
    """``Batch``'s constructor: the core fields as the dataclass takes them; any other keyword
    is a registered pass field, kept in ``extra`` (None: absent, so ``replace(name=None)``
    drops it)."""
    core = {n: x for n, x in fields.items() if n in _CORE}
    merged = dict(extra or {})
    for name, x in fields.items():
        if name in core:
            continue
        if name not in _REGISTERED:
            raise TypeError(
                f"Batch got an unknown field {name!r}: neither a core field nor one registered "
                f"with batch.register_field (known: {sorted(known_fields())})"
            )
        if x is None:
            merged.pop(name, None)
        else:
            merged[name] = x
    _dataclass_init(self, *args, extra=merged, **core)


Batch.__init__ = _batch_init


@dataclasses.dataclass(frozen=True, kw_only=True)
class BatchSpec:
    """What an update requires of its batch.

    required: field names that must be present (besides ``BASE_FIELDS``).
    optional: fields that are used when present (others must be None).
    num_microbatches: B must be divisible by it.
    """

    required: tuple[str, ...] = ()
    optional: tuple[str, ...] = ()
    num_microbatches: int = 1

    def __post_init__(self) -> None:
        for name in self.required + self.optional:
            if name not in _CORE and name not in _REGISTERED:
                raise ValueError(f"unknown batch field {name!r}; known: {sorted(known_fields())}")
        if not self.num_microbatches >= 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches!r}")


def run_backbone(lm: Any, b: Batch, **kwargs):
    """``lm.backbone`` over a batch's tokens and packing fields (input ids, attention mask,
    positions, segment ids, shared-prompt group ids): the one place these are passed. ``kwargs``
    go to ``backbone`` as they are (a MoE model's replay and router options)."""
    return lm.backbone(
        b.input_ids,
        b.attention_mask,
        b.positions,
        segment_ids=b.segment_ids,
        prompt_group_ids=b.prompt_group_ids,
        **kwargs,
    )


def _dtype_ok(kind: Kind, dtype: np.dtype) -> str | None:
    if kind == "route":
        return None if dtype in _ROUTE_DTYPES else "int8, int16 or int32"
    if kind == "int":
        return None if dtype == np.int32 else "int32"
    if kind == "mask":
        ok = (
            dtype == np.bool_
            or np.issubdtype(dtype, np.integer)
            or np.issubdtype(dtype, np.floating)
        )
        return None if ok else "bool, integer or floating"
    return None if dtype == np.float32 else "float32"


def validate_batch(batch: Batch, spec: BatchSpec) -> tuple[int, int]:
    """Check ``batch`` against ``spec`` on the host; return (B, T).

    Works on concrete arrays, NumPy arrays and abstract ``jax.ShapeDtypeStruct`` leaves alike
    (only shapes and dtypes are read), so it also runs at trace time inside an update.

    Raises:
      BatchError: naming the first offending field: missing, unexpected, wrong rank/shape,
        wrong dtype, or a batch size not divisible by ``spec.num_microbatches``.
    """
    if not isinstance(batch, Batch):
        raise BatchError(f"expected a jaxrlvr.algos.batch.Batch, got {type(batch).__name__}")
    allowed = set(BASE_FIELDS) | set(spec.required) | set(spec.optional)
    allowed |= set(PACKING_FIELDS) | set(model_fields())
    ref = batch.input_ids
    if not hasattr(ref, "shape") or len(ref.shape) != 2:
        raise BatchError(f"batch.input_ids must be [B, T], got shape {getattr(ref, 'shape', None)}")
    b, t = ref.shape
    packed = batch.segment_ids is not None
    if packed != (batch.positions is not None):
        raise BatchError("batch.segment_ids and batch.positions go together: give both or neither")
    if batch.prompt_group_ids is not None and not packed:
        raise BatchError("batch.prompt_group_ids (shared prompts) need batch.segment_ids")
    unknown = sorted(set(batch.extra) - set(_REGISTERED))
    if unknown:
        raise BatchError(f"batch.{unknown[0]} is not a registered batch field")
    for name, f in known_fields().items():
        x = getattr(batch, name)
        needed = name in BASE_FIELDS or name in spec.required
        if x is None:
            if needed:
                raise BatchError(f"batch.{name} is required by this update but is None")
            continue
        if name not in allowed:
            raise BatchError(
                f"batch.{name} is not used by this update (it uses {sorted(allowed)}); "
                "set it to None"
            )
        want = (b, t) if f.layout == "bt" or packed else (b,)
        shape = tuple(getattr(x, "shape", ()))
        if f.layout == "b" and not packed and shape == (b, t):
            want = shape  # per-sequence values given per token
        if f.layout == "btk":  # any K
            want = (b, t, shape[2] if len(shape) == 3 else "K")
        if f.layout == "btlk":  # any L, k
            want = (b, t, *shape[2:]) if len(shape) == 4 else (b, t, "L", "k")
        if shape != want:
            raise BatchError(
                f"batch.{name} must have shape {want} (B, T from input_ids), got {shape}"
            )
        expected = _dtype_ok(f.kind, np.dtype(x.dtype))
        if expected is not None:
            raise BatchError(f"batch.{name} must be {expected}, got dtype {np.dtype(x.dtype)}")
    if b % spec.num_microbatches:
        raise BatchError(
            f"batch size B={b} is not divisible by num_microbatches={spec.num_microbatches}"
        )
    return b, t
