"""A seeded ablation grid from one command, and its report (tables and plots).

  python -m experiments.ablate --suite grpo_vs_ppo --seeds 3
  python -m experiments.ablate --suite grpo_vs_ppo --seeds 1 --smoke --out /tmp/smoke

For each task and seed the runner warm-starts one policy (supervised, on labelled
problems, from the seed's own initialisation and data order) and exports it; every method
of that seed then starts from that policy (`model.path`), so the methods share their
starts seed by seed and the intervals over seeds include how much the warm start moves
the outcome. Each run is `python -m jaxrl_llm.train --config
experiments/configs/ablation/<method>.py` in its own process, under
`<out>/runs/<task>/<method>/seed<k>/`. The grid is resumable: a run with a
`summary.json` is done and skipped, a killed run resumes from its checkpoints. When
the grid is done, `<out>/results.json` collects what the report needs, and
`<out>/report.md` and its PNG plots are written from it (`--report-only` redoes just
that).
"""

import argparse
import concurrent.futures
import datetime
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from experiments.lib import claims, provenance
from experiments.lib import runs as launch
from experiments.lib.suites import SMOKE, SUITES, Suite

REPO = Path(__file__).resolve().parents[1]
FINAL_FRACTION = 0.1  # "final" KL, entropy, lengths, clip fraction: the mean over the last 10%


def warm_start(out: Path, suite: Suite, name: str, smoke: bool, seed: int = 0) -> Path:
  """The task's warm-started policy for RL seed `seed` as a Hugging Face directory (made
  once): supervised from its own initialisation and data order (`run.seed=seed`), so the
  spread over seeds includes the warm start's. A task without warm-start steps starts
  every seed from the one exported base model."""
  spec = suite.tasks[name]
  seed = seed if spec.warm_steps else 0
  if (out / "runs" / name / "warmstart" / "hf").exists():
    raise SystemExit(
      f"{out / 'runs' / name} holds runs warm-started once per task (warmstart/hf), not once "
      f"per seed: move or delete {out / 'runs'} and run the grid again."
    )
  workdir = out / "runs" / name / "warmstart" / f"seed{seed}"
  hf = workdir / "hf"
  if (hf / "config.json").exists():
    return hf
  settings = spec.overrides | {
    "run.seed": seed,
    "warmstart.steps": min(5, spec.warm_steps) if smoke else spec.warm_steps,
    "warmstart.examples": 64 if smoke else spec.warm_examples,
    "run.steps": 0,
    "checkpoint.every": 100,  # the warm-started policy is exported from its checkpoint
    "run.eval_examples": SMOKE["run.eval_examples"] if smoke else 256,
    "run.progress": False,
    "run.workdir": workdir,
  }
  base = [sys.executable, "-m", "jaxrl_llm.train", "--config", suite.config(suite.base)]
  launch.run(base + launch.flags(settings), workdir / "log.txt", out)
  export = [sys.executable, "-m", "jaxrl_llm.export", "--checkpoint", str(workdir)]
  launch.run(export + ["--out", str(hf)], workdir / "log.txt", out)
  return hf


def run_one(
  out: Path, suite: Suite, task: str, method: str, seed: int, hf: Path, smoke: bool
) -> bool:
  """Runs (or resumes) one cell of the grid; False when it was already done."""
  workdir = out / "runs" / task / method / f"seed{seed}"
  settings = suite.tasks[task].overrides | {
    "model.path": hf,
    "run.seed": seed,
    "run.steps": suite.steps_of(task),
    "run.progress": False,
    "run.workdir": workdir,
  }
  settings |= SMOKE if smoke else {}
  if launch.is_done(workdir, settings["run.steps"]):
    return False
  config = suite.config(f"experiments/configs/ablation/{method}.py")
  base = [sys.executable, "-m", "jaxrl_llm.train", "--config", config]
  launch.run(base + launch.flags(settings), workdir / "log.txt", out, suite.env)
  return True


# ----------------------------------------------------------------------------- results


