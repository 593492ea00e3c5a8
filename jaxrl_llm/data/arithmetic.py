"""Synthetic arithmetic problems, deterministic from a seed, with disjoint train and test splits.

A problem is `"<a><op><b>="` and its answer the decimal result, e.g. `"47+15="` ->
`"62"`; its `question` (`"47 + 15"`) is the form an instruction for a chat model takes.
Each (a, op, b) belongs to one split by a stable hash, so no test problem is ever seen
in training, whatever the seeds.
"""

import dataclasses
import operator
import zlib

import numpy as np

OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul}


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
  """n-digit problems over `ops`; `test_fraction` of all (a, op, b) form the test split.

  Difficulty grows with `digits` and with `*`.
  """

  digits: int = 2
  ops: str = "+"
  test_fraction: float = 0.2

  def __post_init__(self):
    if not 1 <= self.digits <= 9:
      raise ValueError(f"task.digits must be in 1..9, got {self.digits}.")
    bad = set(self.ops) - set(OPS)
    if not self.ops or bad:
      raise ValueError(f"task.ops must be a non-empty string of {''.join(OPS)}, got {self.ops!r}.")
    if not 0 < self.test_fraction < 1:
      raise ValueError(f"task.test_fraction must be in (0, 1), got {self.test_fraction}.")

  @property
  def alphabet(self) -> str:
    """Every character a prompt or an answer can contain."""
    return "0123456789=" + "".join(sorted(set(self.ops) | {"-"}))

  def split_of(self, a: int, op: str, b: int) -> str:
    bucket = zlib.crc32(f"{a}{op}{b}".encode()) % 10_000
    return "test" if bucket < self.test_fraction * 10_000 else "train"

  def example(self, a: int, op: str, b: int) -> dict:
    return {"prompt": f"{a}{op}{b}=", "question": f"{a} {op} {b}", "answer": str(OPS[op](a, b))}

  def examples(self, split: str, n: int, seed: int) -> list[dict]:
    """`n` distinct problems of `split` ("train" or "test"), the same for the same seed."""
    if split not in ("train", "test"):
      raise ValueError(f"split must be 'train' or 'test', got {split!r}.")
    lo, hi = 10 ** (self.digits - 1) if self.digits > 1 else 0, 10**self.digits
    rng = np.random.default_rng(seed)
    if (hi - lo) ** 2 * len(self.ops) <= 1_000_000:  # small: enumerate the split, then shuffle
      pool = [
        (a, op, b)
        for op in self.ops
        for a in range(lo, hi)
        for b in range(lo, hi)
        if self.split_of(a, op, b) == split
      ]
      if n > len(pool):
        raise ValueError(
          f"{n} {split} problems requested but only {len(pool)} exist at "
          f"digits={self.digits}, ops={self.ops!r}; ask for fewer or raise "
          "task.digits."
        )
      return [self.example(*pool[i]) for i in rng.permutation(len(pool))[:n]]
    seen, out = set(), []
    while len(out) < n:
      a, b = (int(x) for x in rng.integers(lo, hi, size=2))
      op = self.ops[int(rng.integers(len(self.ops)))]
      if (a, op, b) in seen or self.split_of(a, op, b) != split:
        continue
      seen.add((a, op, b))
      out.append(self.example(a, op, b))
    return out
