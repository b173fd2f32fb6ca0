"""From graded completions to a rollout batch: reward shaping, advantages, padding or packing.

Host-side glue between the sampler, the verifiers and the update: it turns one step's prompts and
sampled completions into numpy arrays of bucketed shapes (so the jitted update compiles once per
bucket), aligned the way ``algos.batch.Batch`` expects: a sequence is ``[prompt][completion]``
shifted by one, ``loss_mask`` on completion labels, sampler log-probs on the same positions.

Two layouts. Padded: one sequence per row, rows right-padded to the length bucket. Packed
(``pack(segments=True)``, the driver's default): sequences are laid one after another in rows of
a token budget T (first-fit decreasing), with ``segment_ids``/``positions`` (``algos.segments``),
and the row count rounded up to a bucket (``row_bucket``: a multiple of ``row_multiple`` times 1,
2, 3, 4, 6, 8, 12, ...), so the number of compiled shapes stays small while the padding that a
heavy-tailed length distribution leaves in a padded batch is not computed. With a token budget
per microbatch (``budget_rows``, the driver's ``rl.max_tokens_per_microbatch``) the row count
and the number of microbatches are both chosen from such buckets. Per-sequence fields
(advantages, rewards, correct) become per token in the packed layout (``PackedBatch.per_token``).
Shared prompts (``pack(share_prompts=G)``, the driver's ``rl.share_prompts``): the G completions
of a prompt are packed as one block, the prompt once and each completion after it in a segment
of its own that attends to it (``prompt_group_ids``, ``model.decoder``): a GRPO group costs its
prompt's positions once instead of G times, with the same log-probs, loss and gradient.
MoE routes (``pack(routes=...)``, ``Completion.routes``): each sequence's recorded experts go to
its input positions like its tokens; a shared prompt takes its group's first recorded routes
once; positions without routes hold -1 (the forward's live top-k).

Left out: sampling itself (``sampling/``), the loss math (``algos/``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jaxrlvr import metrics as metrics_lib
from jaxrlvr.algos import advantages as advantages_lib
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import loss_config, shaping
from jaxrlvr.model.buckets import length_bucket
from jaxrlvr.sampling.base import Completion


def row_bucket(rows: int, multiple: int = 1) -> int:
    """Smallest ``multiple * k`` >= ``rows`` with k in 1, 2, 3, 4, 6, 8, 12, 16, 24, ... (powers
    of two and 1.5 times them: at most a third of the rows are padding, few distinct shapes)."""
    power = 1
    while True:
        for k in (power, power * 3 // 2) if power >= 2 else (power,):
            if multiple * k >= rows:
                return multiple * k
        power *= 2


def budget_rows(
    rows: int,
    row_length: int,
    max_tokens: int,
    *,
    shards: int = 1,
    key: str = "max_tokens_per_microbatch",
) -> tuple[int, int]:
    """(batch rows, microbatches) for ``rows`` packed rows of ``row_length`` positions when a
    microbatch may hold at most ``max_tokens`` positions (a token budget, over all the batch
    shards together) and its rows must split evenly over ``shards`` batch shards.

    Both counts come from buckets, so that a run compiles few distinct updates: the number of
    microbatches is ``row_bucket`` of the fewest that hold the rows (1, 2, 3, 4, 6, 8, ...), and
    each microbatch's rows are ``row_bucket(., shards)`` of an even split, capped at the most
    that fit the budget. Every microbatch holds at most ``max_tokens`` positions; from 4 x
    ``shards`` rows on, at most a third of the rows returned are padding (all-padding rows that
    the caller adds), and ``rows`` from 1 to 2,000 map to some 20 to 30 distinct results.

    Raises:
      ValueError: ``max_tokens`` holds fewer than ``shards`` rows (``key`` names the setting).
    """
    most = max_tokens // row_length // shards * shards  # rows a microbatch may hold
    if most < 1:
        raise ValueError(
            f"{key}={max_tokens} is less than one microbatch of {shards} row(s) x T={row_length} "
            f"positions = {shards * row_length}: raise it or lower the rows' length"
        )
    n = row_bucket(-(-rows // most))
    per = min(most, row_bucket(-(-rows // n), shards))
    return n * per, n


def used_rows(batch: batch_lib.Batch) -> int:
    """Rows up to the last one that holds any token: packed rows are filled from the first, so
    the rest are all padding (``pack``'s row bucket)."""
    held = np.flatnonzero(np.asarray(batch.attention_mask).any(axis=1))
    return int(held[-1]) + 1 if held.size else 0


@dataclasses.dataclass
class PackedBatch:
    """Numpy arrays of one batch, B rows x T positions (see ``algos.batch.Batch``).

    Packed layout: ``segment_ids``/``positions`` [B, T] and ``placement`` [N, 3] (row, first
    position, end position) of each of the N sequences, in input order; None when padded.
    Shared prompts: ``prompt_group_ids`` [B, T] (``algos.batch``), and a sequence's placement is
    its completion's span (its prompt is its group's).
    """

    input_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    sampler_logp: np.ndarray
    num_tokens: int  # response tokens in the loss
    segment_ids: np.ndarray | None = None
    positions: np.ndarray | None = None
    placement: np.ndarray | None = None
    prompt_group_ids: np.ndarray | None = None
    routes: np.ndarray | None = None  # [B, T, L, k], -1 where unknown

    @property
    def shape(self) -> tuple[int, int]:
        return self.input_ids.shape

    def per_token(self, values: np.ndarray) -> np.ndarray:
        """[N] per-sequence values as float32 [B, T] on their sequences' tokens (0 on padding)."""
        out = np.zeros(self.shape, np.float32)
        for value, (row, start, end) in zip(np.asarray(values, np.float32), self.placement):
            out[row, start:end] = value
        return out

    @classmethod
    def empty(cls, rows: int, length: int, pad_id: int, *, packed: bool = False) -> PackedBatch:
        """``rows`` x ``length`` of padding with nothing in the loss, for the packers to fill in
        place; ``packed``: with zero ``segment_ids`` and ``positions`` too. ``num_tokens`` is
        set by ``counted`` once the loss mask is written."""
        shape = (rows, length)
        return cls(
            input_ids=np.full(shape, pad_id, np.int32),
            attention_mask=np.zeros(shape, np.int32),
            labels=np.full(shape, pad_id, np.int32),
            loss_mask=np.zeros(shape, np.float32),
            sampler_logp=np.zeros(shape, np.float32),
            num_tokens=0,
            segment_ids=np.zeros(shape, np.int32) if packed else None,
            positions=np.zeros(shape, np.int32) if packed else None,
        )

    def counted(self, **fields) -> PackedBatch:
        """The filled batch with its ``num_tokens`` (the loss mask's sum) and ``fields`` set."""
        return dataclasses.replace(self, num_tokens=int(self.loss_mask.sum()), **fields)


def _write_completion(
    loss_mask, sampler_logp, row, first, i, length, loss_weights, sampler_logps
) -> None:
    """Completion ``i``'s loss weights (default 1) and sampler log-probs at its ``length`` label
    positions from ``first`` in ``row``; the one writer for padded and packed rows."""
    if not length:
        return
    weights = np.ones(length, np.float32)
    if loss_weights is not None:
        weights = np.asarray(loss_weights[i], np.float32)
    loss_mask[row, first : first + length] = weights
    if sampler_logps is not None:
        sampler_logp[row, first : first + length] = np.asarray(sampler_logps[i], np.float32)


def _route_buffer(routes, rows: int, length: int) -> np.ndarray | None:
    """A [rows, length, L, k] buffer of -1 in the recorded routes' dtype, or None when no
    sequence carries routes."""
    first = next((r for r in routes or () if r is not None), None)
    if first is None:
        return None
    first = np.asarray(first)
    return np.full((rows, length, *first.shape[1:]), -1, first.dtype)


def _write_routes(buffer, routes, i, row, pos, lo, hi) -> None:
    """Sequence ``i``'s routes of its input tokens [lo, hi) at ``pos`` in ``row``."""
    if buffer is None or routes[i] is None:
        return
    r = np.asarray(routes[i])
    if r.shape[0] < hi:
        raise ValueError(f"pack: routes of sequence {i} cover {r.shape[0]} tokens, need {hi}")
    buffer[row, pos : pos + hi - lo] = r[lo:hi]


def pack(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int,
    batch_size: int | None = None,
    length: int | None = None,
    sampler_logps: Sequence[Sequence[float]] | None = None,
    loss_weights: Sequence[Sequence[float]] | None = None,
    max_length: int | None = None,
    segments: bool = False,
    row_tokens: int | None = None,
    row_multiple: int = 1,
    share_prompts: int | None = None,
    routes: Sequence[np.ndarray | None] | None = None,
) -> PackedBatch:
    """Packs prompt + completion rows into shifted, right-padded arrays.

    Args:
      prompts, completions: token ids per row (same number of rows).
      pad_id: padding token id.
      batch_size: rows of the result (>= rows given); extra rows are all padding, masked out.
      length: T; default: the power-of-two bucket of the longest row minus one.
      sampler_logps: per completion token, the sampler's log-prob (stored at the label position).
      loss_weights: per completion token, 0/1 weights (e.g. 0 for forced tokens).
      max_length: cap for the default bucket.
      segments: pack several sequences per row (module docstring); then ``batch_size`` (if
        given) fixes the row count, and the default row count is ``row_bucket`` of the rows used.
      row_tokens: packed rows' length T (at least the bucket of the longest sequence).
      row_multiple: packed row counts are multiples of it (microbatches x batch shards).
      share_prompts: packed, every ``share_prompts`` consecutive rows continue one prompt (a
        GRPO group): the prompt is laid out once and its completions attend to it
        (``prompt_group_ids``), so a group costs its prompt's positions once instead of once per
        completion; same log-probs, loss and gradient as without.
      routes: per sequence, MoE routes [len(prompt) + len(completion) - 1, L, k] of its input
        tokens (``Completion.routes``) or None; the result's ``routes`` (module docstring).
    """
    rows = len(prompts)
    if len(completions) != rows:
        raise ValueError(f"pack: {rows} prompts but {len(completions)} completions")
    if segments:
        return _pack_segments(
            prompts,
            completions,
            pad_id=pad_id,
            batch_size=batch_size,
            length=length,
            sampler_logps=sampler_logps,
            loss_weights=loss_weights,
            max_length=max_length,
            row_tokens=row_tokens,
            row_multiple=row_multiple,
            share_prompts=share_prompts,
            routes=routes,
        )
    if share_prompts:
        raise ValueError("pack: share_prompts needs the packed layout (segments=True)")
    batch_size = rows if batch_size is None else batch_size
    if batch_size < rows:
        raise ValueError(f"pack: batch_size={batch_size} is smaller than the {rows} rows given")
    longest = max((len(p) + len(c) for p, c in zip(prompts, completions)), default=2)
    if length is None:
        length = length_bucket(longest, maximum=max_length) - 1
    if longest - 1 > length:
        raise ValueError(f"pack: a row of {longest} tokens does not fit length T={length} + 1")
    out = PackedBatch.empty(batch_size, length, pad_id)
    route_buf = _route_buffer(routes, batch_size, length)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        full = np.asarray(list(p) + list(c), np.int32)
        n = len(full) - 1
        if n <= 0:
            continue
        _write_routes(route_buf, routes, i, i, 0, 0, n)
        out.input_ids[i, :n] = full[:-1]
        out.labels[i, :n] = full[1:]
        out.attention_mask[i, :n] = 1
        start = len(p) - 1  # label position of the first completion token
        _write_completion(
            out.loss_mask, out.sampler_logp, i, start, i, len(c), loss_weights, sampler_logps
        )
    return out.counted(routes=route_buf)


class _Span(NamedTuple):
    """One sequence's positions in a packed row: completion ``index``'s input and label ids, the
    offset of its first completion label in the span, and the span's first position id."""

    index: int
    input_ids: list[int]
    labels: list[int]
    first_label: int
    first_position: int


@dataclasses.dataclass
class _Item:
    """What first-fit decreasing places as one block of a packed row: one sequence, or a group
    of completions after one shared copy of their prompt (``share_prompts``)."""

    prefix: list[int]  # a group's shared prompt, all but its last token (segment 0)
    spans: list[_Span]

    @property
    def size(self) -> int:
        return len(self.prefix) + sum(len(span.input_ids) for span in self.spans)


def _sequence_items(prompts, completions) -> list[_Item]:
    """One item per sequence ``[prompt][completion]``, shifted by one (empty: nothing to pack)."""
    items = []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        full = list(p) + list(c)
        if len(full) < 2:
            continue
        items.append(_Item([], [_Span(i, full[:-1], full[1:], len(p) - 1, 0)]))
    return items


def _group_items(prompts, completions, group_size: int) -> list[_Item]:
    """One item per group of ``group_size`` consecutive completions of one prompt: the prompt
    but its last token once, then per completion the prompt's last token and the completion
    shifted by one (the span that predicts the completion: ``len(completion)`` positions)."""
    if len(completions) % group_size:
        raise ValueError(
            f"pack: {len(completions)} completions are not groups of share_prompts={group_size}"
        )
    items = []
    for g in range(0, len(completions), group_size):
        p = list(prompts[g])
        if not p:
            raise ValueError("pack: share_prompts needs prompts of at least one token")
        if any(list(prompts[i]) != p for i in range(g, g + group_size)):
            raise ValueError(
                f"pack: share_prompts={group_size}, but completions {g}..{g + group_size - 1} "
                "do not all continue one prompt"
            )
        spans = [
            _Span(i, [p[-1]] + list(completions[i][:-1]), list(completions[i]), 0, len(p) - 1)
            for i in range(g, g + group_size)
            if len(completions[i])
        ]
        if spans:
            items.append(_Item(p[:-1], spans))
    return items


def packed_length(
    longest: int, *, max_length: int | None = None, row_tokens: int | None = None
) -> int:
    """Packed rows' length T for items of at most ``longest`` positions: ``row_tokens`` (or the
    power-of-two bucket of the longest item, capped at ``max_length``) when the longest fits.

    An item can be longer than ``max_length`` (the longest one sequence may be): a group sharing
    its prompt holds all its completions. Such T are bucketed too, at ``row_tokens + 1`` (or
    ``max_length``) times 1, 1.5, 2, 3, 4, 6, ... (at most a third padding), so that steps whose
    groups outgrow the row compile a few updates, not one per longest group (a tiny MoE demo
    that samples 12-token answers after a short warm start compiled its update afresh on 12 of
    13 steps, ~10 s each, before these buckets).
    """
    fits = max(length_bucket(longest + 1, maximum=max_length) - 1, row_tokens or 0)
    cap = (row_tokens + 1) if row_tokens else max_length
    if cap is None or longest + 1 <= max(cap, max_length or 0):
        return fits
    halves = row_bucket(-(-2 * (longest + 1) // cap))  # T + 1 in half-multiples of the cap
    return (halves * cap + 1) // 2 - 1


def _pack_segments(
    prompts,
    completions,
    *,
    pad_id,
    batch_size,
    length,
    sampler_logps,
    loss_weights,
    max_length,
    row_tokens,
    row_multiple,
    share_prompts=None,
    routes=None,
) -> PackedBatch:
    """``pack(segments=True)``: first-fit decreasing of the items (sequences, or groups that
    share their prompt) into rows of T positions."""
    if share_prompts:
        items = _group_items(prompts, completions, share_prompts)
    else:
        items = _sequence_items(prompts, completions)
    longest = max((it.size for it in items), default=1)
    if length is None:
        length = packed_length(longest, max_length=max_length, row_tokens=row_tokens)
    if longest > length:
        what = "a group sharing its prompt" if share_prompts else "a row"
        raise ValueError(f"pack: {what} of {longest + 1} tokens does not fit length T={length} + 1")
    # First-fit decreasing (stable for equal sizes): rows end up nearly full.
    free: list[int] = []
    where = [(0, 0)] * len(items)
    for k in sorted(range(len(items)), key=lambda k: -items[k].size):
        size = items[k].size
        row = next((r for r, f in enumerate(free) if f >= size), None)
        if row is None:
            row = len(free)
            free.append(length)
        where[k] = (row, length - free[row])
        free[row] -= size
    rows = max(len(free), 1)
    b = row_bucket(rows, row_multiple) if batch_size is None else batch_size
    if b < rows:
        raise ValueError(f"pack: batch_size={b} is smaller than the {rows} packed rows needed")
    out = PackedBatch.empty(b, length, pad_id, packed=True)
    input_ids, labels, attention = out.input_ids, out.labels, out.attention_mask
    loss_mask, sampler_logp = out.loss_mask, out.sampler_logp
    segment_ids, positions = out.segment_ids, out.positions
    groups = np.zeros((b, length), np.int32) if share_prompts else None
    route_buf = _route_buffer(routes, b, length)
    placement = np.zeros((len(completions), 3), np.int64)
    # Segment (and group) ids 1, 2, ... in position order within each row.
    seg_count, group_count = [0] * b, [0] * b
    for k in sorted(range(len(items)), key=lambda k: where[k]):
        item, (row, pos) = items[k], where[k]
        if groups is not None:
            group_count[row] += 1
        n = len(item.prefix)
        if n and route_buf is not None:  # a shared prompt: its group's first recorded routes
            first = next((s.index for s in item.spans if routes[s.index] is not None), None)
            if first is not None:
                _write_routes(route_buf, routes, first, row, pos, 0, n)
        if n:
            ids = np.asarray(item.prefix, np.int32)
            input_ids[row, pos : pos + n] = ids
            labels[row, pos : pos + n - 1] = ids[1:]  # no loss on a prompt: labels are unread
            attention[row, pos : pos + n] = 1
            positions[row, pos : pos + n] = np.arange(n)
            groups[row, pos : pos + n] = group_count[row]
            pos += n
        for i, ids, labs, first, pos0 in item.spans:
            end = pos + len(ids)
            seg_count[row] += 1
            placement[i] = (row, pos, end)
            input_ids[row, pos:end] = ids
            labels[row, pos:end] = labs
            attention[row, pos:end] = 1
            segment_ids[row, pos:end] = seg_count[row]
            positions[row, pos:end] = pos0 + np.arange(len(ids))
            if groups is not None:
                groups[row, pos:end] = group_count[row]
            # The span's input tokens are tokens pos0 .. pos0 + len(ids) of [prompt][completion].
            _write_routes(route_buf, routes, i, row, pos, pos0, pos0 + len(ids))
            _write_completion(
                loss_mask,
                sampler_logp,
                row,
                pos + first,
                i,
                len(completions[i]),
                loss_weights,
                sampler_logps,
            )
            pos = end
    return out.counted(placement=placement, prompt_group_ids=groups, routes=route_buf)


def completion_weights(c: Completion, *, mask_forced: bool, mask_truncated: bool) -> list[float]:
    """0/1 loss weight per completion token: forced (thinking-budget) tokens and, optionally,
    truncated completions (DAPO overlong filtering) are not trained on."""
    if mask_truncated and c.finish_reason == "length":
        return [0.0] * len(c.token_ids)
    forced = getattr(c, "forced", None)
    if mask_forced and forced:
        return [0.0 if f else 1.0 for f in forced]
    return [1.0] * len(c.token_ids)


def shaped_rewards(
    rewards: np.ndarray,
    correct: np.ndarray,
    lengths: np.ndarray,
    group_size: int,
    *,
    length_reward_weight: float = 0.0,
    overlong: loss_config.OverlongConfig | None = None,
) -> tuple[np.ndarray, dict[str, float]]:
    """Task rewards plus the Kimi k1.5 length reward and the DAPO soft overlong penalty."""
    out = rewards.astype(np.float32)
    metrics = {}
    if length_reward_weight > 0:
        bonus = np.asarray(
            shaping.kimi_length_reward(jnp.asarray(lengths), jnp.asarray(correct), group_size)
        )
        out = out + length_reward_weight * bonus
        metrics["length_reward_mean"] = float(bonus.mean())
    if overlong is not None:
        penalty = np.asarray(shaping.overlong_reward(jnp.asarray(lengths), overlong))
        out = out + penalty
        metrics["overlong_penalty_mean"] = float(penalty.mean())
    return out, metrics


def group_advantages(
    rewards: np.ndarray, group_size: int, cfg: loss_config.AdvantageConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Advantages [N] and a per-group "all rewards equal" flag [N / G]."""
    adv = np.asarray(advantages_lib.group_advantages(jnp.asarray(rewards), group_size, cfg))
    grouped = rewards.reshape(-1, group_size)
    zero_var = np.all(grouped == grouped[:, :1], axis=1)
    return adv.astype(np.float32), zero_var


def completion_values(
    packed: PackedBatch,
    completions: Sequence[Sequence[int]],
    values: Sequence[Sequence[float]] | Sequence[np.ndarray],
    dtype=np.float32,
) -> np.ndarray:
    """Per completion token ``values`` (e.g. a teacher's log-probs, [L] per completion, or its
    top-k, [L, K]) as ``dtype`` [B, T] (or [B, T, K]) at the label positions where ``pack`` put
    ``sampler_logps`` (padded rows, packed segments, shared prompts alike); 0 elsewhere.
    ``completions`` are the ones ``packed`` holds, in its order."""
    trailing = np.shape(values[0])[1:] if len(values) else ()
    out = np.zeros(packed.shape + trailing, dtype)
    for i, c in enumerate(completions):
        n = len(c)
        v = np.asarray(values[i], dtype)
        if v.shape != (n, *trailing):
            raise ValueError(f"completion {i}: {v.shape[0]} values for {n} tokens")
        if not n:
            continue
        if packed.placement is None:  # row i; its first label follows the prompt
            row, end = i, int(np.flatnonzero(packed.attention_mask[i]).max()) + 1
        else:
            row, _, end = (int(x) for x in packed.placement[i])
        out[row, end - n : end] = v
    return out


def to_batch(packed: PackedBatch, **fields: np.ndarray | None) -> batch_lib.Batch:
    """A host ``Batch`` (NumPy) from packed rows plus per-sequence [N] / per-token ``fields``
    (in the packed layout, [N] fields are spread over their sequences' tokens)."""
    arrays = dict(
        input_ids=packed.input_ids,
        attention_mask=packed.attention_mask,
        labels=packed.labels,
        loss_mask=packed.loss_mask,
    )
    if packed.segment_ids is not None:
        arrays.update(segment_ids=packed.segment_ids, positions=packed.positions)
        if packed.prompt_group_ids is not None:
            arrays.update(prompt_group_ids=packed.prompt_group_ids)
        fields = {
            k: packed.per_token(v) if v is not None and np.ndim(v) == 1 else v
            for k, v in fields.items()
        }
    arrays.update({k: v for k, v in fields.items() if v is not None})
    return batch_lib.Batch(**{k: np.asarray(v) for k, v in arrays.items()})


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShapingConfig:
    """The host-side choices of turning graded completions into a rollout batch (the driver
    fills it from ``rl.*``): advantage estimator, Kimi length reward, DAPO overlong penalty,
    forced-token and truncation masking, zero-variance group dropping, and the layout: packed
    rows (``packing``: several rollouts per row of ``max_tokens_per_row`` positions, default the
    length bucket of the longest rollout; row counts a multiple of ``row_multiple``; with
    ``share_prompts`` each group's prompt once, ``pack``) or one rollout per padded row."""

    group_size: int
    advantage: loss_config.AdvantageConfig = dataclasses.field(
        default_factory=loss_config.AdvantageConfig
    )
    length_reward_weight: float = 0.0
    overlong: loss_config.OverlongConfig | None = None
    mask_forced_tokens: bool = True
    mask_truncated: bool = False
    drop_zero_variance_groups: bool = False
    packing: bool = False
    max_tokens_per_row: int | None = None
    row_multiple: int = 1
    share_prompts: bool = False


def shape(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Completion],
    scores: Sequence[dict[str, float]],
    cfg: ShapingConfig,
    *,
    pad_id: int,
    max_length: int | None = None,
    fields: Mapping[str, Sequence[np.ndarray]] | None = None,
) -> tuple[batch_lib.Batch, dict[str, float]]:
    """One step's rollouts as a host ``Batch`` with every rollout field an algorithm may read
    (``advantages``, ``rewards`` (shaped), ``correct``, ``sampler_logp``), and their metrics.

    Args:
      prompts: P prompts' token ids; completions: P x G completions, prompt-major;
      scores: the verifier's dict per completion (``reward``, ``answer_reward``,
        ``format_reward``).
      fields: a rollout pass's per-token fields (``passes``): Batch field name -> per
        completion an array [L] or [L, K] (L its tokens), laid out like ``sampler_logp``
        (``completion_values``) as int32 when integer, else float32.
    """
    g = cfg.group_size
    raw = np.asarray([s["reward"] for s in scores], np.float32)
    correct = np.asarray([s["answer_reward"] for s in scores], np.float32)
    lengths = np.asarray([len(c.token_ids) for c in completions], np.float32)
    rewards, metrics = shaped_rewards(
        raw,
        correct,
        lengths,
        g,
        length_reward_weight=cfg.length_reward_weight,
        overlong=cfg.overlong,
    )
    adv, zero_var = group_advantages(rewards, g, cfg.advantage)
    weights = [
        completion_weights(c, mask_forced=cfg.mask_forced_tokens, mask_truncated=cfg.mask_truncated)
        for c in completions
    ]
    if cfg.drop_zero_variance_groups:
        keep_rows = np.repeat(~zero_var, g)
        weights = [w if k else [0.0] * len(w) for w, k in zip(weights, keep_rows)]
    packed = pack(
        [prompts[i // g] for i in range(len(completions))],
        [c.token_ids for c in completions],
        pad_id=pad_id,
        sampler_logps=[c.logprobs for c in completions],
        loss_weights=weights,
        max_length=max_length,
        segments=cfg.packing,
        row_tokens=cfg.max_tokens_per_row,
        row_multiple=cfg.row_multiple,
        share_prompts=g if cfg.share_prompts else None,
        routes=[c.routes for c in completions],
    )
    batch = to_batch(
        packed,
        advantages=adv,
        rewards=rewards,
        correct=correct,
        sampler_logp=packed.sampler_logp,
        routes=packed.routes,
        **{
            name: completion_values(
                packed,
                [c.token_ids for c in completions],
                values,
                np.int32 if values and np.asarray(values[0]).dtype.kind in "iu" else np.float32,
            )
            for name, values in (fields or {}).items()
        },
    )
    metrics.update(
        {
            "reward_mean": float(raw.mean()),
            "reward_std": float(raw.std()),
            "shaped_reward_mean": float(rewards.mean()),
            "accuracy": float(correct.mean()),
            "format_rate": float(np.mean([s["format_reward"] for s in scores])),
            "response_length_mean": float(lengths.mean()),
            "response_length_max": float(lengths.max()),
            **metrics_lib.length_by_outcome(lengths, correct),
            "zero_variance_group_fraction": float(zero_var.mean()),
            "truncated_fraction": float(
                np.mean([c.finish_reason == "length" for c in completions])
            ),
            "tokens/response": int(lengths.sum()),
            "tokens/batch_shape_T": int(packed.shape[1]),
            "tokens/attended": int(packed.attention_mask.sum()),
            "tokens/batch_shape_B": int(packed.shape[0]),
            "tokens/padding_fraction": 1.0 - float(packed.attention_mask.mean()),
        }
    )
    return batch, metrics
