"""Mathematical answer equivalence: math-verify plus the normalisations MATH-style answers need.

``is_equivalent(pred, gold)`` decides whether a model's extracted answer means the same as the
ground truth. The heavy lifting (LaTeX and plain-expression parsing, sympy comparison of numbers,
expressions, intervals, tuples and sets, ``x = 5`` against ``5``, ``\\%``, ``^\\circ``, ``\\$``,
``\\text{ units}``) is math-verify's. This module adds what math-verify misses and what keeps the
grader safe:

- an exact integer fast path (GSM8K, synthetic tasks, 5,000-digit numbers never reach sympy);
- extra candidate forms: a whole answer wrapped in ``\\text{...}``, thin-space thousands separators
  (``10\\,000``), repeating decimals (``0.\\overline{3}``, ``0.1(6)``), number words where the whole
  answer is one unambiguous number (``five``, ``twenty-five``), and plain unit words after a number
  (``5 dollars``);
- cheap guards: answers longer than ``MAX_ANSWER_CHARS``, exponent towers, huge factorials and
  absurd brace nesting are never handed to sympy (they fall back to exact string comparison), and
  lone surrogate characters are replaced.

Deliberately left out: any timeout. math-verify's own signal-based timeouts are disabled here
(they only work in the main thread); every call from training goes through
``jaxrlvr.rewards.grading.GradingPool``, whose per-call deadline bounds whatever sympy does.
An unparseable gold answer is never equivalent to anything but an identical string.
"""

from __future__ import annotations

import fractions
import functools
import logging
import re

MAX_ANSWER_CHARS = 1000
"""Answers longer than this (after the integer fast path) are scored as not equivalent."""

_MAX_BRACE_DEPTH = 50
_MAX_EXPONENT = 100_000
_MAX_FACTORIAL_DIGITS = 3  # n! with n >= 1000 is refused


class _DropTimeoutDisabledWarning(logging.Filter):
    """math-verify warns once that its timeouts are off; we bound calls with a process pool."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Timeout is disabled" not in record.getMessage()


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_DropTimeoutDisabledWarning())


@functools.cache
def _math_verify():
    """math-verify, imported on first use: integer answers (GSM8K, the synthetic task) never need
    it, and the package imports (the trainer, the GPU check) where it is not installed."""
    import math_verify

    return math_verify


# ----------------------------------------------------------------------------------------------
# Extraction helpers shared by the verifiers and the data loaders.


def last_boxed_content(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed 5``) in ``text``.

    Returns None when there is no box or the last one is never closed.
    """
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (len("\\boxed") if text.startswith("\\boxed", start) else len("\\fbox"))
    if i < len(text) and text[i] == " ":
        # "\boxed 5": the argument runs to the next whitespace or dollar sign.
        match = re.match(r" +([^\s$]+)", text[i:])
        return match.group(1) if match else None
    if i >= len(text) or text[i] != "{":
        return None
    depth = 0
    for j in range(i, len(text)):
        ch = text[j]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None


def gold_to_string(gold: str | int | float) -> str:
    """Ground truth as a string: numbers formatted exactly, ``\\boxed{}`` content taken."""
    if isinstance(gold, bool):
        raise TypeError("ground truth must be str, int or float, not bool")
    if isinstance(gold, int):
        return str(gold)
    if isinstance(gold, float):
        if gold.is_integer():
            return str(int(gold))
        text = repr(gold)
        if "e" in text or "E" in text:
            text = format(gold, "f").rstrip("0")
        return text
    if not isinstance(gold, str):
        raise TypeError(f"ground truth must be str, int or float, got {type(gold).__name__}")
    if "\\boxed" in gold or "\\fbox" in gold:
        boxed = last_boxed_content(gold)
        return boxed if boxed is not None else ""
    return gold


# ----------------------------------------------------------------------------------------------
# Normalisation.


def sanitize(text: str) -> str:
    """Replace lone surrogates and NULs, strip math delimiters and surrounding whitespace."""
    text = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    text = text.replace("\x00", "").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) >= len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : len(text) - len(right)].strip()
            break
    return text.rstrip(".").strip()


