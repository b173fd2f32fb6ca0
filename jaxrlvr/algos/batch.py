"""The padded training batch and its host-side validation.

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
MoE routing replay (``algos.routing``): ``routes`` [B, T, L, k] (int8 / int16 / int32), the
experts the sampler sent each input token to in each of the L MoE layers, -1 where unknown (a
token with a -1 uses its live top-k); like the packing fields every update accepts it, and the
model's forward replays it.

Not here: building batches from rollouts (the driver) and length bucketing.
"""

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import struct

# Fields every update needs, and the optional ones, with their rank ("bt" = [B, T], "b" = [B],
# "btk" = [B, T, K] with any K, "btlk" = [B, T, L, k] with any L, k).
BASE_FIELDS = ("input_ids", "attention_mask", "labels", "loss_mask")
_LAYOUT = {
    "input_ids": "bt",
    "attention_mask": "bt",
    "labels": "bt",
    "loss_mask": "bt",
    "advantages": "b",
    "old_logp": "bt",
    "ref_logp": "bt",
    "sampler_logp": "bt",
    "behaviour_logp": "bt",
    "teacher_logp": "bt",
    "teacher_topk_ids": "btk",
    "teacher_topk_logp": "btk",
    "domain_ids": "bt",
    "rewards": "b",
    "old_values": "bt",
    "correct": "b",
    "segment_ids": "bt",
    "positions": "bt",
    "prompt_group_ids": "bt",
    "routes": "btlk",
    "sampler_routes": "btlk",
}
# Packed rows: optional for every update; segment ids and positions both or neither, prompt
# group ids (shared prompts) only with them.
PACKING_FIELDS = ("segment_ids", "positions", "prompt_group_ids")
# Read by the model's forward itself (routing replay), or by the update's engine beside it (the
# sampler's routes compared with the forward's own: ``routing.add_disagreement``), so accepted
# by every update.
MODEL_FIELDS = ("routes", "sampler_routes")
_INT_FIELDS = (
    "input_ids",
    "labels",
    "segment_ids",
    "positions",
    "prompt_group_ids",
    "teacher_topk_ids",
    "domain_ids",
)
_MASK_FIELDS = ("attention_mask", "loss_mask")
_ROUTE_DTYPES = (np.int8, np.int16, np.int32)


class BatchError(ValueError):
    """A batch whose fields do not match what the update needs."""


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
    teacher_logp: float32 [B, T] a distillation teacher's log-probs of the labels
    (``algos.distill``, ``jaxrlvr.teachers``), optional;
    teacher_topk_ids: int32 [B, T, K] and teacher_topk_logp: float32 [B, T, K], the teacher's K
    most likely next tokens at each position and their log-probs (the JSD over the teacher's
    top-k), optional;
    domain_ids: int32 [B, T] each label's problem domain, an index into the run's teacher
    registry (``TeacherRegistry.names``): which local teacher scores it in ``Learner.prepare``
    and its metrics' domain; read by no update (``select_fields`` drops it);
    rewards: float32 [B] task rewards (PPO); old_values: float32 [B, T] the value head's
    predictions at rollout time (PPO); correct: float32 [B], 1 where the verifier accepted the
    completion (expert iteration's filter).
    segment_ids, positions: int32 [B, T], packed rows (module docstring); then the per-sequence
    fields advantages, rewards and correct are per token, [B, T].
    prompt_group_ids: int32 [B, T], packed rows whose groups share one copy of their prompt.
    routes: int8 / int16 / int32 [B, T, L, k], MoE routing replay (module docstring), optional.
    sampler_routes: the same layout, the sampler's routes NOT replayed: the update compares them
    with its own forward's experts (``routing.add_disagreement``; ``rl.routing_metrics``).
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
    teacher_logp: jax.Array | None = None
    teacher_topk_ids: jax.Array | None = None
    teacher_topk_logp: jax.Array | None = None
    domain_ids: jax.Array | None = None
    rewards: jax.Array | None = None
    old_values: jax.Array | None = None
    correct: jax.Array | None = None
    segment_ids: jax.Array | None = None
    positions: jax.Array | None = None
    prompt_group_ids: jax.Array | None = None
    routes: jax.Array | None = None
    sampler_routes: jax.Array | None = None


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
            if name not in _LAYOUT:
                raise ValueError(f"unknown batch field {name!r}; known: {sorted(_LAYOUT)}")
        if not self.num_microbatches >= 1:
            raise ValueError(f"num_microbatches must be >= 1, got {self.num_microbatches!r}")


def run_backbone(lm: Any, b: Batch, **kwargs):
    """``lm.backbone`` over a batch's tokens and packing fields (input ids, attention mask,
    positions, segment ids, shared-prompt group ids): the one place these are passed. ``kwargs``
    go to ``backbone`` as they are (``routes=``, ``with_router=``)."""
    return lm.backbone(
        b.input_ids,
        b.attention_mask,
        b.positions,
        segment_ids=b.segment_ids,
        prompt_group_ids=b.prompt_group_ids,
        **kwargs,
    )


def _dtype_ok(name: str, dtype: np.dtype) -> str | None:
    if name in ("routes", "sampler_routes"):
        return None if dtype in _ROUTE_DTYPES else "int8, int16 or int32"
    if name in _INT_FIELDS:
        return None if dtype == np.int32 else "int32"
    if name in _MASK_FIELDS:
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
    allowed |= set(PACKING_FIELDS) | set(MODEL_FIELDS)
    ref = batch.input_ids
    if not hasattr(ref, "shape") or len(ref.shape) != 2:
        raise BatchError(f"batch.input_ids must be [B, T], got shape {getattr(ref, 'shape', None)}")
    b, t = ref.shape
    packed = batch.segment_ids is not None
    if packed != (batch.positions is not None):
        raise BatchError("batch.segment_ids and batch.positions go together: give both or neither")
    if batch.prompt_group_ids is not None and not packed:
        raise BatchError("batch.prompt_group_ids (shared prompts) need batch.segment_ids")
    for name in _LAYOUT:
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
        want = (b, t) if _LAYOUT[name] == "bt" or packed else (b,)
        shape = tuple(getattr(x, "shape", ()))
        if _LAYOUT[name] == "b" and not packed and shape == (b, t):
            want = shape  # per-sequence values given per token
        if _LAYOUT[name] == "btk":  # any K
            want = (b, t, shape[2] if len(shape) == 3 else "K")
        if _LAYOUT[name] == "btlk":  # any L, k
            want = (b, t, *shape[2:]) if len(shape) == 4 else (b, t, "L", "k")
        if shape != want:
            raise BatchError(
                f"batch.{name} must have shape {want} (B, T from input_ids), got {shape}"
            )
        expected = _dtype_ok(name, np.dtype(x.dtype))
        if expected is not None:
            raise BatchError(f"batch.{name} must be {expected}, got dtype {np.dtype(x.dtype)}")
    if b % spec.num_microbatches:
        raise BatchError(
            f"batch size B={b} is not divisible by num_microbatches={spec.num_microbatches}"
        )
    return b, t