def _rows(workdir: Path) -> list[dict]:
  return [json.loads(line) for line in (workdir / "metrics.jsonl").open()]


def _final(rows: list[dict], key: str, first: bool = False) -> float | None:
  """The mean of `key` over the last (`first`: the first) 10% of the steps."""
  n = max(1, math.ceil(FINAL_FRACTION * len(rows)))
  window = rows[:n] if first else rows[-n:]
  values = [r[key] for r in window if r.get(key) is not None]
  return float(np.mean(values)) if values else None


def _drawdown(accuracies) -> float:
  """The largest fall of held-out accuracy below its best so far (0: it never fell)."""
  acc = np.asarray(accuracies, float)
  return float(np.max(np.maximum.accumulate(acc) - acc)) if len(acc) else 0.0


def _variation(rows: list[dict], key: str) -> float | None:
  """The coefficient of variation of `key` over the steps (std / mean)."""
  values = np.array([r[key] for r in rows if r.get(key) is not None], float)
  return float(values.std() / values.mean()) if len(values) > 1 and values.mean() else None


def _downsample(steps, values, points: int = 60):
  """Window means, so a curve of thousands of steps stays small in results.json."""
  if len(steps) <= points:
    return [int(s) for s in steps], [float(v) for v in values]
  edges = np.linspace(0, len(steps), points + 1).astype(int)
  return (
    [int(steps[b - 1]) for a, b in zip(edges[:-1], edges[1:], strict=True)],
    [float(np.nanmean(values[a:b])) for a, b in zip(edges[:-1], edges[1:], strict=True)],
  )


def collect_run(workdir: Path, target: float) -> dict:
  summary = json.loads((workdir / "summary.json").read_text())
  rows = _rows(workdir)
  elapsed = np.cumsum([r["perf/step_time_s"] for r in rows])
  sampled = np.cumsum([r.get("rollout/completions_sampled", 0) for r in rows])
  evals = [(int(r["step"]), r["eval/heldout_accuracy"], float(elapsed[i]), int(sampled[i]))
           for i, r in enumerate(rows) if r.get("eval/heldout_accuracy") is not None]  # fmt: skip
  reached = next(((s, t) for s, a, t, _ in evals if a >= target), None)
  steps = np.array([r["step"] for r in rows])
  lengths = np.array([r["rollout/response_length_mean"] for r in rows], float)
  curve = lambda key: [  # noqa: E731
    list(x)
    for x in zip(
      *_downsample(steps, np.array([r.get(key, np.nan) for r in rows], float)), strict=True
    )
  ]
  accuracies = [summary["heldout_accuracy_before"]] + [a for _, a, _, _ in evals]
  clip = [
    {
      "step": r["step"],
      "clipfrac": (r.get("train/clipfrac_low") or 0) + (r.get("train/clipfrac_high") or 0),
    }
    for r in rows
  ]
  return {
    "before": summary["heldout_accuracy_before"],
    "after": summary["heldout_accuracy_after"],
    "train_seconds": float(elapsed[-1]) if len(elapsed) else 0.0,
    "steps_to_target": None if reached is None else reached[0],
    "seconds_to_target": None if reached is None else reached[1],
    "eval_curve": [[0, summary["heldout_accuracy_before"]]] + [[s, a] for s, a, _, _ in evals],
    "eval_curve_seconds": [[0.0, summary["heldout_accuracy_before"]]]
    + [[t, a] for _, a, t, _ in evals],
    "eval_curve_samples": [[0, summary["heldout_accuracy_before"]]]
    + [[n, a] for _, a, _, n in evals if n],
    "length_curve": [list(x) for x in zip(*_downsample(steps, lengths), strict=True)],
    "length_wrong_curve": curve("rollout/response_length_wrong"),
    "entropy_curve": curve("train/entropy"),
    "steps_run": len(rows),
    "samples": int(sampled[-1]) if len(sampled) else 0,
    "drawdown": _drawdown(accuracies),
    "grad_norm_cv": _variation(rows, "train/grad_norm"),
    "initial": {
      "entropy": _final(rows, "train/entropy", first=True),
      "length_correct": _final(rows, "rollout/response_length_correct", first=True),
      "length_wrong": _final(rows, "rollout/response_length_wrong", first=True),
    },
    "final": {
      "kl": _final(rows, "train/kl_ref_k3"),
      "entropy": _final(rows, "train/entropy"),
      "length_correct": _final(rows, "rollout/response_length_correct"),
      "length_wrong": _final(rows, "rollout/response_length_wrong"),
      "clipfrac": _final(clip, "clipfrac"),
      "train_accuracy": _final(rows, "rollout/accuracy"),
    },
  }


