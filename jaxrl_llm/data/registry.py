"""Tasks by name: where a task's examples come from, and the reward that scores them.

`config.task.name` chooses an entry of `TASKS`; `config.task.kwargs` (a JSON object)
reaches its `source`, and `config.task.reward` ("" for the task's own) names the reward
in `jaxrl_llm.rewards.REWARDS`. A task is named here and scored there, so data never
imports rewards. Register your own with `register_task`, as the built-ins below do.
"""

from collections.abc import Callable
from typing import Any, NamedTuple

from jaxrl_llm.common.registry import register
from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.data.chain import ChainTask
from jaxrl_llm.data.countdown import CountdownTask
from jaxrl_llm.data.dataset import DatasetFile
from jaxrl_llm.data.gsm8k import GSM8KFile


class TaskEntry(NamedTuple):
  """`source(task, kwargs)`: the example source for `config.task` (the TaskSection) and
  the parsed `task.kwargs`; any object with `examples(split, n, seed) -> list[dict]` (each
  with a "prompt" and what the reward reads) and `alphabet` (its characters, for a
  random-init model's vocabulary). `reward`: the `REWARDS` name that scores it by default.
  """

  source: Callable[[Any, dict], Any]
  reward: str


TASKS: dict = {}


def register_task(name: str, source: Callable[[Any, dict], Any], *, reward: str) -> TaskEntry:
  """Adds a task under `name` (refusing to replace one); returns its entry."""
  entry = TaskEntry(source, reward)
  register(TASKS, name)(entry)
  return entry


def _no_kwargs(name, kwargs):
  if kwargs:
    raise ValueError(
      f"task {name!r} takes its settings from config.task's own keys, not task.kwargs "
      f"({', '.join(sorted(kwargs))}); leave config.task.kwargs empty."
    )


def _arithmetic(task, kwargs):
  _no_kwargs("arithmetic", kwargs)
  return ArithmeticTask(digits=task.digits, ops=task.ops, test_fraction=task.test_fraction)


def _countdown(task, kwargs):
  _no_kwargs("countdown", kwargs)
  return CountdownTask(
    count=task.count, max_number=task.max_number, test_fraction=task.test_fraction
  )


def _gsm8k(task, kwargs):
  _no_kwargs("gsm8k", kwargs)
  return GSM8KFile(task.path, test_fraction=task.test_fraction, test_path=task.test_path or None)


def _dataset(task, kwargs):
  _no_kwargs("dataset", kwargs)
  return DatasetFile(
    task.path, task.prompt_key, task.answer_key, task.test_path, task.test_fraction
  )


def _chain(task, kwargs):
  return ChainTask(digits=task.digits, test_fraction=task.test_fraction, **kwargs)


register_task("arithmetic", _arithmetic, reward="exact_match")
register_task("countdown", _countdown, reward="countdown")
register_task("gsm8k", _gsm8k, reward="exact_match")
register_task("chain", _chain, reward="exact_match")
register_task("dataset", _dataset, reward="exact_match")
