"""Load code problems from the common jsonl layouts (MBPP, HumanEval) as ``Problem``s.

- MBPP: ``text`` (the task), ``code`` (a reference solution), ``test_list`` (assert lines),
  optional ``test_setup_code`` and ``challenge_test_list``. The question is the text plus the
  first test (it names the function, as MBPP's own prompt does); every test is graded.
- HumanEval: ``prompt`` (signature and docstring, which the answer continues),
  ``canonical_solution``, ``test`` (``def check(candidate): ...``) and ``entry_point``. The
  question is the prompt; the one test is ``check(entry_point)``.

``Problem.answer`` is the ``rewards.code.CodeTask`` JSON (the driver never looks inside) and
``Problem.solution`` the reference code. Rows missing a field are dropped and counted (or raise,
with ``on_bad_row="raise"``). ``load_splits`` is what ``builders.load_splits`` calls for code
data: the synthetic code task or these files. Hand-written samples of both layouts ship in
``data/samples/`` (``sample_path("mbpp_sample.jsonl")``, ``"humaneval_sample.jsonl"``).

Left out: hub downloads (files only) and the sanitized-MBPP prompt variants.
"""

from __future__ import annotations

import collections
import json
from typing import Literal

from jaxrlvr.data import loading, synthetic, synthetic_code
from jaxrlvr.rewards import code

CodeLayout = Literal["mbpp", "humaneval"]


def mbpp_problem(row: dict, index: int) -> loading.Problem:
    tests = list(row["test_list"])
    if not tests or not str(row["text"]).strip():
        raise ValueError("empty text or test_list")
    task = code.CodeTask(tests=tuple(tests), setup=row.get("test_setup_code") or "")
    question = f"{row['text'].strip()}\nYour code should pass this test:\n{tests[0]}"
    return loading.Problem(
        question=question,
        answer=task.to_json(),
        id=f"mbpp-{row.get('task_id', index)}",
        solution=row.get("code"),
    )


def humaneval_problem(row: dict, index: int) -> loading.Problem:
    prompt, entry = row["prompt"], row["entry_point"]
    if not prompt.strip() or not entry or "def check" not in row["test"]:
        raise ValueError("empty prompt or entry_point, or test without def check")
    task = code.CodeTask(
        tests=(f"check({entry})",), prefix=prompt, setup=row["test"], entry_point=entry
    )
    task_id = str(row.get("task_id", index)).replace("/", "-")
    return loading.Problem(
        question=prompt, answer=task.to_json(), id=task_id, solution=row.get("canonical_solution")
    )


_PARSERS = {"mbpp": mbpp_problem, "humaneval": humaneval_problem}


def load_code_problems(
    path: str, layout: CodeLayout, *, on_bad_row: Literal["skip", "raise"] = "skip"
) -> tuple[list[loading.Problem], loading.LoadStats]:
    """Problems of a local jsonl file in ``layout`` (``mbpp`` or ``humaneval``)."""
    if layout not in _PARSERS:
        raise ValueError(f"data.code_layout must be one of {sorted(_PARSERS)}, got {layout!r}")
    problems, reasons = [], collections.Counter()
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            if not line.strip():
                continue
            try:
                problems.append(_PARSERS[layout](json.loads(line), index))
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                if on_bad_row == "raise":
                    raise ValueError(f"{path} row {index}: not a {layout} problem ({exc})") from exc
                reasons[type(exc).__name__] += 1
    dropped = sum(reasons.values())
    return problems, loading.LoadStats(len(problems), dropped, dict(reasons))


def load_splits(data, seed: int, *, train: bool = True):
    """(train, held-out) problems for a ``config.DataSection`` whose ``train`` is
    ``synthetic_code`` or whose ``code_layout`` is set (then ``train``/``eval`` are files)."""
    if data.train == "synthetic_code":
        return synthetic_code.make_splits(
            seed, data.synthetic_train_size, data.synthetic_eval_size, data.synthetic_code
        )

    def load(path):
        problems, stats = load_code_problems(path, data.code_layout, on_bad_row=data.on_bad_row)
        if not problems:
            raise ValueError(f"{path}: no usable {data.code_layout} problems ({stats.reasons})")
        return problems

    return (load(data.train) if train else []), (load(data.eval) if data.eval else [])


__all__ = ["load_code_problems", "load_splits", "synthetic", "synthetic_code"]