def collect(out: Path, suite: Suite, seeds: int, methods=None) -> dict:
  runs = {}
  for task, spec in suite.tasks.items():
    for method in methods or suite.methods:
      for seed in range(seeds):
        workdir = out / "runs" / task / method / f"seed{seed}"
        runs[f"{task}/{method}/{seed}"] = collect_run(workdir, spec.target)
  return runs


# ----------------------------------------------------------------------------- report


def mean_ci(values) -> tuple[float, float | None]:
  """Mean and the half-width of its 95% Student-t interval (None for one value)."""
  values = np.asarray([v for v in values if v is not None], float)
  if len(values) == 0:
    return math.nan, None
  if len(values) == 1:
    return float(values[0]), None
  t = claims._t975(len(values) - 1)
  return float(values.mean()), float(t * values.std(ddof=1) / math.sqrt(len(values)))


def _fmt(value, digits=3):
  return (
    "–"
    if value is None or (isinstance(value, float) and math.isnan(value))
    else f"{value:.{digits}f}"
  )


def _starts(results: dict, task: str) -> str:
  """The heading's line on the task's warm-started policies: each seed's held-out accuracy
  where each seed had its own (`meta["warm_start"] == "per seed"`), else the mean over the
  seeds' held-out sets of the one policy (grids run before warm starts were per seed)."""
  befores = {}
  for key, run in results["runs"].items():
    name, _, seed = key.split("/")
    if name == task:
      befores.setdefault(int(seed), run["before"])
  if results["meta"].get("warm_start") != "per seed":
    return f"Warm-started policy: held-out accuracy {_fmt(mean_ci(befores.values())[0])}."
  each = ", ".join(f"{_fmt(befores[k])} (seed {k})" for k in sorted(befores))
  return f"Warm-started policies, one per seed: held-out accuracy {each}."


def plot(results: dict, suite: Suite, out: Path) -> list[str]:
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  files = []
  colors = dict(zip(suite.methods, plt.cm.tab20.colors, strict=False))
  for task in suite.tasks:
    for kind, key, xlabel, ylabel in (
      ("accuracy", "eval_curve", "RL step", "held-out greedy accuracy"),
      ("accuracy_time", "eval_curve_seconds", "training seconds", "held-out greedy accuracy"),
      ("accuracy_samples", "eval_curve_samples", "completions sampled", "held-out greedy accuracy"),
      ("accuracy_gain", "eval_curve", "RL step", "held-out accuracy minus the run's start"),
      ("length", "length_curve", "RL step", "mean response length (tokens, training samples)"),
      ("length_wrong", "length_wrong_curve", "RL step", "length of wrong training samples"),
      ("entropy", "entropy_curve", "RL step", "entropy per token (training samples)"),
    ):
      if not all(len(v.get(key) or ()) > 1 for v in results["runs"].values()):
        continue  # results from before the curve was recorded
      fig, ax = plt.subplots(figsize=(7, 4.2))
      for method in suite.methods:
        curves = [v[key] for v in claims.method_runs(results, task, method)]
        if not curves or not curves[0]:
          continue
        n = min(len(c) for c in curves)
        steps = np.array([[p[0] for p in c[:n]] for c in curves], float).mean(0)  # seconds vary
        values = np.array([[p[1] for p in c[:n]] for c in curves], float)
        if kind == "accuracy_gain":  # each seed's own warm start taken out: the method's effect
          values -= values[:, :1]
        ax.plot(steps, values.mean(0), label=method, color=colors[method])
        if len(curves) > 1:
          ax.fill_between(steps, values.min(0), values.max(0), alpha=0.15, color=colors[method])
      ax.set_xlabel(xlabel if kind != "accuracy_time" else f"{xlabel} (mean over seeds)")
      ax.set_ylabel(ylabel)
      ax.set_title(f"{task}: {ylabel} (mean; band: min-max over seeds)", fontsize=10)
      ax.grid(alpha=0.3)
      ax.legend(fontsize=8, ncol=2)
      fig.tight_layout()
      name = f"{task}_{kind}.png"
      fig.savefig(out / name, dpi=110)
      plt.close(fig)
      files.append(name)
  return files


