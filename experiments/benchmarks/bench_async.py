"""Seconds per GRPO iteration, synchronous against asynchronous, in one run.

  python -m experiments.benchmarks.bench_async [--steps N] [--sampler 4]
  python -m experiments.benchmarks.bench_async --table   # the newest rows, as Markdown

The workload is bench_grpo_step's (a random-init Qwen2-shaped policy, hidden 256, 4
layers; 16 prompts x 8 samples of 16 new tokens; k3 KL to the reference in the loss;
float32), with token TIS as the mismatch correction, on 8 fake CPU devices.
It runs three ways:

  sync           on-policy; rollouts and updates take turns on all the devices
  sync_k1        rollout.off_policy_steps=1 on all the devices: the next rollout is
                 dispatched before the update, into the same device queues
  async_k1       rollout.mode=async: the sampler on `--sampler` devices with its own
                 params copy, the trainer on the rest, one step off-policy

For each: the median seconds per iteration after warm-up, iterations per second, and the
fraction of the iteration the trainer waited for its rollout (`timing/rollout_wait_s`: the time
until the producer handed over the scored batch, generation and scoring included, over
`step_time_s`). Appends one row per way to results/bench_async.jsonl.
"""

import argparse
import json
import statistics
import tempfile

import jax

jax.config.update("jax_num_cpu_devices", 8)

from experiments.benchmarks.bench_grpo_step import config  # noqa: E402
from experiments.benchmarks.common import machine, read_results, write_results  # noqa: E402
from jaxrl_llm.train import from_config_dict, train  # noqa: E402
from jaxrl_llm.train.checkpoint import config_dict  # noqa: E402

MODES = {
  "sync": {},
  "sync_k1": {"rollout.off_policy_steps": 1},
  "async_k1": {"rollout.off_policy_steps": 1, "rollout.mode": "async"},
}
WARMUP = 2


def run(mode: str, steps: int, sampler: int) -> dict:
  with tempfile.TemporaryDirectory() as workdir:
    raw = config_dict(config(steps, workdir))
    raw["algo"]["correction"] = "token_tis"
    raw["rollout"]["sampler_devices"] = sampler
    for key, value in MODES[mode].items():
      section, name = key.split(".")
      raw[section][name] = value
    summary = train(from_config_dict(raw))
    rows = [json.loads(line) for line in open(summary["metrics"])][WARMUP:]
  step = statistics.median(r["perf/step_time_s"] for r in rows)
  wait = statistics.median(r["timing/rollout_wait_s"] / r["perf/step_time_s"] for r in rows)
  return {
    "mode": mode,
    "trainer_mesh": summary["mesh"],
    "sampler_mesh": summary.get("sampler_mesh"),
    "steps_timed": len(rows),
    "seconds_per_iteration": step,
    "iterations_per_second": 1.0 / step,
    "trainer_wait_fraction": wait,
  }


def table(rows: list[dict]) -> str:
  """The newest run's rows as Markdown."""
  newest = [r for r in rows if r["date"] == rows[-1]["date"]] if rows else []
  lines = [
    "| mode | trainer devices | sampler devices | s / iteration | iterations / s | trainer waits |",
    "|---|---|---|---|---|---|",
  ]
  for r in newest:
    devices = lambda mesh: "-" if not mesh else str(mesh["data"] * mesh["fsdp"] * mesh["tensor"])
    lines.append(
      f"| {r['mode']} | {devices(r['trainer_mesh'])} | {devices(r['sampler_mesh'])} | "
      f"{r['seconds_per_iteration']:.3f} | {r['iterations_per_second']:.2f} | "
      f"{100 * r['trainer_wait_fraction']:.0f}% |"
    )
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--sampler", type=int, default=4, help="async: the sampler's devices")
  parser.add_argument("--no-write", action="store_true", help="print only")
  parser.add_argument("--table", action="store_true", help="print the newest rows as Markdown")
  args = parser.parse_args(argv)
  if args.table:
    print(table(read_results("bench_async")))
    return
  print(f"machine: {machine()}; jax {jax.__version__}, {jax.device_count()} devices")
  rows = []
  for mode in MODES:
    row = run(mode, args.steps, args.sampler) | {"devices": jax.device_count()}
    rows.append(row)
    print(
      f"{mode:9s} {row['seconds_per_iteration']:.3f} s/iteration "
      f"({row['iterations_per_second']:.2f}/s), trainer waits "
      f"{100 * row['trainer_wait_fraction']:.0f}% of it",
      flush=True,
    )
  if not args.no_write:
    for row in rows:
      path = write_results("bench_async", row)
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
  main()
