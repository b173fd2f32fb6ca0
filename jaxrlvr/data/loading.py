"""Load MATH-style and GSM8K-style problems from local jsonl/parquet files or a hub dataset.

Each row becomes a ``Problem(question, answer, id, domain=)`` (the row's ``domain`` column, else
``DataConfig.domain``). The answer comes from ``answer_field`` when that is present and
non-empty (GSM8K's ``#### N`` tail or a ``\\boxed{}`` inside it is taken), otherwise from the
last ``\\boxed{}`` of ``solution_field``. Rows without a usable question or
answer are dropped and counted by reason in ``LoadStats`` (or raise with the row index, when
``on_bad_row="raise"``): they are never handed to training where they could score as correct.

Local jsonl files are read line by line (``read_json_rows``: a malformed line costs its row and
is named by its line number); parquet files and hub datasets go through ``datasets``. Left out:
streaming, and any filtering by difficulty (see ``iterators`` for curricula).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Literal, get_args

from jaxrlvr.rewards import math_equiv

DataFormat = Literal["auto", "jsonl", "parquet", "hub"]
OnBadRow = Literal["skip", "raise"]

_SUFFIX_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


@dataclasses.dataclass(frozen=True)
class Problem:
    """One prompt-worthy problem with its verifiable ground truth.

    ``solution``: a worked solution when the task has one (the scratchpad task's written work,
    which an SFT warm start's ``data.gold_format`` inserts at ``{solution}``); None otherwise.
    ``domain``: the problem's task or source ("math", "code"): a data file's ``domain`` column,
    else the dataset's configured name (``data.domain``, a mixture's ``data.mixture[i].domain``);
    None: no domain of its own (on-policy distillation routes it to the "default" teacher).
    """

    question: str
    answer: str
    id: str
    solution: str | None = None
    domain: str | None = None


@dataclasses.dataclass(frozen=True)
class LoadStats:
    """Rows kept and dropped by ``load_problems``; ``reasons`` counts drops by cause."""

    kept: int
    dropped: int
    reasons: dict[str, int]


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where the problems are and which fields hold what.

    Attributes:
      path: a local ``.jsonl``/``.json``/``.parquet`` file, or a hub dataset name.
      format: ``auto`` (from the suffix; a path that does not exist locally means ``hub``),
        ``jsonl``, ``parquet`` or ``hub``.
      split: the split to read (hub datasets; local files always have one ``train`` split).
      hub_config: the hub dataset's configuration name, if it has several.
      question_field: column with the problem text.
      answer_field: column with the final answer (None: always use the solution).
      solution_field: column with a worked solution whose last ``\\boxed{}`` is the answer.
      id_field: column with a stable id (None: ``<file stem>-<row index>``).
      domain_field: column with each row's domain (absent or empty in a row: ``domain``).
      domain: the domain of rows without one of their own (None: no domain).
      on_bad_row: ``skip`` (drop and count) or ``raise`` (ValueError naming the row index).
      limit: keep at most this many problems (None: all).
      key: the config key that named the file, for error messages (e.g. ``data.train``).
    """

    path: str
    format: DataFormat = "auto"
    split: str = "train"
    hub_config: str | None = None
    question_field: str = "problem"
    answer_field: str | None = "answer"
    solution_field: str | None = "solution"
    id_field: str | None = None
    domain_field: str | None = "domain"
    domain: str | None = None
    on_bad_row: OnBadRow = "skip"
    limit: int | None = None
    key: str = "data file"

    def __post_init__(self):
        if self.format not in get_args(DataFormat):
            raise ValueError(
                f"DataConfig.format must be one of {get_args(DataFormat)}, got {self.format!r}"
            )
        if self.on_bad_row not in get_args(OnBadRow):
            raise ValueError(
                f"DataConfig.on_bad_row must be one of {get_args(OnBadRow)}, "
                f"got {self.on_bad_row!r}"
            )
        if self.answer_field is None and self.solution_field is None:
            raise ValueError("DataConfig needs answer_field or solution_field (both are None)")
        if self.limit is not None and self.limit < 0:
            raise ValueError(f"DataConfig.limit must be >= 0, got {self.limit}")

    @classmethod
    def math(cls, path: str, **overrides: Any) -> DataConfig:
        """MATH layout: ``problem``, ``solution`` (boxed), optional ``answer``."""
        return cls(path=path, **overrides)

    @classmethod
    def gsm8k(cls, path: str, **overrides: Any) -> DataConfig:
        """GSM8K layout: ``question`` and ``answer`` ending in ``#### N``."""
        fields = {"question_field": "question", "answer_field": "answer", "solution_field": None}
        return cls(path=path, **{**fields, **overrides})

    @property
    def resolved_format(self) -> Literal["jsonl", "parquet", "hub"]:
        """The format actually used: ``format`` unless it is ``auto``."""
        if self.format != "auto":
            return self.format
        suffix = os.path.splitext(self.path)[1].lower()
        if os.path.exists(self.path):
            if suffix not in _SUFFIX_FORMATS:
                raise ValueError(
                    f"DataConfig.path {self.path!r}: cannot infer the format from suffix "
                    f"{suffix!r}; set format to one of {get_args(DataFormat)[1:]}"
                )
            return _SUFFIX_FORMATS[suffix]
        return "hub"