def _dynamics_table(results: dict, suite: Suite, task: str) -> list[str]:
  """Budget and training dynamics per method: what the claims below are decided on."""
  lines = [
    "",
    "Budget and dynamics (means over seeds): optimizer steps taken and completions sampled; "
    "entropy and the length of wrong samples over the first and the last 10% of steps; the "
    "largest fall of held-out accuracy below its best so far; the coefficient of variation "
    "of the gradient norm over steps.",
    "",
    "| method | steps | completions | entropy first → last | wrong length first → last "
    "| drawdown | grad-norm CV |",
    "|---|---|---|---|---|---|---|",
  ]
  for method in suite.methods:
    runs = claims.method_runs(results, task, method)
    m = {
      key: mean_ci(get(r) for r in runs)[0]
      for key, get in {
        "steps": lambda r: r["steps_run"],
        "samples": lambda r: r["samples"],
        "h0": lambda r: r["initial"]["entropy"],
        "h1": lambda r: r["final"]["entropy"],
        "w0": lambda r: r["initial"]["length_wrong"],
        "w1": lambda r: r["final"]["length_wrong"],
        "drawdown": lambda r: r["drawdown"],
        "cv": lambda r: r["grad_norm_cv"],
      }.items()
    }
    lines.append(
      f"| {method} | {_fmt(m['steps'], 0)} | {_fmt(m['samples'], 0)} | {_fmt(m['h0'])} → "
      f"{_fmt(m['h1'])} | {_fmt(m['w0'], 2)} → {_fmt(m['w1'], 2)} | {_fmt(m['drawdown'])} "
      f"| {_fmt(m['cv'])} |"
    )
  return lines + [""]


