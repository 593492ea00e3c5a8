"""The reward-function protocol and the checked, weighted combination of several.

A reward function is any Python callable

  fn(completions: list[str], examples: list[dict]) -> array-like of floats, one per completion

run on the host, where `examples[i]` holds the fields of the prompt that
completion i answers (its answer, say). Model output is untrusted text: reward
functions parse it and never evaluate it.
"""

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np

log = logging.getLogger(__name__)

RewardFn = Callable[[Sequence[str], Sequence[dict]], "np.ndarray | Sequence[float]"]


class RewardError(RuntimeError):
  """A reward function raised, hung or returned something unusable; the message names it
  and, where one is to blame, the completion."""


class Scored(NamedTuple):
  """What `score` returns: the weighted total, each function's raw scores, and which
  completions a failing function scored 0 (`on_error="zero"`; all False otherwise)."""

  total: np.ndarray
  parts: dict[str, np.ndarray]
  failed: np.ndarray


ON_ERROR = ("raise", "zero")


class _Timeout(Exception):
  pass


def _name(fn) -> str:
  return getattr(fn, "__name__", type(fn).__name__)


def _within(deadline_s: float | None, call):
  """`call()` in a daemon thread, given `deadline_s` seconds (None: no deadline); raises
  `_Timeout` when it has not returned by then. A Python thread cannot be stopped: a call
  that hangs is left running in the background, and the process exits without waiting."""
  if not deadline_s:
    return call()
  out = {}

  def target():
    try:
      out["value"] = call()
    except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
      out["error"] = e

  thread = threading.Thread(target=target, daemon=True, name="reward function")
  thread.start()
  thread.join(deadline_s)
  if thread.is_alive():
    raise _Timeout
  if "error" in out:
    raise out["error"]
  return out["value"]


def _culprits(fn, completions, examples, deadline_s, first_only):
  """Scores each completion alone to find the ones the function fails on, within one
  `deadline_s` for them all: ({index: score} of those it scored, {index: error} of those it
  failed on, how many it reached before the deadline); `first_only` stops at the first."""
  scored, failed = {}, {}
  start = time.monotonic()
  for i in range(len(completions)):
    left = None if not deadline_s else deadline_s - (time.monotonic() - start)
    if left is not None and left <= 0:
      return scored, failed, i
    try:
      value = np.asarray(_within(left, lambda i=i: fn([completions[i]], [examples[i]])), float)
      if value.shape != (1,) or not np.isfinite(value[0]):
        raise ValueError(f"it returned {value!r} for it alone")
      scored[i] = float(value[0])
    except _Timeout:
      return scored, failed, i
    except Exception as e:  # noqa: BLE001 - reported with the index
      failed[i] = e
      if first_only:
        return scored, failed, i + 1
  return scored, failed, len(completions)


def _one(name, fn, completions, examples, deadline_s, on_error) -> tuple[np.ndarray, np.ndarray]:
  """One function's scores and the mask of completions it failed on (scored 0)."""
  n = len(completions)
  label = f"reward function {name!r} ({_name(fn)})"
  try:
    values = np.asarray(_within(deadline_s, lambda: fn(completions, examples)), np.float32)
  except _Timeout:
    if on_error == "raise":
      raise RewardError(
        f"{label} did not return within config.rewards.timeout_s={deadline_s} s on a batch "
        f"of {n} completions (0-{n - 1} of the step's rows on this process); it is "
        "left running in the background. Fix the function, or raise the deadline, or set "
        "config.rewards.on_error='zero' to score such a batch 0 and go on."
      ) from None
    log.warning("%s did not return within %s s; its %d scores are 0.", label, deadline_s, n)
    return np.zeros(n, np.float32), np.ones(n, bool)
  except Exception as e:  # noqa: BLE001 - re-raised (or counted) with the completion named
    first_only = on_error == "raise"
    scored, failed, reached = _culprits(fn, completions, examples, deadline_s, first_only)
    if first_only:
      if failed:
        i = min(failed)
        text = completions[i][:200]
        where = f"on completion {i} ({text!r}) of example {examples[i]}: {failed[i]!r}"
      elif reached < n:
        where = f"on the batch; scoring them one by one reached only {reached} by the deadline"
      else:
        where = f"on the batch of {n} completions, though on none of them alone"
      raise RewardError(f"{label} raised {e!r}; it fails {where}") from e
    values = np.zeros(n, np.float32)
    for i, v in scored.items():
      values[i] = v
    bad = np.ones(n, bool)
    bad[list(scored)] = False
    log.warning("%s raised %r; %d of %d completions scored 0.", label, e, int(bad.sum()), n)
    return values, bad
  if values.shape != (n,):
    if on_error == "raise":
      raise RewardError(
        f"{label} returned shape {values.shape}; it must return one float per completion, "
        f"shape ({n},)."
      )
    return np.zeros(n, np.float32), np.ones(n, bool)
  bad = ~np.isfinite(values)
  if bad.any() and on_error == "raise":
    i = int(np.flatnonzero(bad)[0])
    raise RewardError(
      f"{label} returned {values[i]} for completion {i} ({completions[i][:200]!r}) of "
      f"example {examples[i]}; rewards must be finite."
    )
  return np.where(bad, 0.0, values).astype(np.float32), bad


def score(
  reward_fns: Mapping[str, tuple[RewardFn, float]],
  completions: Sequence[str],
  examples: Sequence[dict],
  timeout_s: float | None = None,
  on_error: str = "raise",
) -> Scored:
  """Runs every reward function, each under a deadline of `timeout_s` seconds per batch
  (None or 0: none), and returns their weighted total and raw scores.

  A function that raises, hangs past the deadline, returns the wrong shape or a NaN/inf
  raises `RewardError` naming it and, where one is to blame, the example's index; with
  `on_error="zero"` the completions it failed on score 0 from it instead, and `failed`
  marks them.
  """
  if on_error not in ON_ERROR:
    raise ValueError(f"on_error={on_error!r}; use one of {ON_ERROR}")
  n = len(completions)
  total, parts, failed = np.zeros(n, np.float32), {}, np.zeros(n, bool)
  for name, (fn, weight) in reward_fns.items():
    values, bad = _one(name, fn, completions, examples, timeout_s, on_error)
    parts[name] = values
    total += weight * values
    failed |= bad
  return Scored(total, parts, failed)
