"""Prompt templates: R1-Zero, question-only, and the tokenizer's own chat template.

The R1-Zero and question-only texts are package files (``templates/r1_zero.txt``,
``templates/question_only.txt``) with a ``{question}`` placeholder. The R1-Zero template is the
DeepSeek-R1-Zero prompt verbatim and ends right after ``Assistant: <think>``; the question-only
template is the bare question (pair it with ``question_only_reward_fn``, which reads the answer
from the last ``\\boxed{}`` or ``<answer>`` block, or with ``synthetic_reward_fn``).

Substitution is a plain string replace, not ``str.format``: LaTeX questions are full of braces.
"""

from __future__ import annotations

import functools
import importlib.resources
from typing import Any, Literal, get_args

TemplateName = Literal["r1_zero", "question_only", "chat"]

PLACEHOLDER = "{question}"


@functools.cache
def load_template(name: Literal["r1_zero", "question_only"]) -> str:
    """The shipped template text (a final newline in the file is not part of it)."""
    if name not in ("r1_zero", "question_only"):
        raise ValueError(f"template file must be 'r1_zero' or 'question_only', got {name!r}")
    path = importlib.resources.files("jaxrlvr.data") / "templates" / f"{name}.txt"
    text = path.read_text(encoding="utf-8").removesuffix("\n")
    if PLACEHOLDER not in text:
        raise ValueError(f"template {name!r} has no {PLACEHOLDER} placeholder")
    return text


def render_prompt(template: TemplateName, question: str, tokenizer: Any = None) -> str:
    """The prompt text for ``question``.

    Args:
      template: ``r1_zero``, ``question_only`` or ``chat``.
      question: the problem text (inserted verbatim).
      tokenizer: required for ``chat``: a transformers tokenizer with a chat template; the prompt
        is ``apply_chat_template([{"role": "user", ...}], add_generation_prompt=True)``.
    """
    if template not in get_args(TemplateName):
        raise ValueError(f"template must be one of {get_args(TemplateName)}, got {template!r}")
    if template == "chat":
        if tokenizer is None:
            raise ValueError("template 'chat' needs a tokenizer with a chat template")
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
    return load_template(template).replace(PLACEHOLDER, question)


def render_gold(gold_format: str, answer: str, solution: str | None = None) -> str:
    """An SFT target: ``gold_format`` with ``{answer}`` and ``{solution}`` replaced (plain string
    replace, as for prompts).

    Raises:
      ValueError: when ``gold_format`` has ``{solution}`` and the problem has no worked solution.
    """
    if "{solution}" in gold_format:
        if solution is None:
            raise ValueError(
                f"data.gold_format {gold_format!r} uses {{solution}}, but the problem has no "
                "worked solution (only the scratchpad task provides one)"
            )
        gold_format = gold_format.replace("{solution}", solution)
    return gold_format.replace("{answer}", answer)
