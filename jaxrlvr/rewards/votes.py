"""Vote keys for majority voting (maj@k): which of a problem's samples give the same answer.

``vote_key(reward_name, response, score)`` is a sample's class as a string, or None when the
sample gives no answer (it abstains). The task's own equivalence decides:

- math (``r1_zero``, ``question_only``, ``gsm8k``, ``synthetic``): every sample the grader scored
  correct is in the gold answer's class (``"=gold"``: they are all equivalent to the truth by the
  grader's own ``math_equiv.is_equivalent`` or exact-number rule); a wrong sample's class is its
  extracted answer in a normal form (an integer as digits, a number as a decimal, else the
  answer with ``\\dfrac``/spacing normalised and whitespace removed);
- code (``code``): by test outcome as the grader reports it: a program that passes every test is
  in the ``"=gold"`` class, one that runs but fails is in the class of its pass fraction
  (``"tests=0.5"``), and a response without code abstains.

Left out: symbolic equivalence between two wrong answers (``1/2`` and ``0.5`` are two wrong
classes), which would need sympy without the grading pool's deadline; and per-test outcome
patterns of code (the grader returns the pass fraction only).
"""

from __future__ import annotations

import decimal
import re

from jaxrlvr.rewards import math_equiv, verifiers

GOLD = "=gold"


def _math_form(answer: str | None) -> str | None:
    if answer is None:
        return None
    text = math_equiv.sanitize(answer)
    if not text.strip():
        return None
    forms = math_equiv.candidate_forms(text)
    for form in forms:
        whole = math_equiv.as_integer(form)
        if whole is not None:
            return whole
    return re.sub(r"\s+", "", forms[-1])


def _gsm8k_form(response: str) -> str | None:
    found = verifiers.last_number(response)
    if found is None:
        return None
    try:
        number = decimal.Decimal(found.replace(",", "")).normalize()
    except decimal.InvalidOperation:
        return found
    return format(number, "f")


def vote_key(reward_name: str, response: str, score: dict[str, float]) -> str | None:
    """The sample's class for maj@k (the module docstring); ``score``: its grader scores."""
    if score.get("answer_reward", 0.0) >= 1.0:
        return GOLD
    if reward_name == "code":
        return f"tests={score['answer_reward']:.6g}" if score.get("format_reward") else None
    if reward_name == "r1_zero":
        return _math_form(verifiers.extract_r1_zero_answer(response)[1])
    if reward_name == "question_only":
        return _math_form(verifiers.extract_question_only_answer(response))
    if reward_name == "gsm8k":
        return _gsm8k_form(response)
    if reward_name == "synthetic":
        return _math_form(verifiers.extract_synthetic_answer(response))
    raise ValueError(f"vote_key: unknown reward {reward_name!r}")