def report(results: dict, suite: Suite, out: Path) -> Path:
  plots = plot(results, suite, out)
  meta = results["meta"]
  lines = [
    f"# Ablation `{meta['suite']}`",
    "",
    suite.description,
    "",
    f"- Command: `{meta['command']}`",
    f"- Machine: {meta['machine']}; code: commit {meta.get('commit', 'not recorded')}"
    + (
      f" (results collected and reported at {meta['collected_by']})"
      if "collected_by" in meta
      else ""
    ),
    f"- Seeds: {meta['seeds']}; {suite.steps if not meta['smoke'] else SMOKE['run.steps']} "
    f"RL steps per run; grid wall time {meta['wall_minutes']:.1f} min ({meta['jobs']} "
    f"{'run' if meta['jobs'] == 1 else 'runs'} at a time)"
    + (
      f", for the {meta['executed']} of {meta['grid']} runs this invocation ran (the others "
      "were done by an earlier, interrupted one)."
      if meta.get("executed") is not None and meta["executed"] < meta["grid"]
      else "."
    ),
    *[
      f"- Rerun of {', '.join(r['methods'])} at commit {r['commit']} ({r['date']}, "
      f"{r['machine']}; {r['wall_minutes']:.1f} min): `{r['command']}`"
      for r in meta.get("reruns", [])
    ],
    f"- Generated {meta['date']} by `experiments/ablate.py` from `results.json`.",
    "" if not meta["smoke"] else "- **Smoke run**: 2 steps per method; the numbers mean nothing.",
    "",
    "Columns: final held-out greedy accuracy (mean ± 95% Student-t interval over seeds; the "
    "warm-started policies' are in the heading); the first evaluation step at which held-out "
    "accuracy reached the target, and the training seconds until then (mean over the seeds "
    "that reached it); then means over the last 10% of steps of: KL to the starting policy "
    "(k3, summed per sequence), entropy per token, response length of correct and of wrong "
    "training samples (Dr. GRPO's length-bias signal), and clip fraction.",
    "",
  ]
  for task, spec in suite.tasks.items():
    lines += [
      f"## {task}: {spec.description}",
      "",
      f"{_starts(results, task)} Target: {spec.target}.",
      "",
      "| method | final accuracy | steps to target | seconds to target | KL | entropy "
      "| length correct | length wrong | clip fraction |",
      "|---|---|---|---|---|---|---|---|---|",
    ]
    for method in suite.methods:
      runs = claims.method_runs(results, task, method)
      acc, ci = mean_ci(r["after"] for r in runs)
      reached = [r for r in runs if r["steps_to_target"] is not None]
      steps = mean_ci(r["steps_to_target"] for r in reached)[0] if reached else None
      secs = mean_ci(r["seconds_to_target"] for r in reached)[0] if reached else None
      final = {k: mean_ci(r["final"][k] for r in runs)[0] for k in runs[0]["final"]}
      lines.append(
        f"| {method} | {_fmt(acc)} ± {_fmt(ci)} "
        f"| {_fmt(steps, 0)} ({len(reached)}/{len(runs)}) | {_fmt(secs, 1)} "
        f"| {_fmt(final['kl'])} | {_fmt(final['entropy'])} | {_fmt(final['length_correct'], 2)} "
        f"| {_fmt(final['length_wrong'], 2)} | {_fmt(final['clipfrac'], 4)} |"
      )
    if suite.claims:
      lines += _dynamics_table(results, suite, task) + claims.section(results, task)
    lines += [""] + [f"![{name}]({name})" for name in plots if name.startswith(task + "_")] + [""]
  path = out / "report.md"
  path.write_text("\n".join(lines))
  return path


def merged(previous: Path, meta: dict, fresh: dict, methods, why: str) -> dict:
  """The grid's results with `methods`' cells replaced by `fresh` ones, the rerun recorded.

  Every fresh cell must start where the cells it joins started (the same warm-started
  held-out accuracy per task and seed), or the grid would compare runs from different
  policies: then it stops, and the whole grid is the thing to rerun."""
  if not previous.exists():
    raise SystemExit(f"--methods replaces cells of {previous}, which does not exist; run the grid.")
  results = json.loads(previous.read_text())
  if (results["meta"]["seeds"], results["meta"]["smoke"]) != (meta["seeds"], meta["smoke"]):
    raise SystemExit(f"--methods: {previous} holds another grid (seeds, smoke); run it whole.")
  if results["meta"].get("warm_start") != meta.get("warm_start"):
    raise SystemExit(
      f"--methods: {previous} was warm-started once per task and these cells once per seed; "
      "rerun the whole grid."
    )
  starts = {}
  for key, run in results["runs"].items():
    task, _, seed = key.split("/")
    starts.setdefault((task, seed), run["before"])
  for key, run in fresh.items():
    task, _, seed = key.split("/")
    if (task, seed) in starts and run["before"] != starts[(task, seed)]:
      raise SystemExit(
        f"--methods: {key} starts from held-out accuracy {run['before']}, the grid's cells of "
        f"{task} seed {seed} from {starts[(task, seed)]}: not the same warm-started policy. "
        "Rerun the whole grid."
      )
  results["runs"] |= fresh
  rerun = {k: meta[k] for k in ("command", "commit", "date", "machine", "wall_minutes")}
  results["meta"].setdefault("reruns", []).append(rerun | {"methods": list(methods), "why": why})
  return results


# ----------------------------------------------------------------------------- main


