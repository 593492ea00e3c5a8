"""The built-in environments, registered the way a user registers one.

calculator   arithmetic too hard to do in one's head (4-digit multiplication by default,
             `task.name=arithmetic`): a `calc` tool, then the exact answer scores 1
guess        find a secret number in [low, high] from "higher" / "lower" replies: 1 for
             finding it, `turn_cost` off for every miss
"""

import json
import string
import zlib

import numpy as np

from jaxrl_llm.envs.base import EnvSpec, ToolEnv, register_environment
from jaxrl_llm.envs.calculator import calculate
from jaxrl_llm.envs.tools import Tool

PRINTABLE = "".join(c for c in string.printable if c not in "\t\r\x0b\x0c")
TOOL_TAGS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")

CALC = Tool(
  "calc",
  lambda x: calculate(x),
  "the value of an integer expression with + - * // % and parentheses",
  {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]},
)


def _fraction(text: str) -> float:
  """A number in [0, 1) fixed by `text` (the same on every run and process)."""
  return zlib.crc32(text.encode()) / 2**32


class CalculatorEnv(ToolEnv):
  """`example["prompt"]` ("1234*5678="), answered in a final turn equal to `example["answer"]`.

  `demo_tool_rate`: the share of warm-start demonstrations that call the tool; the rest
  write the answer straight away, so the warm-started policy calls the tool about that
  often and RL can learn when to. `use_tools=False` is the no-tool baseline: calls get an
  error back, and the demonstrations answer straight away."""

  def __init__(self, demo_tool_rate: float = 0.5, call_cost: float = 0.0, use_tools: bool = True):
    super().__init__()
    self.tools = {"calc": CALC} if use_tools else {}
    self.demo_tool_rate = demo_tool_rate if use_tools else 0.0
    self.call_cost = call_cost

  def score(self, answer: str, example: dict) -> float:
    return float(answer.strip() == str(example["answer"]))

  def demonstration(self, example: dict) -> list[str]:
    answer = str(example["answer"])
    if _fraction(example["prompt"]) >= self.demo_tool_rate:
      return [answer]
    question = example["prompt"].rstrip("=")
    call = json.dumps({"name": "calc", "arguments": {"x": question}}, separators=(",", ":"))
    return [f"<tool_call>{call}</tool_call>", answer]


class GuessNumbers:
  """Secrets drawn uniformly from [low, high], as examples {"prompt", "secret"}."""

  def __init__(self, low: int = 1, high: int = 30):
    if not low < high:
      raise ValueError(f"env.kwargs: low ({low}) must be below high ({high}).")
    self.low, self.high = low, high
    self.alphabet = string.digits + " -\nguesshigherlowr?"

  def examples(self, split: str, n: int, seed: int) -> list[dict]:
    rng = np.random.default_rng([seed, split == "test"])
    prompt = f"guess {self.low}-{self.high}\n"
    secrets = rng.integers(self.low, self.high + 1, size=n)
    bounds = {"low": self.low, "high": self.high}
    return [{"prompt": prompt, "secret": int(s)} | bounds for s in secrets]


class GuessEnv:
  """Each turn is a guess; the reply is "higher", "lower" or "?" (not a number in range).
  `feedback=False` is the baseline without feedback: every miss gets "?"."""

  def __init__(self, low: int = 1, high: int = 30, turn_cost: float = 0.1, feedback: bool = True):
    self.turn_cost, self.feedback = turn_cost, feedback
    self.solved, self.stats = False, {"invalid_guesses": 0}

  def reset(self, example: dict) -> str:
    self.secret, self.low, self.high = example["secret"], example["low"], example["high"]
    return example["prompt"]

  def step(self, model_turn: str):
    text = model_turn.strip()
    guess = int(text) if text.isdigit() and len(text) <= 6 else None
    if guess is None or not self.low <= guess <= self.high:
      self.stats["invalid_guesses"] += 1
      return "?\n", -self.turn_cost, False
    if guess == self.secret:
      self.solved = True
      return None, 1.0, True
    if not self.feedback:
      return "?\n", -self.turn_cost, False
    return ("higher\n" if guess < self.secret else "lower\n"), -self.turn_cost, False

  def demonstration(self, example: dict) -> list[str]:
    """Guesses drawn uniformly from what the replies so far leave possible (not bisection,
    so RL has a better strategy to find)."""
    rng = np.random.default_rng(zlib.crc32(repr(sorted(example.items())).encode()))
    low, high, turns = example["low"], example["high"], []
    while True:
      guess = int(rng.integers(low, high + 1))
      turns.append(str(guess))
      if guess == example["secret"]:
        return turns
      low, high = (guess + 1, high) if guess < example["secret"] else (low, guess - 1)


register_environment(
  "calculator",
  EnvSpec(CalculatorEnv, alphabet=PRINTABLE, special_tokens=TOOL_TAGS, stop=("</tool_call>",)),
)
register_environment(
  "guess",
  EnvSpec(
    GuessEnv,
    source=lambda kwargs: GuessNumbers(kwargs.get("low", 1), kwargs.get("high", 30)),
  ),
)
