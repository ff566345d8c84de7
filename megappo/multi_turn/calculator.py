"""A calculator tool: evaluates an arithmetic expression safely (Python's `ast`, numbers and + - * / // % ** only).

Tool config entry:

    - class_name: megappo.multi_turn.calculator.CalculatorTool
      config: {max_exponent: 64, max_digits: 100}
      tool_schema:
        type: function
        function:
          name: calculator
          description: Evaluate an arithmetic expression (+ - * / // % ** and parentheses)
          parameters: {type: object, properties: {expression: {type: string}}, required: [expression]}
"""
from __future__ import annotations

import ast
import operator

from megappo.multi_turn.tools import BaseTool, ToolResult

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    pass


def evaluate(expression: str, *, max_exponent: int = 64, max_digits: int = 100, max_length: int = 1000):
    """The value of an arithmetic expression, or CalculatorError saying what is not allowed."""
    if len(expression) > max_length:
        raise CalculatorError(f"the expression is longer than {max_length} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise CalculatorError(f"not an arithmetic expression ({e.msg})") from None

    def ev(node):
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            return _UNARY[type(node.op)](ev(node.operand))
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > max_exponent:
                raise CalculatorError(f"exponents above {max_exponent} are not allowed")
            value = _BINARY[type(node.op)](left, right)
            if isinstance(value, int) and len(str(abs(value))) > max_digits:
                raise CalculatorError(f"the result has more than {max_digits} digits")
            return value
        raise CalculatorError(f"{type(node).__name__} is not allowed: use numbers, + - * / // % ** and parentheses")

    try:
        return ev(tree)
    except ZeroDivisionError:
        raise CalculatorError("division by zero") from None
    except (OverflowError, TypeError) as e:
        raise CalculatorError(str(e)) from None


def format_number(value) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


class CalculatorTool(BaseTool):
    """`{"expression": "37+85+19"}` -> "141". Stateless; errors are answers (metrics error=1)."""

    def execute(self, instance_id: str, arguments: dict) -> ToolResult:
        expression = arguments.get("expression")
        if not isinstance(expression, str):
            return ToolResult('Error: the calculator takes {"expression": "<arithmetic>"}', metrics={"error": 1.0})
        try:
            value = evaluate(expression, max_exponent=int(self.config.get("max_exponent", 64)),
                             max_digits=int(self.config.get("max_digits", 100)))
        except CalculatorError as e:
            return ToolResult(f"Error: {e}", metrics={"error": 1.0})
        return ToolResult(format_number(value))
