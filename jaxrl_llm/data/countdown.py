"""Countdown problems: reach a target from given numbers with + - * /, deterministic from a seed.

Each problem is built by combining its numbers in a random order with random
operators (keeping every intermediate result a positive integer), so it always
has a solution that uses every number once. Problems belong to the train or
test split by a stable hash of (sorted numbers, target).
"""

import dataclasses
import zlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class CountdownTask:
  """`count` numbers from 1..`max_number`; more numbers make harder problems."""

  count: int = 4
  max_number: int = 50
  test_fraction: float = 0.2

  def __post_init__(self):
    if not 2 <= self.count <= 6:
      raise ValueError(f"task.count must be in 2..6, got {self.count}.")
    if not 2 <= self.max_number <= 1000:
      raise ValueError(f"task.max_number must be in 2..1000, got {self.max_number}.")
    if not 0 < self.test_fraction < 1:
      raise ValueError(f"task.test_fraction must be in (0, 1), got {self.test_fraction}.")

  @property
  def alphabet(self) -> str:
    return "0123456789+-*/() =,:>"

  def split_of(self, numbers, target) -> str:
    key = ",".join(map(str, sorted(numbers))) + f"->{target}"
    return "test" if zlib.crc32(key.encode()) % 10_000 < self.test_fraction * 10_000 else "train"

  def _solvable(self, rng) -> tuple[list[int], int, str]:
    """Numbers, a target they reach, and the expression that reaches it."""
    numbers = [int(x) for x in rng.integers(1, self.max_number + 1, self.count)]
    order = rng.permutation(self.count)
    value, expression = numbers[order[0]], str(numbers[order[0]])
    for i in order[1:]:
      n = numbers[i]
      choices = ["+", "*"] + (["-"] if value > n else []) + (["/"] if value % n == 0 else [])
      op = choices[int(rng.integers(len(choices)))]
      value = {"+": value + n, "*": value * n, "-": value - n, "/": value // n}[op]
      expression = f"({expression}){op}{n}"
    return numbers, value, expression

  def example(self, numbers, target, solution=None) -> dict:
    listed = " ".join(map(str, numbers))
    out = {"prompt": f"{listed}>{target}:", "numbers": list(numbers), "target": int(target)}
    return out if solution is None else out | {"solution": solution}

  def examples(self, split: str, n: int, seed: int, max_tries: int = 100) -> list[dict]:
    """`n` distinct problems of `split`, the same for the same seed."""
    if split not in ("train", "test"):
      raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    rng = np.random.default_rng(seed)
    seen, out = set(), []
    for _ in range(n * max_tries):
      if len(out) == n:
        break
      numbers, target, solution = self._solvable(rng)
      key = (tuple(sorted(numbers)), target)
      if key in seen or self.split_of(numbers, target) != split:
        continue
      seen.add(key)
      out.append(self.example(numbers, target, solution))
    if len(out) < n:
      raise ValueError(
        f"found only {len(out)} distinct {split} problems of {n}; raise "
        "task.max_number or task.count."
      )
    return out