_INT_SEPARATORS = re.compile(r"\{,\}|\\,|\\!|\\ |~|\s")


def as_integer(text: str) -> str | None:
    """Canonical sign-and-digits form when ``text`` is a plain integer, else None.

    Accepts thousands separators (``10,000``, ``1{,}000``, ``10\\,000``). Works on strings rather
    than ``int`` so that numbers beyond Python's int-string limit compare exactly.
    """
    text = _INT_SEPARATORS.sub("", text)
    if re.fullmatch(r"[+-]?\d{1,3}(,\d{3})+", text):
        text = text.replace(",", "")
    match = re.fullmatch(r"([+-]?)(\d+)", text)
    if not match:
        return None
    digits = match.group(2).lstrip("0") or "0"
    sign = "-" if match.group(1) == "-" and digits != "0" else ""
    return sign + digits


_UNITS = {
    "zero": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
    "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13, "fourteen": 14,
    "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18, "nineteen": 19,
}  # fmt: skip
_TENS = {
    "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60, "seventy": 70,
    "eighty": 80, "ninety": 90,
}  # fmt: skip
_SCALES = {"thousand": 1_000, "million": 1_000_000, "billion": 1_000_000_000}


def words_to_int(text: str) -> int | None:
    """``"twenty-five"`` -> 25, ``"one hundred and five"`` -> 105; None unless the whole text is a
    number written in English words (so ``"five apples"`` or ``"a few"`` stay None)."""
    words = re.split(r"[\s-]+", text.strip().lower().rstrip("."))
    words = [w for w in words if w and w != "and"]
    if not words or len(words) > 12:
        return None
    total, current, seen = 0, 0, False
    for word in words:
        if word in _UNITS:
            current += _UNITS[word]
        elif word in _TENS:
            current += _TENS[word]
        elif word == "hundred":
            current = max(current, 1) * 100
        elif word in _SCALES:
            total += max(current, 1) * _SCALES[word]
            current = 0
        else:
            return None
        seen = True
    return total + current if seen else None


_REPEATING = re.compile(
    r"([+-]?)(\d*)\.(\d*)(?:\\overline\{(\d+)\}|\\overline(\d)|\\bar\{(\d+)\}|\\dot\{(\d)\}|\((\d+)\))"
)


def repeating_to_fraction(text: str) -> str | None:
    """``0.\\overline{3}`` -> ``\\frac{1}{3}``, ``1.1(6)`` -> ``\\frac{7}{6}``; else None."""
    match = _REPEATING.fullmatch(text.replace(" ", ""))
    if not match:
        return None
    sign, whole, fixed = match.group(1), match.group(2) or "0", match.group(3)
    repeat = next(g for g in match.groups()[3:] if g is not None)
    if len(fixed) + len(repeat) > 50:
        return None
    value = fractions.Fraction(int(whole)) + fractions.Fraction(
        int(fixed + repeat) - int(fixed or "0"), 10 ** len(fixed) * (10 ** len(repeat) - 1)
    )
    if sign == "-":
        value = -value
    if value.denominator == 1:
        return str(value.numerator)
    return f"{'-' if value < 0 else ''}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


_NUMBER = r"[+-]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)"
_UNIT_WORDS = re.compile(rf"({_NUMBER})(?:\s+[A-Za-z]{{2,}}\.?)+(?:\^\{{?[23]\}}?)?")
_TEXT_WRAPPED = re.compile(r"\\(?:text|textbf|textrm|mathrm|mbox)\{([^{}]*)\}")


def candidate_forms(text: str) -> list[str]:
    """The answer and its normalised variants, in order, without duplicates."""
    forms = [text]

    def add(form: str | None) -> None:
        if form is not None and form.strip() and form not in forms:
            forms.append(form.strip())

    current = text.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    current = re.sub(r"(?<=\d)\\,(?=\d{3})", "", current)  # 10\,000
    add(current)
    unwrapped = _TEXT_WRAPPED.fullmatch(current)
    if unwrapped:
        current = unwrapped.group(1).strip()
        add(current)
    add(repeating_to_fraction(current))
    number = words_to_int(current)
    if number is not None:
        add(str(number))
    unit = _UNIT_WORDS.fullmatch(current)
    if unit:
        add(unit.group(1))
    return forms


