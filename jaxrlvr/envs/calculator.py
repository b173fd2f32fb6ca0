"""The calculator tool: ``<calc>expression</calc>`` -> its value.

Evaluates integer and decimal arithmetic (``+ - * / // % **``, unary signs, parentheses) by walking
Python's syntax tree: no names, calls or attributes are ever evaluated, so nothing the model
writes can run as code. Exponents and results are bounded so that a call cannot take the host's
time or memory (``2**10**10`` is refused, not computed).
"""

from __future__ import annotations

import ast
import operator
import time

from jaxrlvr.envs import base

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses or cannot evaluate (the message is the observation)."""


class Calculator:
    """``<calc>expression</calc>``: the value of an arithmetic expression (see module docstring).

    Attributes:
      max_exponent: largest allowed exponent of ``**``.
      max_digits: largest allowed number of digits of any intermediate integer.
    """

    name = "calculator"
    tag = "calc"

    def __init__(self, *, max_exponent: int = 64, max_digits: int = 100, max_chars: int = 200):
        self.max_exponent = max_exponent
        self.max_digits = max_digits
        self.max_chars = max_chars

    def __call__(self, argument: str) -> base.ToolResult:
        start = time.perf_counter()
        try:
            value = self.evaluate(argument)
            output, error = format_number(value), False
        except CalculatorError as exc:
            output, error = f"error: {exc}", True
        return base.ToolResult(output, error, time.perf_counter() - start)

    def evaluate(self, expression: str) -> int | float:
        """The expression's value; raises ``CalculatorError`` (one line) on anything else."""
        if len(expression) > self.max_chars:
            raise CalculatorError(f"expression longer than {self.max_chars} characters")
        try:
            tree = ast.parse(expression.strip(), mode="eval")
        except SyntaxError:
            raise CalculatorError("not an arithmetic expression") from None
        return self._eval(tree.body)

    def _eval(self, node: ast.AST) -> int | float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return self._bounded(node.value)
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](self._eval(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = self._eval(node.left), self._eval(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > self.max_exponent:
                raise CalculatorError(f"exponent {right} is larger than {self.max_exponent}")
            try:
                return self._bounded(_BINARY[type(node.op)](left, right))
            except ZeroDivisionError:
                raise CalculatorError("division by zero") from None
            except OverflowError:
                raise CalculatorError("result too large") from None
        raise CalculatorError("only numbers, + - * / // % ** and parentheses are allowed")

    def _bounded(self, value):
        if isinstance(value, complex):
            raise CalculatorError("complex result")
        if isinstance(value, int) and len(str(abs(value))) > self.max_digits:
            raise CalculatorError(f"result has more than {self.max_digits} digits")
        return value


def format_number(value: int | float) -> str:
    """Integers as digits; floats that are whole as integers, else with up to 10 significant
    decimals (``7/2`` -> ``3.5``)."""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    if isinstance(value, float):
        return f"{value:.10g}"
    return str(value)
