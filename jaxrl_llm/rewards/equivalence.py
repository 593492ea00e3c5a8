"""Mathematical equivalence with math-verify, kept away from the trainer's process.

`MathVerifyReward()` scores a completion 1.0 when math-verify finds its final answer
equal to the example's (`\\frac{1}{2}` and `0.5`, `\\sqrt{4}` and `2`), else 0.0.

math-verify parses LaTeX into sympy objects and compares them; it never runs model text as
code (its expression parser only sees digits and operators), but sympy work on hostile text
can take unbounded time and memory: a power tower `9^{9^{9^9}}`, `\\operatorname{zeros}` of a
huge size, `simplify` of a crafted equation. Its own timeout is a SIGALRM that C code may
not honour. So every call runs in a worker process that limits its own address space
(RLIMIT_AS) before reading any input, and the trainer kills it when one completion takes
longer than `timeout_s`: that completion scores 0.0 and a fresh worker takes the rest.

  pip install 'jaxrl_llm[math]'    # math-verify and its LaTeX parser
"""

import importlib.util
import json
import select
import subprocess
import sys
from pathlib import Path

from jaxrl_llm.rewards.math import MAX_CHARS, extract_answer

WORKER = Path(__file__).with_name("_verify_worker.py")  # run by path: imports no jaxrl_llm


def available() -> bool:
  return importlib.util.find_spec("math_verify") is not None


class MathVerifyReward:
  """A reward function (completions, examples) -> floats, backed by one worker process.

  `timeout_s`: the wall-clock limit per completion; `memory_mb`: the worker's address-space
  limit; `max_chars`: how much of a completion's tail is sent. `timeouts` counts the
  completions the worker was killed on.
  """

  __name__ = "math_verify"

  def __init__(self, timeout_s: float = 5.0, memory_mb: int = 2048, max_chars: int = 4000):
    self._proc = None  # first: __del__ runs even when the checks below raise
    if not available():
      raise ImportError(
        "the math_verify reward needs math-verify: pip install 'jaxrl_llm[math]' "
        "(or set config.task.reward='exact_match')."
      )
    self.timeout_s, self.memory_mb, self.max_chars = timeout_s, memory_mb, min(max_chars, MAX_CHARS)
    self.timeouts = 0

  def _worker(self) -> subprocess.Popen:
    if self._proc is None or self._proc.poll() is not None:
      self._proc = subprocess.Popen(
        [sys.executable, str(WORKER), str(self.memory_mb), str(max(int(self.timeout_s / 3), 1))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        bufsize=1,
      )
      if self._readline(self._proc, 120.0) != "ready\n":  # printed after its imports
        self._kill()
        raise RuntimeError(
          f"the math-verify worker ({WORKER}) did not start within its {self.memory_mb} MB; "
          "raise memory_mb, or check that math-verify imports (python -c 'import math_verify')."
        )
    return self._proc

  @staticmethod
  def _readline(proc, timeout_s: float) -> str | None:
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    return proc.stdout.readline() if ready else None

  def _kill(self):
    if self._proc is not None:
      self._proc.kill()
      self._proc.wait()
      self._proc = None

  def score_one(self, completion: str, gold: str) -> float:
    proc = self._worker()
    try:
      proc.stdin.write(json.dumps({"text": completion[-self.max_chars :], "gold": gold}) + "\n")
      proc.stdin.flush()
      line = self._readline(proc, self.timeout_s)
    except (BrokenPipeError, OSError):
      line = None
    if not line:  # too slow, or the worker died (out of memory): this completion gets 0
      self.timeouts += 1
      self._kill()
      return 0.0
    return float(json.loads(line)["score"])

  def __call__(self, completions, examples) -> list[float]:
    out = []
    for text, example in zip(completions, examples, strict=True):
      gold = str(example["answer"])
      gold = extract_answer(gold) or gold  # a GSM8K solution's '#### 72', or the answer itself
      out.append(self.score_one(text, gold))
    return out

  def close(self):
    self._kill()

  def __del__(self):
    self._kill()
