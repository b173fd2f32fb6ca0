"""Decontamination: find training problems that overlap an evaluation problem.

Two detectors, both on the same normalised token sequence (``tokens``):

- **exact**: the training problem's normalised text equals an evaluation problem's.
- **n-gram**: the two share at least ``min_shared`` contiguous ``n``-token sequences (default 13,
  the GPT-3 report's n, arXiv 2005.14165 appendix C). An n-gram found in more than
  ``max_ngram_docs`` evaluation problems is boilerplate ("express your answer as a common
  fraction ...") and is not counted, as GPT-3 left out frequent n-grams. A text shorter than ``n``
  tokens has no n-gram: only the exact detector sees it (a short problem that is a substring of
  a longer one, "13 + 7 =" in "3 + 13 + 7 =", is a different problem).

Normalisation (``normalize``): Unicode NFKC and lower case; LaTeX spacing and text commands
(``\\left``, ``\\right``, ``\\,``, ``\\!``, ``\\text``, ``\\mathrm``, ...) removed, ``\\dfrac`` and
``\\tfrac`` read as ``\\frac``, ``$`` delimiters and braces dropped; numbers canonical: thousands
separators removed ("12,500", "12{,}500" -> "12500"), leading zeros and a decimal's trailing zeros
dropped ("3.50" -> "3.5", "2.0" -> "2", ".5" -> "0.5"); then the text is split into words,
numbers, LaTeX command names and single symbols (``+ - * / = < > ^ ( ) [ ] | ! %``), sentence
punctuation (``. , ; : ? " '``) and whitespace dropped.

The index is a Python dict from n-gram (a tuple of tokens) to the evaluation problems holding
it: exact, no false matches from hash collisions, and fast enough that MATH's 12,500 training
problems against three benchmarks take about a second (docs/curation.md has the measurement).
datasketch's MinHash LSH (the library for near-duplicate search) answers a different question,
an estimated Jaccard similarity above a threshold, so it is not used here.

Not here: reading files (``curation``) and semantic paraphrases (rewording, translation), which
no n-gram rule finds.
"""

from __future__ import annotations

import dataclasses
import re
import unicodedata
from collections.abc import Mapping, Sequence
from typing import Literal

MatchRule = Literal["exact", "ngram"]

# LaTeX commands that change spacing or fonts only: removed (their braces' content stays).
_DROP_COMMANDS = re.compile(
    r"\\(?:left|right|big|Big|bigg|Bigg|displaystyle|textstyle|text|textbf|textit|mathrm|"
    r"mathbf|mathit|mbox|operatorname|quad|qquad)(?![a-z])|\\[,!;: ]"
)
_FRAC = re.compile(r"\\[dt]frac(?![a-z])")
_GROUPED_COMMA = re.compile(r"\{,\}")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_NUMBER = re.compile(r"(?<![\w.])(\d*\.\d+|\d+)(?![\w])")
_TOKEN = re.compile(r"\\[a-z]+|\d+(?:\.\d+)?|[^\W\d_]+|[+\-*/=<>^()\[\]|!%]")


def _canonical_number(match: re.Match) -> str:
    text = match.group(1)
    if "." in text:
        whole, frac = text.split(".", 1)
        frac = frac.rstrip("0")
        whole = whole.lstrip("0") or "0"
        return f"{whole}.{frac}" if frac else whole
    return text.lstrip("0") or "0"


def normalize(text: str) -> str:
    """The normalised text (module docstring): its tokens joined by single spaces."""
    return " ".join(tokens(text))


def tokens(text: str) -> list[str]:
    """The normalised tokens of ``text`` (module docstring)."""
    text = unicodedata.normalize("NFKC", text).lower()
    text = _DROP_COMMANDS.sub(" ", text)
    text = _FRAC.sub(r"\\frac", text)
    text = _GROUPED_COMMA.sub(",", text)
    text = _THOUSANDS.sub("", text)
    text = _NUMBER.sub(_canonical_number, text)
    return _TOKEN.findall(text)