def extract_answer(value: Any, *, from_solution: bool) -> str | None:
    """The ground-truth string of one field value, or None when it holds no usable answer.

    Answer fields: ``#### N`` -> ``N`` (commas removed), ``\\boxed{x}`` -> ``x``, numbers -> text.
    Solution fields: the last ``\\boxed{}`` only.
    """
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return math_equiv.gold_to_string(value)
    if not isinstance(value, str):
        return None
    if from_solution:
        answer = math_equiv.last_boxed_content(value)
    elif "####" in value:
        answer = value.rsplit("####", 1)[1].strip().replace(",", "")
    elif "\\boxed" in value or "\\fbox" in value:
        answer = math_equiv.last_boxed_content(value)
    else:
        answer = value
    if answer is None:
        return None
    answer = answer.strip()
    return answer or None


class DataFileError(ValueError):
    """A data file cannot be used as it is; the message is one line naming the key, the file and
    the line."""


def read_json_rows(
    path: str, *, on_bad_row: OnBadRow = "skip", key: str = "data file"
) -> tuple[list[dict[str, Any]], list[int]]:
    """The rows of a jsonl file (or of a .json file holding one array), and the 1-based line
    numbers of the lines skipped as not a JSON object (``on_bad_row="skip"``).

    Read line by line so that one malformed line costs that row, not the file (``datasets``'
    json builder fails on the whole file), and so that errors name the line.

    Raises:
      DataFileError: the file has no rows; or, with ``on_bad_row="raise"``, the first line that
        is not a JSON object.
    """
    import json

    where = f"{key}={path!r}"
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise DataFileError(f"{where}: cannot read ({e})") from None
    if path.endswith(".json") and text.lstrip().startswith("["):
        try:
            items = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataFileError(f"{where}: not valid JSON ({e})") from None
        lines = [(i + 1, item, None) for i, item in enumerate(items)]  # array index as "line"
    else:
        lines = []
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                lines.append((number, json.loads(line), None))
            except json.JSONDecodeError as e:
                lines.append((number, None, e.msg))
    rows, skipped = [], []
    for number, item, error in lines:
        if isinstance(item, dict):
            rows.append(item)
            continue
        if on_bad_row == "raise":
            what = f"not JSON ({error})" if error else "not a JSON object"
            raise DataFileError(f"{where}: line {number} is {what} (data.on_bad_row=raise)")
        skipped.append(number)
    if not rows:
        detail = f" ({len(skipped)} malformed lines)" if skipped else " (empty file)"
        raise DataFileError(f"{where}: no rows{detail}")
    return rows, skipped