def main(argv=None) -> Path:
  parser = argparse.ArgumentParser(prog="python -m experiments.ablate", description=__doc__)
  parser.add_argument("--suite", default="grpo_vs_ppo", choices=sorted(SUITES))
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--jobs", type=int, default=2, help="runs at a time (processes)")
  parser.add_argument("--smoke", action="store_true", help="2 steps per method (CI)")
  parser.add_argument("--out", type=Path, default=None, help="default experiments/results/<suite>")
  parser.add_argument("--report-only", action="store_true", help="rewrite the report from results")
  parser.add_argument(
    "--methods",
    default="",
    help="comma-separated: rerun only these methods' cells and replace them in the existing "
    "results.json (the others' runs need not be on disk); with --why",
  )
  parser.add_argument("--why", default="", help="with --methods: why they were rerun (reported)")
  args = parser.parse_args(argv)
  if args.seeds < 1 or args.jobs < 1:
    parser.error("--seeds and --jobs must be >= 1")
  suite = SUITES[args.suite]
  methods = tuple(m for m in args.methods.split(",") if m)
  unknown = sorted(set(methods) - set(suite.methods))
  if unknown:
    parser.error(f"--methods: {', '.join(unknown)} not in suite {args.suite!r} ({suite.methods})")
  if methods and not args.why:
    parser.error("--methods needs --why: the report says why those cells were rerun")
  out = (args.out or REPO / "experiments" / "results" / args.suite).resolve()
  out.mkdir(parents=True, exist_ok=True)
  if args.report_only:
    results = json.loads((out / "results.json").read_text())
    print(f"report: {report(results, suite, out)}")
    return out / "report.md"
  start = time.monotonic()
  if suite.prepare is not None:
    suite.prepare()
  starts = [(name, seed) for name in suite.tasks for seed in range(args.seeds)]
  with tqdm(total=len(starts), desc="warm starts", unit="policy") as bar:
    policies = {}
    for name, seed in starts:
      policies[name, seed] = warm_start(out, suite, name, args.smoke, seed)
      bar.update()
  cells = methods or suite.methods
  grid = [(t, m, s) for t in suite.tasks for m in cells for s in range(args.seeds)]
  with (
    concurrent.futures.ThreadPoolExecutor(args.jobs) as pool,
    tqdm(total=len(grid), desc=f"{args.suite} grid", unit="run") as bar,
  ):
    futures = {
      pool.submit(run_one, out, suite, t, m, s, policies[t, s], args.smoke): (t, m, s)
      for t, m, s in grid
    }
    executed = 0
    for future in concurrent.futures.as_completed(futures):
      executed += future.result()  # a failed run stops the grid with its log's tail
      t, m, s = futures[future]
      bar.set_postfix_str(f"{t}/{m}/seed{s}")
      bar.update()
  meta = {
    "suite": args.suite,
    "seeds": args.seeds,
    "smoke": args.smoke,
    "jobs": args.jobs,
    "command": "python -m experiments.ablate " + " ".join(argv or sys.argv[1:]),
    "machine": provenance.machine(),
    "commit": provenance.commit(),
    "date": datetime.date.today().isoformat(),
    "wall_minutes": (time.monotonic() - start) / 60,
    "executed": executed,
    "grid": len(grid),
    "warm_start": "per seed",
  }
  previous = out / "results.json"
  if methods:
    results = merged(previous, meta, collect(out, suite, args.seeds, methods), methods, args.why)
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    path = report(results, suite, out)
    print(f"report: {path}")
    return path
  if not executed and previous.exists():  # nothing ran: keep when and how the grid did run
    old = json.loads(previous.read_text())["meta"]
    if (old["seeds"], old["smoke"]) == (args.seeds, args.smoke):
      keep = ("command", "commit", "date", "wall_minutes", "jobs", "machine")
      meta |= {k: old[k] for k in keep if k in old} | {"executed": old.get("executed")}
      if meta["commit"] != provenance.commit():  # the runs' code, and the report's
        meta["collected_by"] = provenance.commit()
  results = {"meta": meta, "runs": collect(out, suite, args.seeds)}
  (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
  path = report(results, suite, out)
  print(f"report: {path}")
  return path


if __name__ == "__main__":
  main()