def ngrams(toks: Sequence[str], n: int) -> set[tuple[str, ...]]:
    """The distinct contiguous ``n``-token sequences of ``toks`` (none when it is shorter)."""
    return {tuple(toks[i : i + n]) for i in range(len(toks) - n + 1)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class EvalSetSpec:
    """An evaluation set to decontaminate against: a local jsonl / json / parquet file, the
    column holding the problem text, and the name the report gives it (default: the file's
    stem)."""

    path: str
    question_field: str = "problem"
    name: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class DecontamConfig:
    """Decontamination against which sets, and the overlap rule (module docstring).

    Attributes:
      enabled: run it (``jaxrlvr curate``).
      held_out: check against the config's own held-out split(s) (``data.eval``, a generated
        task's held-out problems, each mixture source's).
      against: more evaluation sets: benchmark files (``EvalSetSpec``).
      n: tokens per n-gram (13: GPT-3's).
      min_shared: a training problem overlaps an evaluation problem when they share at least this
        many (counted) n-grams.
      max_ngram_docs: n-grams held by more than this many evaluation problems are not counted.
      exact: also flag exact matches of the normalised text.
    """

    enabled: bool = True
    held_out: bool = True
    against: tuple[EvalSetSpec, ...] = ()
    n: int = 13
    min_shared: int = 1
    max_ngram_docs: int = 10
    exact: bool = True

    def __post_init__(self):
        object.__setattr__(self, "against", tuple(self.against))
        for name in ("n", "min_shared", "max_ngram_docs"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"decontam.{name}={value!r}: expected an int >= 1")


@dataclasses.dataclass(frozen=True)
class Match:
    """A training text's overlap: the rule that found it, the evaluation set and the index of the
    evaluation problem in it, and the n-grams they share (0 for an exact match)."""

    rule: MatchRule
    eval_set: str
    eval_index: int
    shared: int


class EvalIndex:
    """The evaluation problems' normalised texts and n-grams, to look training texts up in.

    Args:
      sets: evaluation set name -> its problems' texts.
      cfg: the overlap rule.
    """

    def __init__(self, sets: Mapping[str, Sequence[str]], cfg: DecontamConfig | None = None):
        self.cfg = cfg or DecontamConfig()
        self.exact: dict[str, tuple[str, int]] = {}
        postings: dict[tuple[str, ...], list[tuple[str, int]]] = {}
        for name, texts in sets.items():
            for i, text in enumerate(texts):
                toks = tokens(text)
                self.exact.setdefault(" ".join(toks), (name, i))
                for gram in ngrams(toks, self.cfg.n):
                    postings.setdefault(gram, []).append((name, i))
        limit = self.cfg.max_ngram_docs
        self.ngram_index = {g: docs for g, docs in postings.items() if len(docs) <= limit}
        self.size = sum(len(texts) for texts in sets.values())

    def match(self, text: str) -> Match | None:
        """The first overlap of ``text`` with an evaluation problem: an exact match, else the
        evaluation problem sharing the most counted n-grams (at least ``min_shared``), else
        None."""
        toks = tokens(text)
        if self.cfg.exact and (hit := self.exact.get(" ".join(toks))) is not None:
            return Match("exact", hit[0], hit[1], 0)
        counts: dict[tuple[str, int], int] = {}
        for gram in ngrams(toks, self.cfg.n):
            for doc in self.ngram_index.get(gram, ()):
                counts[doc] = counts.get(doc, 0) + 1
        if not counts:
            return None
        doc, shared = max(counts.items(), key=lambda kv: (kv[1], -kv[0][1]))
        if shared < self.cfg.min_shared:
            return None
        return Match("ngram", doc[0], doc[1], shared)


def find_overlaps(train: Sequence[str], index: EvalIndex, progress=None) -> list[Match | None]:
    """``index.match`` of every training text, in order; ``progress``: a callable given the
    number of texts done so far after each (a progress bar's update), or None."""
    out = []
    for text in train:
        out.append(index.match(text))
        if progress is not None:
            progress(1)
    return out
