"""The environment protocol's parts: the calculator, the sandboxed Python tool, the tool
environment's call parsing and observations, trace splitting, and the multiplication task."""

import os

import pytest

from jaxrlvr import envs, sandbox
from jaxrlvr.data import multiplication
from jaxrlvr.envs import calculator
from jaxrlvr.rewards import verifiers


@pytest.mark.parametrize(
    "expr, want",
    [
        ("347*5821", "2019887"),
        ("7/2", "3.5"),
        ("(2+3)**2 - -1", "26"),
        ("10 // 3 + 10 % 3", "4"),
        ("6/3", "2"),
    ],
)
def test_calculator_evaluates_arithmetic(expr, want):
    result = envs.Calculator()(expr)
    assert result.output == want and not result.error


@pytest.mark.parametrize(
    "expr, message",
    [
        ("__import__('os').system('true')", "only numbers"),
        ("x + 1", "only numbers"),
        ("1/0", "division by zero"),
        ("2**10**10", "exponent"),
        ("9**60 * 9**60", "digits"),
        ("1 +", "not an arithmetic expression"),
        ("1" * 300, "longer than"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expr, message):
    result = envs.Calculator()(expr)
    assert result.error and message in result.output and result.output.startswith("error: ")
    with pytest.raises(calculator.CalculatorError, match=message):
        envs.Calculator().evaluate(expr)


@pytest.fixture(scope="module")
def python_tool():
    tool = envs.PythonTool(sandbox.SandboxConfig(kind="bwrap", program_timeout_s=2.0))
    yield tool
    tool.close()


def test_python_tool_returns_what_the_code_prints(python_tool):
    result = python_tool("print(347*5821)")
    assert result.output.strip() == "2019887" and not result.error
    result = python_tool("print(1/0)")
    assert result.error and "ZeroDivisionError: division by zero" in result.output
    result = python_tool("while True: pass")
    assert result.error and "timed out" in result.output


def test_python_tool_runs_without_network_or_host_files(python_tool):
    here = os.path.abspath(__file__)  # the project checkout exists on the host, not in there
    assert os.path.exists(here) and os.path.exists("/etc/passwd")
    code = (
        "import os, socket\n"
        f"print(os.path.exists({here!r}), os.path.exists('/etc/passwd'))\n"
        "s = socket.socket()\n"
        "try:\n"
        "    s.connect(('1.1.1.1', 53)); print('net')\n"
        "except OSError:\n"
        "    print('no net')\n"
    )
    result = python_tool(code)
    assert result.output.split("\n")[:2] == ["False False", "no net"], result


def test_tool_environment_runs_the_last_call_and_ends_without_one(python_tool):
    env = envs.ToolEnvironment([python_tool, envs.Calculator()], max_output_chars=12)
    assert env.stop == ("</python>", "</calc>")
    assert env.reset("347*5821=") is None
    step = env.step("let me <calc>1+1</calc> no, <python>print(347*5821)</python>")
    assert step.observation == "<output>2019887</output>" and not step.done
    assert step.info["tool"] == "python" and step.info["error"] is False
    step = env.step("<calc>7/0</calc>")
    assert step.observation == "<output>error: di...</output>" and step.info["error"]
    final = env.step(" <answer>2019887</answer>")
    assert final.done and final.observation is None and final.info == {}
    # An unclosed call is no call.
    assert env.step("<python>print(1)").done
    with pytest.raises(ValueError, match="distinct tags"):
        envs.ToolEnvironment([envs.Calculator(), envs.Calculator()])


def test_split_trace_separates_tool_outputs():
    text = "<python>print(2*3)</python><output>6</output> <answer>6</answer>"
    pieces = envs.split_trace(text)
    assert pieces == [
        ("<python>print(2*3)</python>", False),
        ("<output>6</output>", True),
        (" <answer>6</answer>", False),
    ]
    assert "".join(p for p, _ in pieces) == text
    assert envs.split_trace("no tools") == [("no tools", False)]


def test_multiplication_task_is_seeded_disjoint_and_graded_by_its_answer():
    cfg = multiplication.MultiplicationConfig(min_digits=3, max_digits=4)
    train, held_out = multiplication.make_splits(0, 50, 20, cfg)
    again, _ = multiplication.make_splits(0, 50, 20, cfg)
    assert [p.question for p in train] == [p.question for p in again]
    assert not {p.question for p in train} & {p.question for p in held_out}
    for p in train + held_out:
        a, b = (int(x) for x in p.question.rstrip("=").split("*"))
        assert 100 <= a <= 9999 and 100 <= b <= 9999 and p.answer == str(a * b)
        assert p.solution == f"<python>print({a}*{b})</python>"
    p = train[0]
    gold = f"{p.solution}<output>{p.answer}</output> <answer>{p.answer}</answer>"
    assert verifiers.question_only_reward_fn(gold, p.answer)["reward"] == 1.0
    # The tool's output alone, without an answer, earns nothing.
    assert verifiers.question_only_reward_fn(gold.split(" <answer>")[0], p.answer)["reward"] == 0
    with pytest.raises(ValueError, match="min_digits"):
        multiplication.MultiplicationConfig(min_digits=5, max_digits=4)
