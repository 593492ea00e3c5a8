"""Chained arithmetic with shown work: the model writes every intermediate step.

A problem adds `terms` numbers of `digits` digits, and its worked solution states each
partial sum, e.g. `"47+15+23="` -> `"47+15=62,62+23=85"`. Correct solutions grow with the
number of terms (2 terms: 8 characters, 4 terms: 26), and a wrong one can be any length
up to the token budget: extra steps, repeated steps, a missing stop. This is the setting
in which a length normalisation can reward rambling (Dr. GRPO's length bias), which the
two-character answers of plain addition cannot show. The final answer is the last
number of the completion that is not one of the question's (`common.answers`).
"""

import dataclasses
import zlib

import numpy as np


@dataclasses.dataclass(frozen=True)
class ChainTask:
  """Sums of `min_terms`..`max_terms` numbers of `digits` digits, with their steps."""

  digits: int = 2
  min_terms: int = 2
  max_terms: int = 3
  test_fraction: float = 0.2

  def __post_init__(self):
    if not 1 <= self.digits <= 6:
      raise ValueError(f"digits must be in 1..6, got {self.digits}.")
    if not 2 <= self.min_terms <= self.max_terms <= 8:
      raise ValueError(
        f"need 2 <= min_terms <= max_terms <= 8, got {self.min_terms} and {self.max_terms}."
      )
    if not 0 < self.test_fraction < 1:
      raise ValueError(f"test_fraction must be in (0, 1), got {self.test_fraction}.")

  @property
  def alphabet(self) -> str:
    return "0123456789+=,"

  def split_of(self, numbers) -> str:
    bucket = zlib.crc32("+".join(map(str, numbers)).encode()) % 10_000
    return "test" if bucket < self.test_fraction * 10_000 else "train"

  def example(self, numbers) -> dict:
    steps, total = [], numbers[0]
    for n in numbers[1:]:
      steps.append(f"{total}+{n}={total + n}")
      total += n
    return {
      "prompt": "+".join(map(str, numbers)) + "=",
      "question": " + ".join(map(str, numbers)),
      "solution": ",".join(steps),
      "answer": str(total),
      "terms": len(numbers),
    }

  def examples(self, split: str, n: int, seed: int) -> list[dict]:
    """`n` distinct problems of `split`, the same for the same seed."""
    if split not in ("train", "test"):
      raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    lo, hi = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10**self.digits
    rng = np.random.default_rng([seed, zlib.crc32(split.encode())])
    seen, out = set(), []
    for _ in range(50 * n):
      if len(out) == n:
        break
      terms = int(rng.integers(self.min_terms, self.max_terms + 1))
      numbers = tuple(int(x) for x in rng.integers(lo, hi, terms))
      if numbers in seen or self.split_of(numbers) != split:
        continue
      seen.add(numbers)
      out.append(self.example(numbers))
    if len(out) < n:
      raise ValueError(f"found only {len(out)} distinct {split} problems of {n}; raise digits.")
    return out
