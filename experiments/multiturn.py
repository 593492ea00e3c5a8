"""The multi-turn tasks against their baselines, with the curves docs/multiturn.md shows.

  python -m experiments.multiturn [--tasks calculator,guess] [--seeds 2]

calculator: experiments/configs/tools_calculator.py, with the calculator tool and without it
(`use_tools=false`: calls get an error and the warm start only answers straight away).
guess: experiments/configs/tools_guess.py, with "higher"/"lower" replies and without
(`feedback=false`: every miss gets "?"). Each run starts from scratch in a temporary
directory (warm start, then GRPO); held-out greedy success is logged every 25 steps.
Writes experiments/results/multiturn/<task>.json (every run's curves and per-step
episode metrics) and <task>.png.
"""

import argparse
import importlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from experiments.benchmarks.common import machine
from experiments.lib import provenance
from jaxrl_llm.train import from_config_dict, train

OUT = Path(__file__).resolve().parent / "results" / "multiturn"
TASKS = {
  "calculator": ("experiments.configs.tools_calculator", {"use_tools": False}, "tool_call_rate"),
  "guess": ("experiments.configs.tools_guess", {"feedback": False}, "turns_per_episode"),
}
LABELS = {"calculator": ("with the tool", "no tool"), "guess": ("with feedback", "no feedback")}
LOGGED = (  # kept under their names without the group
  "rollout/accuracy",
  "rollout/reward_mean",
  "rollout/turns_per_episode",
  "rollout/tool_call_rate",
  "rollout/malformed_call_rate",
  "rollout/model_tokens_per_episode",
  "rollout/env_tokens_per_episode",
  "perf/step_time_s",
)


def run(module: str, baseline: dict | None, seed: int) -> dict:
  c = importlib.import_module(module).get_config()
  if baseline is not None:
    c.env.kwargs = json.dumps(json.loads(c.env.kwargs or "{}") | baseline)
  with tempfile.TemporaryDirectory() as workdir:
    c.run.update(seed=seed, workdir=workdir, progress=False)
    c.checkpoint.update(every=0)
    start = time.perf_counter()
    summary = train(from_config_dict(c))
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]
  evals = [[r["step"], r["eval/heldout_accuracy"]] for r in rows if "eval/heldout_accuracy" in r]
  return {
    "seed": seed,
    "env_kwargs": c.env.kwargs,
    "seconds": seconds,
    "before": summary["heldout_accuracy_before"],
    "after": summary["heldout_accuracy_after"],
    "eval_curve": [[0, summary["heldout_accuracy_before"]], *evals],
    "steps": {k.split("/", 1)[1]: [r.get(k) for r in rows] for k in LOGGED},
  }


def plot(task: str, results: dict, metric: str) -> Path:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
  styles = zip(results.items(), ("tab:blue", "tab:gray"), LABELS[task], strict=False)
  for (_, runs), color, label in styles:
    for i, r in enumerate(runs):
      steps, acc = zip(*r["eval_curve"], strict=True)
      left.plot(steps, acc, color=color, alpha=0.9, label=label if i == 0 else None)
      values = np.array([np.nan if v is None else v for v in r["steps"][metric]], float)
      right.plot(np.arange(1, len(values) + 1), values, color=color, alpha=0.6)
  left.set(xlabel="RL step", ylabel="held-out greedy success", title=f"{task}: success")
  right.set(xlabel="RL step", ylabel=metric, title=f"{task}: {metric} (training episodes)")
  left.legend()
  for ax in (left, right):
    ax.grid(alpha=0.3)
  fig.tight_layout()
  path = OUT / f"{task}.png"
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--tasks", default=",".join(TASKS))
  parser.add_argument("--seeds", type=int, default=2)
  parser.add_argument("--plot-only", action="store_true", help="redraw from the JSON files")
  args = parser.parse_args(argv)
  OUT.mkdir(parents=True, exist_ok=True)
  if args.plot_only:
    for task in args.tasks.split(","):
      results = json.loads((OUT / f"{task}.json").read_text())["runs"]
      print(plot(task, results, TASKS[task][2]))
    return
  for task in args.tasks.split(","):
    module, baseline_kwargs, metric = TASKS[task]
    results = {}
    for name, baseline in (("with", None), ("baseline", baseline_kwargs)):
      results[name] = []
      for seed in range(args.seeds):
        results[name].append(run(module, baseline, seed))
        r = results[name][-1]
        print(f"{task} {name} seed {seed}: {r['before']:.3f} -> {r['after']:.3f} "
              f"in {r['seconds']:.0f} s", flush=True)  # fmt: skip
    record = provenance.stamp() | {
      "command": f"python -m experiments.multiturn --tasks {task} --seeds {args.seeds}",
      "config": module.replace(".", "/") + ".py",
      "baseline_kwargs": baseline_kwargs,
      "machine": machine(),
      "runs": results,
    }
    (OUT / f"{task}.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"{task}: {OUT / f'{task}.json'}, {plot(task, results, metric)}", flush=True)


if __name__ == "__main__":
  main()
