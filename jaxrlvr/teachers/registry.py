"""Teachers chosen per problem by its domain (the Qwen3-Coder-Next pattern: a math teacher and a
code teacher distilled into one student), loaded and checked once.

A teacher is anything with ``name``, ``vocab_size``, ``tokenizer`` (an HF tokenizer, its folder,
or None) and ``completion_logprobs(prompts, completions) -> [float32 array per completion]``:
the local JAX teacher (``teachers.local.LocalTeacher``) and the vLLM teacher
(``teachers.vllm.VLLMTeacher``). ``load_teacher`` makes one from a folder or a URL;
``load_registry`` all of a distillation config's, each distinct source once.

``TeacherRegistry`` maps domains to teachers. ``check`` refuses, in one line each and before any
compute, a teacher whose tokenizer differs from the student's, a vocabulary that cannot score the
student's tokens, and a problem domain without a teacher (``missing_domain``: the one rule, also
preflight's on the configured domains). ``completion_logprobs`` groups completions by their
domain's teacher, asks each teacher once, and returns the log-probs in the input order.
``device_scores`` runs the local teachers on a placed training batch; ``metrics`` are the
teachers' per-domain figures of a laid-out batch, whichever way it was scored.

Not here: the losses and the record (``algos.distill``), when scoring runs (the rollout pass
``passes.teacher_scores``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from jaxrlvr.algos import batch as batch_lib
from jaxrlvr.teachers.local import LocalTeacher, TeacherError

# Each label's problem domain, an index into ``TeacherRegistry.names`` (``batch.register_field``;
# the pass ``passes.teacher_scores`` fills it): which local teacher scores it
# (``device_scores``) and its metrics' domain (``metrics``); read by no update (``select_fields``
# drops it).
DOMAIN_IDS = batch_lib.register_field("domain_ids", "bt", "int")


class Teacher(Protocol):
    name: str
    vocab_size: int | None
    tokenizer: Any

    def completion_logprobs(
        self, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]
    ) -> list[np.ndarray]: ...


def is_url(source: str) -> bool:
    """Whether a teacher source is a vLLM server (else a folder)."""
    return source.startswith(("http://", "https://"))


def load_teacher(source: str | os.PathLike, *, name: str | None = None, **kwargs) -> Teacher:
    """A teacher from ``source``: an ``http(s)://`` URL is a running vLLM server
    (``VLLMTeacher``), anything else a checkpoint / HF folder (``LocalTeacher.load``; ``kwargs``
    such as ``mesh``, ``dtype``, ``chunk_size`` go to it).

    Raises:
      TeacherError: the folder cannot be loaded or the server cannot be reached (one line).
    """
    text = os.fspath(source)
    if is_url(text):
        from jaxrlvr.sampling import vllm_sampler
        from jaxrlvr.teachers import vllm

        try:
            return vllm.VLLMTeacher(text, name=name, **kwargs)
        except vllm_sampler.VLLMError as e:
            raise TeacherError(str(e)) from None
    return LocalTeacher.load(text, name=name, **kwargs)


def missing_domain(domains: Sequence[str], sources: Mapping[str, str], default: bool) -> str | None:
    """The first of ``domains`` that no teacher serves (``sources``: domain -> teacher; with a
    ``default`` teacher every domain is served), else None: the one rule of which problems a
    registry can score."""
    if default:
        return None
    return next((d for d in dict.fromkeys(domains) if d not in sources), None)


def load_registry(
    distill: Any,
    *,
    domains: Sequence[str],
    student_vocab_size: int,
    student_tokenizer: Any = None,
    mesh: Any = None,
    chunk_size: int | None = None,
) -> TeacherRegistry:
    """The ``TeacherRegistry`` of a distillation config (``algos.distill.DistillConfig``:
    ``teacher``, ``teachers``, ``teacher_dtype``): the problems' ``domains`` checked first (a
    domain without a teacher is refused before any teacher loads), each distinct source loaded
    once (a folder on ``mesh`` in ``teacher_dtype`` with the log-prob pass's ``chunk_size``, or
    a vLLM URL), then every teacher checked against the student (``TeacherRegistry.check``).

    Raises:
      TeacherError: one line per refusal.
    """
    sources = distill.sources
    domain = missing_domain(domains, sources, distill.teacher is not None)
    if domain is not None:
        raise TeacherError(
            f"no teacher for domain {domain!r} (rl.distill.teachers: {sorted(sources)}); add "
            "one or set rl.distill.teacher"
        )
    local = [s for s in sources.values() if not is_url(s)]
    if distill.signal == "jsd" and local and jax.process_count() > 1:
        raise TeacherError(
            f"rl.distill.signal=jsd with the local teacher {local[0]!r} in a multi-process job: "
            "a local teacher's top-k is computed on device in one-process jobs only; serve it "
            "with vLLM (an http:// teacher) or run one process"
        )
    loaded: dict[str, Teacher] = {}
    for source in dict.fromkeys(sources.values()):
        kwargs = {}
        if not is_url(source):
            kwargs = {"mesh": mesh, "dtype": distill.teacher_dtype, "chunk_size": chunk_size}
        loaded[source] = load_teacher(source, **kwargs)
    registry = TeacherRegistry(
        {d: loaded[src] for d, src in sources.items()},
        default="default" if distill.teacher is not None else None,
    )
    registry.check(
        domains, student_vocab_size=student_vocab_size, student_tokenizer=student_tokenizer
    )
    return registry


def metrics(batch: batch_lib.Batch, names: Sequence[str], *, jsd: bool) -> dict[str, float]:
    """The teachers' figures of a laid-out batch (host NumPy or placed on device alike), per
    registry domain (``names``, indexed by ``batch.domain_ids``) over its loss tokens: with
    ``teacher_logp``, ``distill/<domain>/reverse_kl`` (k1: the mean of the sampler's log-prob
    minus the teacher's) and ``distill/<domain>/teacher_top1_lb`` (the share of tokens whose
    teacher probability exceeds 1/2: certainly the teacher's argmax, a lower bound of the
    agreement); with the top-k (``jsd``), ``distill/<domain>/agreement`` (the share of sampled
    tokens equal to the teacher's most likely token). A domain without loss tokens: none."""
    mask = jnp.asarray(batch.loss_mask) != 0
    ids = jnp.asarray(batch.domain_ids)
    if jsd:
        hits = {"agreement": jnp.asarray(batch.labels) == batch.teacher_topk_ids[..., 0]}
    else:
        teacher = jnp.asarray(batch.teacher_logp)
        hits = {"teacher_top1_lb": teacher > np.log(0.5)}
    sums = {}
    for j, domain in enumerate(names):
        m = mask & (ids == j)
        sums[domain] = {"n": m.sum(), **{k: (m & h).sum() for k, h in hits.items()}}
        if not jsd:
            diff = jnp.asarray(batch.sampler_logp) - teacher
            sums[domain]["reverse_kl"] = jnp.where(m, diff, 0.0).sum()
    out = {}
    for domain, s in jax.device_get(sums).items():
        n = float(s.pop("n"))
        if n:
            out.update({f"distill/{domain}/{k}": float(v) / n for k, v in s.items()})
    return out


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
        if missing_domain([domain], self.teachers, False) is None:
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
