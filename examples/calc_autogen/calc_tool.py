"""The calculator tool and answer parsing of the AutoGen calculator agent (plain Python, no framework).

``calculator`` evaluates arithmetic safely (an AST walk, no ``eval``) and raises ``ValueError`` saying what
was wrong with an expression; AutoGen turns that into a failed tool call, and agl records the tool span with
ERROR status.
"""

from __future__ import annotations

import ast
import json
import operator
import re

__all__ = ["call_text", "calculator", "parse_answer"]

_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_UNARY = {ast.USub: operator.neg, ast.UAdd: operator.pos}
_MAX_ABS = 10**12


def _evaluate(node: ast.AST, expression: str) -> int | float:
    if (
        isinstance(node, ast.Constant)
        and isinstance(node.value, (int, float))
        and not isinstance(node.value, bool)
    ):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _evaluate(node.left, expression), _evaluate(node.right, expression)
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise ValueError(f"division by zero in {expression!r}")
        value = _BINARY[type(node.op)](left, right)
        if abs(value) > _MAX_ABS:
            raise ValueError(f"{expression!r} is too large (the calculator handles up to {_MAX_ABS:.0e})")
        return value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, expression))
    raise ValueError(
        f"invalid expression {expression!r}: only numbers, + - * / // %, and parentheses are allowed "
        f"(found {ast.dump(node)[:60]})"
    )


def calculator(expression: str) -> str:
    """Compute an arithmetic expression (numbers, + - * / and parentheses)."""
    text = expression.strip().replace("×", "*").replace("÷", "/").rstrip("=").strip()
    if not text:
        raise ValueError("empty expression: pass the arithmetic to compute, e.g. '12 * 4'")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(
            f"invalid expression {expression!r}: not valid arithmetic; write e.g. '12 * 4'"
        ) from None
    value = _evaluate(tree.body, expression)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def parse_answer(text: str) -> float | None:
    """The last number in ``text`` ("12 * 4 = 48" -> 48.0), or ``None``."""
    numbers = _NUMBER.findall(text.replace(",", ""))
    return float(numbers[-1]) if numbers else None


def call_text(expression: str) -> str:
    """A calculator call written the way the model should write it (the Hermes tool-call format)."""
    call = {"name": "calculator", "arguments": {"expression": expression}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
