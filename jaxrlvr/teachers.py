"""Teachers for on-policy distillation, chosen per problem by its source or domain (the
Qwen3-Coder-Next pattern: a math teacher and a code teacher distilled into one student).

A teacher is anything with ``name``, ``vocab_size``, ``tokenizer`` (an HF tokenizer, its folder,
or None) and ``completion_logprobs(prompts, completions) -> [float32 array per completion]``:
the local JAX teacher (``LocalTeacher``, here) and the vLLM teacher
(``sampling.vllm_teacher.VLLMTeacher``). ``load_teacher`` makes one from a folder or a URL.

``LocalTeacher`` is a frozen decoder beside the student: any checkpoint or Hugging Face folder
``model.load_hf`` loads (any size or family the decoder serves), with the student's tokenizer.
Its log-prob pass is the student's own (``engine.make_logprob_fn``: the same backbone call,
packing and shared-prompt fields, position chunks of the head, microbatches) run with the
teacher's graph definition and parameters, jitted with the parameters as arguments (a program
that closed over them would hold them as constants). On a mesh its parameters are placed by the
model's sharding rules, beside the student's. ``batch_logprobs(batch)`` is the device pass on a
training batch (the rollouts' ``teacher_logp``, ``algos.distill``); ``topk(batch, k)`` the
teacher's k most likely next tokens at every position (the JSD over the teacher's top-k);
``completion_logprobs`` the host interface it shares with the vLLM teacher.

``TeacherRegistry`` maps domains to teachers. ``check`` refuses, in one line each and before any
compute, a teacher whose tokenizer differs from the student's, a vocabulary that cannot score the
student's tokens (or differs in size where the full-vocabulary JSD compares logits), and a
problem domain without a teacher. ``completion_logprobs`` groups completions by their domain's
teacher, asks each teacher once, and returns the log-probs in the input order.

Not here: the vLLM teacher (``sampling.vllm_teacher``) and the losses and the record
(``algos.distill``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

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


class Teacher(Protocol):
    name: str
    vocab_size: int | None
    tokenizer: Any

    def completion_logprobs(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[np.ndarray]: ...


def load_teacher(source: str | os.PathLike, *, name: str | None = None, **kwargs) -> Teacher:
    """A teacher from ``source``: an ``http(s)://`` URL is a running vLLM server
    (``VLLMTeacher``), anything else a checkpoint / HF folder (``LocalTeacher.load``; ``kwargs``
    such as ``mesh``, ``dtype``, ``chunk_size`` go to it).

    Raises:
      TeacherError: the folder cannot be loaded or the server cannot be reached (one line).
    """
    text = os.fspath(source)
    if text.startswith(("http://", "https://")):
        from jaxrlvr.sampling import vllm_sampler, vllm_teacher

        try:
            return vllm_teacher.VLLMTeacher(text, name=name, **kwargs)
        except vllm_sampler.VLLMError as e:
            raise TeacherError(str(e)) from None
    return LocalTeacher.load(text, name=name, **kwargs)


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


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    if tokenizer is None:
        return None
    if isinstance(tokenizer, str | os.PathLike):
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(os.fspath(tokenizer))
    return dict(tokenizer.get_vocab())


def check_teacher(
    teacher: Teacher,
    *,
    student_vocab_size: int,
    student_tokenizer: Any = None,
    full_vocab: bool = False,
) -> None:
    """Raise ``TeacherError`` (one line) unless ``teacher`` can score the student's tokens.

    The tokenizers (when both are known) must map the same strings to the same ids; the
    teacher's vocabulary must hold every id the student can emit (V_teacher >= V_student), and
    equal it in size when
    ``full_vocab`` (the JSD over the full vocabulary compares the two logit vectors entry by
    entry). Sizes may otherwise differ by padding rows (Qwen2.5's 7B pads its embedding to
    152064, the 1.5B to 151936, with one tokenizer).
    """
    tv = teacher.vocab_size
    if tv is not None and full_vocab and tv != student_vocab_size:
        raise TeacherError(
            f"teacher {teacher.name!r}: vocabulary size {tv} differs from the student's "
            f"{student_vocab_size}; the full-vocabulary JSD needs equal sizes"
        )
    if tv is not None and tv < student_vocab_size:
        raise TeacherError(
            f"teacher {teacher.name!r}: vocabulary size {tv} cannot score the student's token "
            f"ids up to {student_vocab_size - 1}"
        )
    student = _vocab(student_tokenizer)
    theirs = _vocab(teacher.tokenizer)
    if student is not None and theirs is not None and student != theirs:
        differ = sorted(set(student.items()) ^ set(theirs.items()))
        example = differ[0] if differ else None
        raise TeacherError(
            f"teacher {teacher.name!r}: its tokenizer differs from the student's "
            f"({len(theirs)} vs {len(student)} entries, e.g. {example!r}); on-policy "
            "distillation scores the student's token ids, so both need one tokenizer"
        )


def device_scores(
    groups: Sequence[tuple[LocalTeacher, Sequence[int]]],
    batch: batch_lib.Batch,
    *,
    top_k: int | None = None,
) -> dict[str, jax.Array]:
    """Several local teachers' fields of a placed training batch, each token from the teacher
    of its domain (``batch.domain_ids``, ``TeacherRegistry.index``): ``teacher_logp`` [B, T]
    (``batch_logprobs``), or with ``top_k`` ``teacher_topk_ids`` / ``teacher_topk_logp``
    [B, T, K] (``topk``). ``groups``: (teacher, the domain indices it serves), as
    ``TeacherRegistry.device_groups`` gives them. Each teacher's pass covers the whole batch
    and a select keeps its domains' tokens (a per-domain sub-batch would cost a second packing
    and shapes that change every step)."""
    values = None
    for teacher, members in groups:
        got = teacher.topk(batch, top_k) if top_k else (teacher.batch_logprobs(batch),)
        if values is None:  # every token first takes the first teacher's values
            values = got
            continue
        mine = jnp.isin(batch.domain_ids, jnp.asarray(members, jnp.int32))
        values = tuple(
            jnp.where(mine.reshape(mine.shape + (1,) * (v.ndim - 2)), v, old)
            for v, old in zip(got, values, strict=True)
        )
    if top_k:
        return {"teacher_topk_ids": values[0], "teacher_topk_logp": values[1]}
    return {"teacher_logp": values[0]}


class TeacherRegistry:
    """Domain -> teacher (module docstring).

    Args:
      teachers: domain name -> teacher; one teacher may serve several domains.
      default: the domain whose teacher serves problems of any domain not listed (None: such a
        problem is an error).
    """

    def __init__(self, teachers: Mapping[str, Teacher], *, default: str | None = None):
        if not teachers:
            raise TeacherError("a teacher registry needs at least one domain -> teacher")
        if default is not None and default not in teachers:
            raise TeacherError(
                f"default domain {default!r} has no teacher (have {sorted(teachers)})"
            )
        self.teachers = dict(teachers)
        self.default = default

    @property
    def names(self) -> tuple[str, ...]:
        """The registry's domains, sorted: ``index`` numbers them (``Batch.domain_ids``)."""
        return tuple(sorted(self.teachers))

    def routed(self, domain: str) -> str:
        """The registry domain that serves a problem of ``domain`` (itself, or the default)."""
        if domain in self.teachers:
            return domain
        if self.default is not None:
            return self.default
        raise TeacherError(
            f"no teacher for domain {domain!r} (teachers: {sorted(self.teachers)}); add one or "
            "set a default"
        )

    def index(self, domain: str) -> int:
        """The position in ``names`` of the registry domain that serves ``domain``."""
        return self.names.index(self.routed(domain))

    @property
    def device_groups(self) -> list[tuple[LocalTeacher, tuple[int, ...]]] | None:
        """(local teacher, the ``index``es of the domains it serves) per distinct teacher when
        every teacher is local (their passes then run on the placed training batch,
        ``Learner.prepare``, in a one-process job), else None (host scoring)."""
        groups: dict[int, tuple[Teacher, list[int]]] = {}
        for i, name in enumerate(self.names):
            teacher = self.teachers[name]
            groups.setdefault(id(teacher), (teacher, []))[1].append(i)
        if not all(isinstance(t, LocalTeacher) for t, _ in groups.values()):
            return None
        return [(t, tuple(idx)) for t, idx in groups.values()]

    def teacher_for(self, domain: str) -> Teacher:
        """The teacher of ``domain`` (or of the default domain)."""
        return self.teachers[self.routed(domain)]

    def check(
        self,
        domains: Sequence[str],
        *,
        student_vocab_size: int,
        student_tokenizer: Any = None,
        full_vocab: bool = False,
    ) -> None:
        """Before any compute: every domain in ``domains`` (the run's problems') has a teacher,
        and every teacher passes ``check_teacher``. Raises ``TeacherError`` (one line)."""
        for domain in dict.fromkeys(domains):
            self.teacher_for(domain)
        seen: set[int] = set()
        for teacher in self.teachers.values():
            if id(teacher) in seen:
                continue
            seen.add(id(teacher))
            check_teacher(
                teacher,
                student_vocab_size=student_vocab_size,
                student_tokenizer=student_tokenizer,
                full_vocab=full_vocab,
            )

    def route(self, domains: Sequence[str]) -> list[tuple[Teacher, list[int]]]:
        """(teacher, indices of the problems it scores) per teacher, in first-use order."""
        groups: dict[int, tuple[Teacher, list[int]]] = {}
        for i, domain in enumerate(domains):
            teacher = self.teacher_for(domain)
            groups.setdefault(id(teacher), (teacher, []))[1].append(i)
        return list(groups.values())

    def completion_logprobs(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        domains: Sequence[str],
    ) -> list[np.ndarray]:
        """Each completion's teacher log-probs, from the teacher of its domain, in input order."""
        if not len(prompts) == len(completions) == len(domains):
            raise ValueError(
                f"{len(prompts)} prompts, {len(completions)} completions, {len(domains)} domains"
            )
        out: list[np.ndarray | None] = [None] * len(prompts)
        for teacher, idx in self.route(domains):
            got = teacher.completion_logprobs(
                [prompts[i] for i in idx], [completions[i] for i in idx]
            )
            for i, lp in zip(idx, got, strict=True):
                out[i] = lp
        return out  # type: ignore[return-value]

    def completion_topk(
        self,
        prompts: Sequence[Sequence[int]],
        completions: Sequence[Sequence[int]],
        domains: Sequence[str],
        k: int,
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each completion's (ids [L, k], log-probs [L, k]) of its domain's teacher's ``k`` most
        likely tokens (``VLLMTeacher.completion_topk``), in input order."""
        out: list[tuple[np.ndarray, np.ndarray] | None] = [None] * len(prompts)
        for teacher, idx in self.route(domains):
            if not hasattr(teacher, "completion_topk"):
                raise TeacherError(
                    f"teacher {teacher.name!r}: its top-k is computed on device only "
                    "(a local teacher in a one-process job); rl.distill.signal=jsd here needs "
                    "vLLM teachers"
                )
            got = teacher.completion_topk(
                [prompts[i] for i in idx], [completions[i] for i in idx], k
            )
            for i, pair in zip(idx, got, strict=True):
                out[i] = pair
        return out  # type: ignore[return-value]
