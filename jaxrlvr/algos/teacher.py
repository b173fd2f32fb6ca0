"""A local JAX teacher for on-policy distillation: a frozen decoder beside the student whose
log-probs (and top-k log-probs) of the student's own prompt + completion tokens feed
``algos.distill``.

The teacher is any checkpoint or Hugging Face folder ``model.load_hf`` loads (any size or family
the decoder serves), with the student's tokenizer. Its log-prob pass is the student's own
(``engine.make_logprob_fn``: the same backbone call, packing and shared-prompt fields, position
chunks of the head, microbatches), run with the teacher's graph definition and parameters, so a
teacher and a student with the same weights give the same numbers. On a mesh its parameters are
placed with the model's sharding rules, beside the student's.

Two ways in:
  - ``batch_logprobs(batch)``: device arrays in, [B, T] out: the pass a record's ``prepare``
    runs on the batch it trains on (``logprob_fn`` is the un-jitted function for a record to
    jit into its own prepare).
  - ``completion_logprobs(prompts, completions)``: token-id lists in, one float32 array per
    completion out: the host interface the vLLM teacher (``sampling.vllm_teacher``) shares, so
    ``jaxrlvr.teachers`` can route problems to either.

``topk`` gives the teacher's K most likely next tokens and their log-probs at every position
(the generalised JSD over the teacher's top-k, ``distill.generalized_jsd_topk``).

Not here: choosing a teacher per problem and checking tokenizers (``jaxrlvr.teachers``), the
vLLM teacher (``sampling.vllm_teacher``) and the losses (``distill``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrlvr import model as model_lib
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import engine


class TeacherError(ValueError):
    """A teacher that cannot be used: unloadable, or not matching the student."""


def completion_batch(
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    *,
    pad_id: int = 0,
    pad_to_multiple: int = 1,
) -> batch_lib.Batch:
    """Right-padded next-token rows ``[prompt][completion][pad]`` (``batch``'s layout):
    ``labels[b, t]`` follows ``input_ids[b, t]`` and ``loss_mask`` marks completion labels.
    T is the longest prompt + completion minus one, rounded up to ``pad_to_multiple``."""
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    seqs = [list(p) + list(c) for p, c in zip(prompts, completions, strict=True)]
    if any(len(p) < 1 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    t = max(len(s) for s in seqs) - 1
    t = max(1, -(-t // pad_to_multiple) * pad_to_multiple)
    b = len(seqs)
    ids = np.full((b, t + 1), pad_id, np.int32)
    attn = np.zeros((b, t), np.int32)
    loss = np.zeros((b, t), np.float32)
    for i, (p, s) in enumerate(zip(prompts, seqs, strict=True)):
        ids[i, : len(s)] = s
        attn[i, : len(s) - 1] = 1
        loss[i, len(p) - 1 : len(s) - 1] = 1.0
    return batch_lib.Batch(
        input_ids=ids[:, :-1], attention_mask=attn, labels=ids[:, 1:], loss_mask=loss
    )


def _topk_fn(graphdef: nnx.GraphDef, k: int, chunk_size: int | None) -> Any:
    """``(params, batch) -> (ids [B, T, K] int32, logp [B, T, K] float32)``: the teacher's
    ``k`` most likely next tokens at every position, the logits in chunks of ``chunk_size``
    positions (only one chunk's [B, C, V] exists at a time; None: all at once)."""

    def fn(params, batch):
        lm = nnx.merge(graphdef, params)
        hidden, _ = lm.backbone(
            batch.input_ids,
            batch.attention_mask,
            batch.positions,
            segment_ids=batch.segment_ids,
            prompt_group_ids=batch.prompt_group_ids,
        )

        def top(h):
            logp = jax.nn.log_softmax(lm.lm_logits(h).astype(jnp.float32), axis=-1)
            vals, ids = jax.lax.top_k(logp, k)
            return ids.astype(jnp.int32), vals

        b, t, _ = hidden.shape
        if chunk_size is None or chunk_size >= t:
            return top(hidden)
        n = -(-t // chunk_size)
        h = jnp.pad(hidden, ((0, 0), (0, n * chunk_size - t), (0, 0)))
        h = h.reshape(b, n, chunk_size, -1).swapaxes(0, 1)
        ids, vals = jax.lax.map(top, h)

        def merge(x):
            return x.swapaxes(0, 1).reshape(b, n * chunk_size, k)[:, :t]

        return merge(ids), merge(vals)

    return fn


class LocalTeacher:
    """A frozen JAX teacher (module docstring).

    Args:
      graphdef, params: the teacher's ``nnx.split(model, nnx.Param)``.
      name: how errors and metrics call it (default: the folder it was loaded from, or "teacher").
      tokenizer: its tokenizer, or the folder to load one from (``jaxrlvr.teachers`` compares it
        with the student's); None: not checked.
      num_microbatches, chunk_size, mesh: as ``engine.make_logprob_fn`` (memory bounds of the
        pass; the mesh keeps microbatches spread over the batch shards).
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        params: Any,
        *,
        name: str = "teacher",
        tokenizer: Any = None,
        num_microbatches: int = 1,
        chunk_size: int | None = None,
        mesh: Any = None,
    ):
        self.graphdef = graphdef
        self.params = params
        self.name = name
        self.tokenizer = tokenizer
        self.config = nnx.merge(graphdef, params).config
        self.num_microbatches = num_microbatches
        self.chunk_size = chunk_size
        self.logprob_fn = engine.make_logprob_fn(
            graphdef, num_microbatches=num_microbatches, chunk_size=chunk_size, mesh=mesh
        )
        self._logprobs = jax.jit(lambda p, b: self.logprob_fn(p, b)[0])
        self._topk: dict[int, Any] = {}

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        *,
        dtype: str = "float32",
        mesh: Any = None,
        num_microbatches: int = 1,
        chunk_size: int | None = None,
        name: str | None = None,
    ) -> LocalTeacher:
        """A teacher from a checkpoint / Hugging Face folder (``model.load_hf``; its tokenizer
        is the folder's when it has one).

        Raises:
          TeacherError: the folder cannot be loaded (one line: the teacher, then the cause).
        """
        path = os.fspath(path)
        try:
            lm = model_lib.load_hf(path, dtype=dtype, mesh=mesh)
        except (model_lib.CheckpointError, model_lib.ConfigError, OSError) as e:
            raise TeacherError(f"teacher {name or path!r} cannot be loaded: {e}") from None
        graphdef, params = nnx.split(lm, nnx.Param)
        has_tok = any(
            os.path.exists(os.path.join(path, f))
            for f in ("tokenizer.json", "tokenizer_config.json")
        )
        return cls(
            graphdef,
            params,
            name=name or path,
            tokenizer=path if has_tok else None,
            num_microbatches=num_microbatches,
            chunk_size=chunk_size,
            mesh=mesh,
        )

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def batch_logprobs(self, batch: batch_lib.Batch) -> jax.Array:
        """log p_teacher(labels) [B, T] float32 of a training batch (0 outside ``loss_mask``
        when chunked); no gradient. The batch's other fields are ignored."""
        return jax.lax.stop_gradient(self._logprobs(self.params, _model_fields(batch)))

    def topk(self, batch: batch_lib.Batch, k: int) -> tuple[jax.Array, jax.Array]:
        """(ids [B, T, k] int32, log-probs [B, T, k] float32) of the teacher's ``k`` most likely
        next tokens at every position of ``batch``."""
        if not (isinstance(k, int) and 1 <= k <= self.vocab_size):
            raise ValueError(f"k must be an integer in [1, {self.vocab_size}], got {k!r}")
        if k not in self._topk:
            self._topk[k] = jax.jit(_topk_fn(self.graphdef, k, self.chunk_size))
        return self._topk[k](self.params, _model_fields(batch))

    def completion_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        *,
        pad_to_multiple: int = 16,
    ) -> list[np.ndarray]:
        """log p_teacher of each completion token given its prompt and the completion's
        earlier tokens: one float32 array per completion (host in, host out).

        Rows are padded to a multiple of ``pad_to_multiple`` positions (fewer compilations) and
        the row count to a multiple of ``num_microbatches``."""
        batch = completion_batch(prompts, completions, pad_to_multiple=pad_to_multiple)
        rows = batch.input_ids.shape[0]
        extra = -rows % self.num_microbatches
        if extra:
            batch = jax.tree.map(lambda x: np.concatenate([x, np.zeros_like(x[:extra])]), batch)
        logp = np.asarray(self.batch_logprobs(batch), np.float32)
        return [
            logp[i, len(p) - 1 : len(p) - 1 + len(c)].copy()
            for i, (p, c) in enumerate(zip(prompts, completions, strict=True))
        ]


def _model_fields(batch: batch_lib.Batch) -> batch_lib.Batch:
    """Only the fields a forward pass reads (so one compiled pass serves every method's batch)."""
    return batch_lib.Batch(
        input_ids=batch.input_ids,
        attention_mask=batch.attention_mask,
        labels=batch.labels,
        loss_mask=batch.loss_mask,
        segment_ids=batch.segment_ids,
        positions=batch.positions,
        prompt_group_ids=batch.prompt_group_ids,
    )
