"""The math-verify worker of `jaxrl_llm.rewards.equivalence`, run as a script (so that it
imports nothing of jaxrl_llm or jax): it limits its own address space, then answers one
JSON line {"score": 0.0 | 1.0} per JSON line {"text", "gold"} on stdin.

  python _verify_worker.py MEMORY_MB TIMEOUT_S
"""

import os
import sys

# Run by path, the script's directory leads sys.path, and its neighbour math.py would
# shadow the standard library's math: drop it before importing anything else.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

import json  # noqa: E402
import resource  # noqa: E402


def main(memory_mb: int, timeout_s: int) -> None:
  limit = memory_mb * 2**20
  resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  from math_verify import parse, verify

  print("ready", flush=True)
  for line in sys.stdin:
    request = json.loads(line)
    try:  # math-verify's own SIGALRM timeouts first; the parent kills what they miss
      gold = parse(request["gold"], parsing_timeout=timeout_s)
      guess = parse(request["text"], parsing_timeout=timeout_s)
      ok = bool(gold) and bool(guess) and verify(gold, guess, timeout_seconds=timeout_s)
    except (KeyboardInterrupt, SystemExit):
      raise
    except BaseException:  # noqa: BLE001 (its TimeoutException, MemoryError, parse errors)
      ok = False
    print(json.dumps({"score": float(ok)}), flush=True)


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]))
