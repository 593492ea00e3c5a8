"""A calculator for model-written arithmetic that never runs the text as code.

The expression is parsed by Python's `ast` into a tree of which only integer literals,
parentheses, unary minus and + - * // % are accepted, then folded by hand. Its length and
every intermediate value are capped, so no input can demand unbounded time or memory
(there is no power operator to build a tower with).
"""

import ast
import operator

MAX_EXPRESSION_CHARS = 64
MAX_ABS_VALUE = 10**24
_BINARY = {
  ast.Add: operator.add,
  ast.Sub: operator.sub,
  ast.Mult: operator.mul,
  ast.FloorDiv: operator.floordiv,
  ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
  pass


def _fold(node) -> int:
  if isinstance(node, ast.Constant) and type(node.value) is int:
    value = node.value
  elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
    value = -_fold(node.operand) if isinstance(node.op, ast.USub) else _fold(node.operand)
  elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
    left, right = _fold(node.left), _fold(node.right)
    if isinstance(node.op, (ast.FloorDiv, ast.Mod)) and right == 0:
      raise CalculatorError("division by zero")
    value = _BINARY[type(node.op)](left, right)
  else:
    raise CalculatorError(f"unsupported: {type(node).__name__}; use integers and + - * // %")
  if abs(value) > MAX_ABS_VALUE:
    raise CalculatorError(f"a value exceeds {MAX_ABS_VALUE:.0e}")
  return value


def calculate(expression: str) -> int:
  """The integer value of `expression` (digits, spaces, parentheses and + - * // %)."""
  if not isinstance(expression, str) or len(expression) > MAX_EXPRESSION_CHARS:
    raise CalculatorError(f"an expression is a string of at most {MAX_EXPRESSION_CHARS} characters")
  try:
    tree = ast.parse(expression.strip(), mode="eval")
  except (SyntaxError, ValueError, RecursionError, MemoryError):
    raise CalculatorError("not an arithmetic expression") from None
  return _fold(tree.body)
