"""Countdown: reach a target with given numbers and + - * /, checked by parsing, never by eval.

The expression is read with a small recursive-descent parser over exact
fractions. Anything but digits, the four operators (also `x`, `×`, `÷`),
parentheses and spaces makes it invalid, as do division by zero, a number not
given (or used more often than given), and expressions longer than
`MAX_EXPRESSION` characters or nested deeper than `MAX_DEPTH`.
"""

import re
from fractions import Fraction

MAX_EXPRESSION = 256
MAX_DEPTH = 32
_TOKEN = re.compile(r"\s*(?:([0-9]{1,9})|([-+*/x×÷()]))")
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


class InvalidExpression(ValueError):
  pass


class _Parser:
  def __init__(self, text: str):
    self.tokens, self.pos, self.numbers = self._tokenize(text), 0, []

  @staticmethod
  def _tokenize(text):
    tokens, i = [], 0
    while i < len(text):
      match = _TOKEN.match(text, i)
      if match is None:
        if text[i:].strip() == "":
          break
        raise InvalidExpression(f"unexpected {text[i]!r}")
      number, op = match.groups()
      tokens.append(int(number) if number else {"x": "*", "×": "*", "÷": "/"}.get(op, op))
      i = match.end()
    return tokens

  def _peek(self):
    return self.tokens[self.pos] if self.pos < len(self.tokens) else None

  def _take(self):
    token = self._peek()
    self.pos += 1
    return token

  def parse(self) -> Fraction:
    value = self._expr(0)
    if self._peek() is not None:
      raise InvalidExpression(f"trailing {self._peek()!r}")
    return value

  def _expr(self, depth):
    value = self._term(depth)
    while self._peek() in ("+", "-"):
      op, rhs = self._take(), self._term(depth)
      value = value + rhs if op == "+" else value - rhs
    return value

  def _term(self, depth):
    value = self._factor(depth)
    while self._peek() in ("*", "/"):
      op, rhs = self._take(), self._factor(depth)
      if op == "/" and rhs == 0:
        raise InvalidExpression("division by zero")
      value = value * rhs if op == "*" else value / rhs
    return value

  def _factor(self, depth):
    if depth > MAX_DEPTH:
      raise InvalidExpression("nested too deeply")
    token = self._take()
    if isinstance(token, int):
      self.numbers.append(token)
      return Fraction(token)
    if token == "(":
      value = self._expr(depth + 1)
      if self._take() != ")":
        raise InvalidExpression("unbalanced parentheses")
      return value
    raise InvalidExpression(f"expected a number or '(', got {token!r}")


def evaluate_expression(text: str) -> tuple[Fraction, list[int]]:
  """(exact value, numbers used) of an arithmetic expression; raises InvalidExpression."""
  if len(text) > MAX_EXPRESSION:
    raise InvalidExpression(f"longer than {MAX_EXPRESSION} characters")
  parser = _Parser(text)
  return parser.parse(), parser.numbers


def extract_expression(completion: str) -> str:
  """The last `<answer>...</answer>`, else the last non-empty line; a trailing `= N` is
  dropped."""
  answers = _ANSWER.findall(completion[-10_000:])
  text = (
    answers[-1]
    if answers
    else next((line for line in reversed(completion[-10_000:].splitlines()) if line.strip()), "")
  )
  return text.split("=", 1)[0]


def countdown_reward(completions, examples, use_all: bool = True):
  """1.0 where the completion's expression equals the example's `target` using its `numbers`
  (each at most once; all of them when `use_all`), else 0.0."""
  out = []
  for completion, example in zip(completions, examples, strict=True):
    try:
      value, used = evaluate_expression(extract_expression(completion))
    except InvalidExpression:
      out.append(0.0)
      continue
    given = sorted(example["numbers"])
    remaining = list(given)
    ok = value == example["target"]
    for n in used:
      if n in remaining:
        remaining.remove(n)
      else:
        ok = False
    out.append(float(ok and (not use_all or not remaining)))
  return out
