"""Code as a verifiable domain: a response's program is run against the problem's tests.

A code problem's ground truth (``Problem.answer``) is a ``CodeTask`` as a JSON string, so the
driver passes it around like any answer: ``tests`` (Python statements, one test each: MBPP's
``assert f(1) == 2`` lines, HumanEval's ``check(entry_point)``, the synthetic task's visible and
hidden cases), ``prefix`` (text the response's code continues: HumanEval's prompt, or the
synthetic task's ``def f(x): return ``) and ``setup`` (run after the program, before the tests:
MBPP's ``test_setup_code``, HumanEval's ``def check``).

``code_reward_fn`` extracts the code (the last closed ``<answer>`` block or fenced code block,
or with ``extract="raw"`` the whole response), runs it in this process's warm
``sandbox.Sandbox`` and scores:

- ``format_reward``: 1 when code was found and ``prefix + code`` compiles;
- ``answer_reward``: the fraction of tests passed (``mode="fraction"``) or 1 only when all pass
  (``mode="all_pass"``);
- ``reward = answer_reward + format_weight * format_reward``.

A test ``assert EXPR == LITERAL`` becomes a value test: the program's process evaluates EXPR and
sends back its value (plain built-in types only), and ``Sandbox.run`` compares it with the
literal in this process: the literal never enters the sandbox. Objects with a rigged ``__eq__``,
rebinding builtins, exiting early or printing "passed" all score 0. Other tests (HumanEval's
``check(candidate)``) pass when they run without raising; they see the program's callables
through a guard that fails the test unless a call returns exact built-in types, so a returned
always-equal object scores 0 there too (docs/code.md: what a program can still see and do).

Left out: stdin/stdout-style tests (competitive programming), languages other than Python.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import json
import re
from collections.abc import Sequence
from typing import Literal, get_args

from jaxrlvr import sandbox as sandbox_lib

CodeMode = Literal["fraction", "all_pass"]
Extract = Literal["block", "raw"]

_FENCE = re.compile(r"```[ \t]*(?:python|py|python3)?[ \t]*\n(.*?)```", re.DOTALL)
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeTask:
    """The ground truth of a code problem (travels as ``to_json()`` in ``Problem.answer``)."""

    tests: tuple[str, ...]
    prefix: str = ""
    setup: str = ""
    entry_point: str | None = None

    def __post_init__(self):
        object.__setattr__(self, "tests", tuple(self.tests))
        if not self.tests:
            raise ValueError("CodeTask needs at least one test")

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> CodeTask:
        raw = json.loads(text)
        return cls(
            tests=tuple(raw["tests"]),
            prefix=raw.get("prefix", ""),
            setup=raw.get("setup", ""),
            entry_point=raw.get("entry_point"),
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class CodeRewardConfig(sandbox_lib.SandboxLimits):
    """``reward.code``: how a code response is scored, and the sandbox's limits (the fields of
    ``sandbox.SandboxLimits``, written there once: ``reward.code.memory_mb`` and the rest).

    Attributes:
      mode: ``fraction`` (answer_reward = tests passed / tests) or ``all_pass``.
      extract: ``block`` (the last closed ``<answer>`` block or fenced code block; none found
        scores 0) or ``raw`` (the whole response is code, as in HumanEval-style continuations).
    """

    mode: CodeMode = "fraction"
    extract: Extract = "block"

    def __post_init__(self):
        if self.mode not in get_args(CodeMode):
            raise ValueError(
                f"reward.code.mode must be one of {get_args(CodeMode)}, got {self.mode!r}"
            )
        if self.extract not in get_args(Extract):
            raise ValueError(
                f"reward.code.extract must be one of {get_args(Extract)}, got {self.extract!r}"
            )
        super().__post_init__()  # the limits

    def sandbox(self, kind: sandbox_lib.SandboxKind) -> sandbox_lib.SandboxConfig:
        """The ``SandboxConfig`` of these limits and the mechanism ``kind``."""
        return sandbox_lib.SandboxConfig(kind=kind, **self.limit_values())


def extract_code(response: str, extract: Extract = "block") -> str | None:
    """The response's code: with ``block``, whichever closes last of the last ``<answer>`` block
    and the last fenced code block (None when there is neither); with ``raw``, the response."""
    if not isinstance(response, str):
        return None
    if extract == "raw":
        return response
    found: list[tuple[int, str]] = []
    start = response.rfind(ANSWER_OPEN)
    if start >= 0:
        end = response.find(ANSWER_CLOSE, start)
        if end >= 0:
            found.append((end, response[start + len(ANSWER_OPEN) : end]))
    fences = list(_FENCE.finditer(response))
    if fences:
        found.append((fences[-1].end(), fences[-1].group(1)))
    if not found:
        return None
    code = max(found)[1]
    # An answer block holding a fenced block: take the fence's content.
    inner = _FENCE.search(code)
    return inner.group(1) if inner else code


def split_test(statement: str) -> dict:
    """One test's request for the harness: ``{"expr", "expected"}`` when the statement is
    ``assert EXPR == LITERAL`` (either side the literal), else ``{"stmt": statement}``."""
    try:
        tree = ast.parse(statement)
    except SyntaxError:
        return {"stmt": statement}
    if len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert):
        test = tree.body[0].test
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            left, right = test.left, test.comparators[0]
            for expr, literal in ((left, right), (right, left)):
                try:
                    value = ast.literal_eval(literal)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    continue
                return {"expr": ast.unparse(expr), "expected": repr(value)}
    return {"stmt": statement}


def zero() -> dict[str, float]:
    return {"format_reward": 0.0, "answer_reward": 0.0, "reward": 0.0}


def run_tests(code: str, task: CodeTask, cfg: sandbox_lib.SandboxConfig) -> sandbox_lib.RunResult:
    """Run ``task.prefix + code`` against the task's tests in this process's warm sandbox."""
    box = sandbox_lib.shared_sandbox(cfg)
    return box.run(task.prefix + code, [split_test(t) for t in task.tests], task.setup)


def code_reward_fn(
    response: str,
    ground_truth: str,
    *,
    mode: CodeMode = "fraction",
    extract: Extract = "block",
    format_weight: float = 0.0,
    sandbox: sandbox_lib.SandboxConfig | None = None,
) -> dict[str, float]:
    """Score a code response against a ``CodeTask`` JSON ground truth (see the module doc);
    ``sandbox`` None: ``SandboxConfig()`` (bubblewrap, default limits)."""
    code = extract_code(response, extract)
    if code is None or not code.strip():
        return zero()
    task = CodeTask.from_json(ground_truth)
    try:
        compile(task.prefix + code, "<program>", "exec")
    except (SyntaxError, ValueError):
        return zero()
    result = run_tests(code, task, sandbox or sandbox_lib.SandboxConfig())
    answer = result.fraction if mode == "fraction" else float(result.all_passed)
    return {"format_reward": 1.0, "answer_reward": answer, "reward": answer + format_weight}


def make_code_reward_fn(
    cfg: CodeRewardConfig = CodeRewardConfig(),
    *,
    sandbox_kind: sandbox_lib.SandboxKind = "bwrap",
    format_weight: float = 0.0,
):
    """A picklable ``code_reward_fn`` for ``cfg`` (a ``functools.partial``)."""
    return functools.partial(
        code_reward_fn,
        mode=cfg.mode,
        extract=cfg.extract,
        format_weight=format_weight,
        sandbox=cfg.sandbox(sandbox_kind),
    )


def grader_timeout_s(cfg: CodeRewardConfig, timeout_s: float) -> float:
    """A grading-pool deadline that leaves the sandbox its own limits, its clean-up budget (5 s)
    and start-up time, so that ``Sandbox.run``'s own deadline (the program's limit + 10 s) comes
    first."""
    return max(timeout_s, cfg.program_timeout_s + 15.0)


def reference_pass_rate(tasks: Sequence[tuple[str, CodeTask]], cfg=None) -> float:
    """Fraction of (code, task) pairs whose code passes every test (for checking data)."""
    cfg = cfg or sandbox_lib.SandboxConfig()
    ok = sum(run_tests(code, task, cfg).all_passed for code, task in tasks)
    return ok / max(1, len(tasks))
