"""The local JAX teacher: a frozen decoder beside the student.

``LocalTeacher`` is any checkpoint or Hugging Face folder ``model.load_hf`` loads (any size or
family the decoder serves), with the student's tokenizer. Its log-prob pass is the student's own
(``engine.make_logprob_fn``: the same backbone call, packing and shared-prompt fields, position
chunks of the head, microbatches) run with the teacher's graph definition and parameters, jitted
with the parameters as arguments (a program that closed over them would hold them as
constants). On a mesh its parameters are placed by the model's sharding rules, beside the
student's. ``batch_logprobs(batch)`` is the device pass on a training batch (the rollouts'
``teacher_logp``, ``algos.distill``); ``topk(batch, k)`` the teacher's k most likely next tokens
at every position (the JSD over the teacher's top-k); ``completion_logprobs`` the host interface
it shares with the vLLM teacher (``teachers.vllm``).

Not here: choosing a teacher per problem and the checks (``teachers.registry``).
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
from jaxrlvr import rollout
from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.algos import engine


class TeacherError(ValueError):
    """A teacher that cannot be used: unloadable, unreachable, or not matching the student."""


def _topk_fn(graphdef: nnx.GraphDef, k: int, chunk_size: int | None) -> Any:
    """``(params, batch) -> (ids [B, T, K] int32, logp [B, T, K] float32)``: the teacher's
    ``k`` most likely next tokens at every position, the logits in chunks of ``chunk_size``
    positions (only one chunk's [B, C, V] exists at a time; None: all at once)."""

    def fn(params, batch):
        lm = nnx.merge(graphdef, params)
        hidden, _ = batch_lib.run_backbone(lm, batch)

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
      tokenizer: its tokenizer, or the folder to load one from (``check_teacher`` compares it
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
    ) -> list[np.ndarray]:
        """log p_teacher of each completion token given its prompt and the completion's
        earlier tokens: one float32 array per completion (host in, host out).

        Rows are laid out by ``rollout.pack`` (power-of-two length buckets: few compilations),
        their count padded to a multiple of ``num_microbatches``."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
        if any(len(p) < 1 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        rows = -(-len(prompts) // self.num_microbatches) * self.num_microbatches
        packed = rollout.pack(prompts, completions, pad_id=0, batch_size=rows)
        logp = np.asarray(self.batch_logprobs(rollout.to_batch(packed)), np.float32)
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
