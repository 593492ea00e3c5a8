"""Timing and reporting helpers shared by the benchmarks.

Every run appends one row to `results/<name>.jsonl` (with the date, the machine and the
commit), so a range quoted over several runs is a range over committed rows;
`python -m experiments.benchmarks.summarize` prints them.
"""

import json
import statistics
import time
from pathlib import Path

import jax

from experiments.lib import provenance

RESULTS = Path(__file__).parent / "results"
machine = provenance.machine


def time_fn(fn, *args, repeats=10, warmup=2):
  """Median wall time (s) of fn(*args) after `warmup` calls; blocks on JAX results."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def write_jsonl(path, row: dict) -> Path:
  """Appends `row` as one JSON line to `path`."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  with path.open("a") as f:
    f.write(json.dumps(row) + "\n")
  return path


def write_results(name: str, results: dict, stamp: dict | None = None) -> Path:
  """Appends `results`, stamped with date, machine and commit (now, or `stamp`: those taken
  when the run started), to results/<name>.jsonl."""
  return write_jsonl(RESULTS / f"{name}.jsonl", (stamp or provenance.stamp()) | results)


def read_results(name: str) -> list[dict]:
  path = RESULTS / f"{name}.jsonl"
  return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