# ----------------------------------------------------------------------------------------------
# Guards against inputs that make sympy run away.


def _group_end(text: str, i: int) -> int:
    """Index just past the balanced ``{...}`` group opening at ``text[i]`` (or len(text))."""
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j + 1
    return len(text)


def is_explosive(text: str) -> bool:
    """True for answers whose symbolic evaluation could take unbounded time or memory."""
    depth = max_depth = 0
    for ch in text:
        if ch == "{":
            depth += 1
            max_depth = max(max_depth, depth)
        elif ch == "}":
            depth -= 1
    if max_depth > _MAX_BRACE_DEPTH:
        return True
    if re.search(rf"\d{{{_MAX_FACTORIAL_DIGITS + 1},}}\s*!", text):
        return True
    for match in re.finditer(r"\^|\*\*", text):
        i = match.end()
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            end = _group_end(text, i)
            exponent = text[i + 1 : end - 1]
        else:
            number = re.match(r"[+-]?\d+", text[i:])
            end = i + (number.end() if number else 1)
            exponent = text[i:end]
        # A tower a^{b^c} (or a^b^c, right-associative) is what blows up.
        if "^" in exponent or "**" in exponent or re.match(r"\s*(\^|\*\*)", text[end:]):
            return True
        digits = re.sub(r"[\s{}+]", "", exponent)
        if digits.isdigit() and (len(digits) > 6 or int(digits) > _MAX_EXPONENT):
            return True
    return False


# ----------------------------------------------------------------------------------------------
# The equivalence test.


@functools.lru_cache(maxsize=8192)
def _parse(text: str) -> tuple:
    """math-verify's parse of one form, cached: golds repeat across the G samples of a prompt and
    across epochs, and the ANTLR LaTeX parser dominates grading time (math-verify's own cache
    holds 20 entries). Sympy objects are immutable, so sharing them is safe."""
    # parsing_timeout=None: no SIGALRM (the pool bounds the call); see the module docstring.
    return tuple(_math_verify().parse(f"${text}$", parsing_timeout=None))


def clear_parse_cache() -> None:
    """Empty the parse cache (benchmarks that compare a cold in-process run with the pool)."""
    _parse.cache_clear()


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


def is_equivalent(pred: str, gold: str | int | float) -> bool:
    """Whether ``pred`` (an extracted answer) is mathematically equivalent to ``gold``.

    Args:
      pred: the model's answer text, already extracted from the response (no tags).
      gold: the ground truth: a string (may contain ``\\boxed{}``), an int or a float.
    Returns:
      True only when some normalised form of ``pred`` verifies against some normalised form of
      ``gold`` (math-verify with strict variables), or both are the same integer or string.
    """
    if not isinstance(pred, str):
        return False
    pred_s = sanitize(pred)
    gold_s = sanitize(gold_to_string(gold))
    if not pred_s or not gold_s:
        return False
    pred_int, gold_int = as_integer(pred_s), as_integer(gold_s)
    if pred_int is not None and gold_int is not None:
        return pred_int == gold_int
    if len(pred_s) > MAX_ANSWER_CHARS or len(gold_s) > MAX_ANSWER_CHARS:
        return False
    pred_forms, gold_forms = candidate_forms(pred_s), candidate_forms(gold_s)
    if {_squash(f) for f in pred_forms} & {_squash(f) for f in gold_forms}:
        return True
    # After normalisation both may be integers ("five" vs "5", "10\,000" vs 10000).
    pred_ints = {i for i in map(as_integer, pred_forms) if i is not None}
    gold_ints = {i for i in map(as_integer, gold_forms) if i is not None}
    if pred_ints & gold_ints:
        return True
    if any(is_explosive(f) for f in pred_forms + gold_forms):
        return False
    gold_parsed = [p for p in map(_parse, gold_forms) if p]
    if not gold_parsed:
        return False
    for pred_form in pred_forms:
        parsed = _parse(pred_form)
        if parsed and any(
            _math_verify().verify(list(g), list(parsed), timeout_seconds=None) for g in gold_parsed
        ):
            return True
    return False
