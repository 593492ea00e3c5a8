"""Timing and reporting helpers shared by the benchmarks."""

import json
import os
import platform
import statistics
import time
from pathlib import Path

import jax


def machine() -> str:
  """One line naming the hardware the figures came from."""
  cpu = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as f:
      cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  dev = jax.devices()[0]
  accel = "" if dev.platform == "cpu" else f", {len(jax.devices())} x {dev.device_kind}"
  return f"{cpu}, {os.cpu_count()} cores{accel}; jax {jax.__version__} on {dev.platform}"


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


def write_results(name: str, results: dict) -> Path:
  """Writes results with the machine name to experiments/benchmarks/results/<name>.json."""
  out = Path(__file__).parent / "results" / f"{name}.json"
  out.parent.mkdir(exist_ok=True)
  out.write_text(json.dumps({"machine": machine(), **results}, indent=2) + "\n")
  return out