def read_rows(path: str, *, on_bad_row: OnBadRow = "skip", key: str = "data file") -> list[dict]:
    """The rows of a local jsonl / json (``read_json_rows``) or parquet file, or of a hub
    dataset's train split, as dicts: for files of pairs (SFT, preference) rather than problems."""
    if path.endswith((".jsonl", ".json")):
        return read_json_rows(path, on_bad_row=on_bad_row, key=key)[0]
    import datasets

    if path.endswith(".parquet"):
        return list(datasets.load_dataset("parquet", data_files=path, split="train"))
    return list(datasets.load_dataset(path, split="train"))


def load_rows(cfg: DataConfig) -> tuple[Any, set[str], int]:
    """(the rows, the columns, the malformed lines skipped) of the data: jsonl through
    ``read_json_rows``, parquet and hub datasets through ``datasets``."""
    fmt = cfg.resolved_format
    if fmt == "jsonl":
        rows, skipped = read_json_rows(cfg.path, on_bad_row=cfg.on_bad_row, key=cfg.key)
        return rows, set().union(*rows), len(skipped)
    import datasets  # deferred: importing datasets costs about a second

    if fmt == "hub":
        rows = datasets.load_dataset(cfg.path, cfg.hub_config, split=cfg.split)
    else:
        rows = datasets.load_dataset("parquet", data_files=cfg.path, split="train")
    return rows, set(rows.column_names), 0


def load_problems(cfg: DataConfig) -> tuple[list[Problem], LoadStats]:
    """Read ``cfg.path`` and return the usable problems and what was dropped.

    Raises:
      ValueError: with the row index, when ``cfg.on_bad_row == "raise"`` and a row is unusable;
        or when ``question_field`` is not a column at all.
    """
    rows, columns, malformed = load_rows(cfg)
    if cfg.question_field not in columns:
        raise ValueError(
            f"DataConfig.question_field {cfg.question_field!r} is not a column of {cfg.path!r} "
            f"(columns: {sorted(columns)})"
        )
    stem = os.path.splitext(os.path.basename(cfg.path.rstrip("/")))[0] or "row"
    problems: list[Problem] = []
    reasons: collections.Counter[str] = collections.Counter()
    if malformed:
        reasons["malformed_line"] = malformed
    for index, row in enumerate(rows):
        if cfg.limit is not None and len(problems) >= cfg.limit:
            break
        question = row.get(cfg.question_field)
        answer = None
        if cfg.answer_field is not None:
            answer = extract_answer(row.get(cfg.answer_field), from_solution=False)
        if answer is None and cfg.solution_field is not None:
            answer = extract_answer(row.get(cfg.solution_field), from_solution=True)
        reason = None
        if not isinstance(question, str) or not question.strip():
            reason = "missing_question"
        elif answer is None:
            reason = "missing_answer"
        if reason is not None:
            if cfg.on_bad_row == "raise":
                raise DataFileError(
                    f"{cfg.key}={cfg.path!r}: row {index}: {reason} (data.on_bad_row=raise)"
                )
            reasons[reason] += 1
            continue
        row_id = row.get(cfg.id_field) if cfg.id_field is not None else None
        domain = row.get(cfg.domain_field) if cfg.domain_field is not None else None
        problems.append(
            Problem(
                question=question.strip(),
                answer=answer,
                id=str(row_id or f"{stem}-{index}"),
                domain=str(domain) if domain not in (None, "") else cfg.domain,
            )
        )
    dropped = sum(reasons.values())
    return problems, LoadStats(kept=len(problems), dropped=dropped, reasons=dict(reasons))


def held_out_share(problems: list, max_problems: int) -> list:
    """The problems evaluated: the first ``max_problems``, or, when the problems come from
    several domains (a task mixture), the first ``max_problems`` of each domain, in domain order
    of first appearance (each task's held-out set as it would be evaluated alone)."""
    order = list(dict.fromkeys(p.domain for p in problems))
    if len(order) <= 1:
        return problems[:max_problems]
    return [q for d in order for q in [p for p in problems if p.domain == d][:max_problems]]
