"""The reward-function protocol and the checked, weighted combination of several.

A reward function is any Python callable

  fn(completions: list[str], examples: list[dict]) -> array-like of floats, one per completion

run on the host, where `examples[i]` holds the fields of the prompt that
completion i answers (its answer, say). Model output is untrusted text: reward
functions parse it and never evaluate it.
"""

from collections.abc import Callable, Mapping, Sequence

import numpy as np

RewardFn = Callable[[Sequence[str], Sequence[dict]], "np.ndarray | Sequence[float]"]


class RewardError(RuntimeError):
  """A reward function raised or returned something unusable; the message names it."""


def _name(fn) -> str:
  return getattr(fn, "__name__", type(fn).__name__)


def score(
  reward_fns: Mapping[str, tuple[RewardFn, float]],
  completions: Sequence[str],
  examples: Sequence[dict],
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
  """Runs every reward function and returns (weighted total, {name: raw scores}).

  Raises `RewardError` naming the function, and the example where one is to
  blame, if a function raises, returns the wrong shape, or returns NaN/inf.
  """
  n = len(completions)
  total = np.zeros(n, np.float32)
  parts = {}
  for name, (fn, weight) in reward_fns.items():
    try:
      raw = fn(completions, examples)
    except Exception as e:  # noqa: BLE001 (re-raised with the function named)
      raise RewardError(
        f"reward function {name!r} ({_name(fn)}) raised {e!r} on a batch of {n} "
        f"completions; first example: {examples[0] if examples else None}"
      ) from e
    values = np.asarray(raw, dtype=np.float32)
    if values.shape != (n,):
      raise RewardError(
        f"reward function {name!r} returned shape {values.shape}; it must return "
        f"one float per completion, shape ({n},)."
      )
    bad = np.flatnonzero(~np.isfinite(values))
    if bad.size:
      i = int(bad[0])
      raise RewardError(
        f"reward function {name!r} returned {values[i]} for completion {i} "
        f"({completions[i][:200]!r}) of example {examples[i]}; rewards must be "
        "finite."
      )
    parts[name] = values
    total += weight * values
  return total, parts
