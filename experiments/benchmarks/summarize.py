"""The committed benchmark rows at a glance: each figure's latest value and its range.

  python -m experiments.benchmarks.summarize [--since 2026-12-01] [--machine "AMD EPYC"]

Reads results/*.jsonl (one row per benchmark run) and experiments/results/default_run.jsonl;
prints, for the rows dated on or after `--since` whose machine contains `--machine`, the
number of runs and the min, median and max of every figure the README quotes.
"""

import argparse
import json
import statistics
from pathlib import Path

from experiments.benchmarks.common import RESULTS, read_results

FIGURES = {
  "bench_grpo_step": (
    "jax_s_per_iteration",
    "trl_fastest_s_per_iteration",
    "trl_default_s_per_iteration",
    "tunix_s_per_iteration",
    "speedup_vs_trl",
    "speedup_vs_tunix",
    "jax_mfu",
  ),
  "bench_sampler": (
    "jax_tokens_per_s",
    "speedup_vs_transformers_fastest",
    "speedup_vs_tunix",
    "roofline_fraction",
    "jax_decode_step_ms",
  ),
  "bench_core": (
    "gae_jax_ms",
    "gae_speedup",
    "loss_grad_jax_ms",
    "loss_grad_speedup",
    "loss_grad_jax_total_mb",
  ),
}
DEFAULT_RUN = Path(__file__).resolve().parents[1] / "results" / "default_run.jsonl"


def _select(rows, since, machine, **where):
  return [
    r
    for r in rows
    if r.get("date", "") >= since
    and machine in r.get("machine", "")
    and all(r.get(k) == v for k, v in where.items())
  ]


def _line(name, rows, key):
  values = [r[key] for r in rows if isinstance(r.get(key), int | float)]
  if not values:
    return None
  lo, mid, hi = min(values), statistics.median(values), max(values)
  return f"  {name}.{key}: {len(values)} runs, min {lo:.4g}, median {mid:.4g}, max {hi:.4g}"


def summarize(since: str = "", machine: str = "") -> list[str]:
  out = []
  for name, keys in FIGURES.items():
    rows = read_results(name)
    groups = {"": rows} if name != "bench_sampler" else {}
    for dtype in ("float32", "bfloat16") if name == "bench_sampler" else ():
      groups[f"[{dtype}]"] = [r for r in rows if r.get("dtype") == dtype]
    for suffix, group in groups.items():
      picked = _select(group, since, machine)
      out.extend(line for key in keys if (line := _line(name + suffix, picked, key)))
  if DEFAULT_RUN.exists():
    rows = _select([json.loads(x) for x in DEFAULT_RUN.read_text().splitlines()], since, machine)
    for key in ("heldout_accuracy_before", "heldout_accuracy_after", "train_seconds"):
      if line := _line("default_run", rows, key):
        out.append(line)
  return out


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--since", default="", help="ISO date; rows dated before are left out")
  parser.add_argument("--machine", default="", help="keep rows whose machine contains this")
  args = parser.parse_args(argv)
  print(f"rows in {RESULTS} and {DEFAULT_RUN}:")
  print("\n".join(summarize(args.since, args.machine)) or "  none")


if __name__ == "__main__":
  main()
