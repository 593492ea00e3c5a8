"""The environment protocol, plain host Python, and the registry `env.name` looks up.

An environment is made fresh for each episode and answers two calls:

  reset(example) -> str | list[dict]         the first prompt: text, or chat messages
  step(model_turn) -> (observation, reward, done)

`model_turn` is the text of one model turn; `observation` is what the model reads next,
text (a user turn) or a message dict such as {"role": "tool", "content": ...}, and None
when `done`. The framework owns the rest: tokenisation, the chat template, the turn and
token budgets (`env.max_turns`, `env.max_tokens`), and which tokens are trained on (the
model's only). `reward` is the turn's; the trainer places it on the turn's last token.

Optional: `solved` (bool, the episode succeeded; else its return > 0), `stats` (counts per
episode the run logs as means, e.g. {"tool_calls": 2}) and `demonstration(example)`, the
model turns of a good episode, replayed through the environment for the warm start.
"""

import dataclasses
from collections.abc import Callable
from typing import Protocol

from jaxrl_llm.common.registry import lookup, register
from jaxrl_llm.envs.tools import Tool, call_tool, parse_tool_calls


class Environment(Protocol):
  def reset(self, example: dict) -> str | list[dict]: ...

  def step(self, model_turn: str) -> tuple[str | dict | None, float, bool]: ...


@dataclasses.dataclass(frozen=True)
class EnvSpec:
  """A registered environment.

  `make(**env.kwargs)`: a fresh environment. `source(task_section)`: its example source
  (`examples(split, n, seed)`), or None for the one `task.name` configures. `alphabet` and
  `special_tokens`: what a character tokenizer needs beyond the examples' characters
  (markup tags are single tokens). `stop`: texts that end a model turn besides the
  end-of-turn token (each must be a single token of the tokenizer to stop generation).
  """

  make: Callable[..., Environment]
  source: Callable | None = None
  alphabet: str = ""
  special_tokens: tuple[str, ...] = ()
  stop: tuple[str, ...] = ()


ENVIRONMENTS: dict[str, EnvSpec] = {}


def register_environment(name: str, spec: EnvSpec) -> EnvSpec:
  """Adds `spec` under `name`, for `config.env.name`; re-registering a name raises."""
  register(ENVIRONMENTS, name)(spec)
  return spec


def environment(name: str) -> EnvSpec:
  from jaxrl_llm import envs  # noqa: F401 (the built-ins register on import)

  return lookup(ENVIRONMENTS, name, "environment (config.env.name)")


class ToolEnv:
  """A task answered in one final turn, with tools to call before it.

  A turn with tool calls gets their results as one `tool` message (and `call_cost` off the
  reward); a turn without is the answer, scored by `score(answer, example)` and ending the
  episode. Malformed calls get an error message back, counted in `stats`.
  """

  tools: dict[str, Tool] = {}
  call_style = "hermes"
  call_cost = 0.0

  def __init__(self):
    self.example = None
    self.stats = {"tool_calls": 0, "malformed_calls": 0, "failed_calls": 0}
    self.solved = False

  def reset(self, example: dict) -> str | list[dict]:
    self.example = example
    return example["prompt"]

  def score(self, answer: str, example: dict) -> float:
    """The final answer's reward; each task's subclass defines it (`CalculatorEnv`)."""
    raise NotImplementedError(f"{type(self).__name__} must define score(answer, example).")

  def step(self, model_turn: str):
    calls = parse_tool_calls(model_turn, self.call_style)
    if not calls:
      reward = float(self.score(model_turn, self.example))
      self.solved = reward >= 1.0
      return None, reward, True
    results = [call_tool(call, self.tools) for call in calls]
    self.stats["tool_calls"] += len(calls)
    self.stats["malformed_calls"] += sum(call.error is not None for call in calls)
    self.stats["failed_calls"] += sum(not r.ok for r in results)
    content = "\n".join(r.output for r in results)
    return {"role": "tool", "content": content}, -self.call_cost * len(calls), False
