"""Teachers for on-policy distillation, chosen per problem by its source or domain (the
Qwen3-Coder-Next pattern: a math teacher and a code teacher distilled into one student).

A teacher is anything with ``name``, ``vocab_size``, ``tokenizer`` (an HF tokenizer, its folder,
or None) and ``completion_logprobs(prompts, completions) -> [float32 array per completion]``:
the local JAX teacher (``algos.teacher.LocalTeacher``) and the vLLM teacher
(``sampling.vllm_teacher.VLLMTeacher``). ``load_teacher`` makes one from a folder or a URL.

``TeacherRegistry`` maps domains to teachers. ``check`` refuses, in one line each and before any
compute, a teacher whose tokenizer differs from the student's, a vocabulary that cannot score the
student's tokens (or differs in size where the full-vocabulary JSD compares logits), and a
problem domain without a teacher. ``completion_logprobs`` groups completions by their domain's
teacher, asks each teacher once, and returns the log-probs in the input order.

Not here: the teachers' passes (``algos.teacher``, ``sampling.vllm_teacher``) and the losses
(``algos.distill``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from jaxrlvr.algos import teacher as local_teacher

TeacherError = local_teacher.TeacherError


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
    return local_teacher.LocalTeacher.load(text, name=name, **kwargs)


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

    def teacher_for(self, domain: str) -> Teacher:
        """The teacher of ``domain`` (or of the default domain)."""
        if domain in self.teachers:
            return self.teachers[domain]
        if self.default is not None:
            return self.teachers[self.default]
        raise TeacherError(
            f"no teacher for domain {domain!r} (teachers: {sorted(self.teachers)}); add one or "
            "set a default"
        )

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
