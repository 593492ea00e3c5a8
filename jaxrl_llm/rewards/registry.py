"""Rewards by name. `config.task.reward` chooses an entry of `REWARDS` ("" takes the task's
own, `data.TASKS[name].reward`); each entry is a factory `make(task, kwargs) -> reward_fn`
given `config.task` (the TaskSection) and the parsed `task.kwargs`, and `reward_fn` is a
`RewardFn` (`rewards.base`): completions and examples in, one float per completion out. The
first reward of a task decides correctness (accuracy). Register your own with
`register_reward`, as the built-ins below do.
"""

from jaxrl_llm.common.registry import register
from jaxrl_llm.rewards.countdown import countdown_reward
from jaxrl_llm.rewards.math import answer_match

REWARDS: dict = {}


def register_reward(name: str):
  """Decorator: adds a reward factory `make(task, kwargs) -> reward_fn` under `name`."""
  return register(REWARDS, name)


@register_reward("exact_match")
def _exact_match(task, kwargs):
  """The final number (after `task.answer_marker`, or stated last) equals the gold one."""
  del kwargs
  return answer_match(task.answer_marker, task.strict_answer)


@register_reward("math_verify")
def _math_verify(task, kwargs):
  """Equivalence by math-verify, in a sandboxed worker (pip install 'jaxrl_llm[math]')."""
  del task, kwargs
  from jaxrl_llm.rewards.equivalence import MathVerifyReward

  return MathVerifyReward()


@register_reward("countdown")
def _countdown(task, kwargs):
  """The expression uses each given number once and reaches the target."""
  del task, kwargs
  return countdown_reward
