"""The README's planning table: each model shape on each target, compiled by the planner.

  python -m experiments.plan_table [--models qwen2.5-0.5b,...] [--targets v5e-8,...]
  python -m experiments.plan_table --table   # the committed rows, as Markdown

Workload: experiments/plan_grpo.py (GRPO with a reference model, 16 x 16 completions,
512 + 2048 tokens, bf16 compute over float32 master weights, scanned layers, chunked
log-probs and attention). Per row the mesh is FSDP over every chip, and the planner is run
with micro-batches of 16, 8, 4, 2 and 1 rows (more micro-batches: less memory per pass)
without remat, then with `model.remat=full`, until every program fits; the first setting
that fits is the row (or the last tried, marked as not fitting). The sampler's two programs
do not depend on either knob and are compiled once per row. Each row's full report is
written to results/plan/<model>_<target>.json, and one line per row appended to
results/plan/table.jsonl. These are compile-time figures, not timings.
"""

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments.benchmarks.common import machine  # noqa: E402
from experiments.plan_grpo import get_config  # noqa: E402
from jaxrl_llm import plan as plan_lib  # noqa: E402
from jaxrl_llm.plan import programs as programs_lib  # noqa: E402
from jaxrl_llm.train import from_config_dict  # noqa: E402

MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-8b"]
TARGETS = ["v5e-8", "v5e-16", "v5p-8", "v6e-8", "h100x8", "h200x8"]
MICRO_ROWS = [16, 8, 4, 2, 1]
OUT = Path(__file__).parent / "results" / "plan"
GiB = 2**30


def config(model: str, chips: int, micro_rows: int, remat: str):
  c = get_config()
  c.model.update(path=f"experiments/plan_models/{model}", remat=remat)
  c.mesh.update(data=-1, fsdp=chips)
  c.algo.update(micro_batches=c.rollout.prompts_per_step * c.rollout.group_size // micro_rows)
  return from_config_dict(c)


def plan_row(model: str, target_name: str) -> dict:
  target = plan_lib.resolve(target_name)
  devices = plan_lib.target_devices(target)
  start = time.perf_counter()
  log = lambda line: print(f"[{model} {target_name}] {line}", flush=True)
  first = config(model, target.devices, MICRO_ROWS[0], "none")
  model_cfg = programs_lib.model_config(first)
  run, sampler_rows = plan_lib.compile_run(
    first, target, devices, model_cfg, only=("prefill", "decode_step"), log=log
  )
  tried = []
  for remat in ("none", "full"):
    for rows in MICRO_ROWS:
      cfg = config(model, target.devices, rows, remat)
      log(f"micro-batches of {rows} rows, remat {remat}")
      _, train_rows = plan_lib.compile_run(
        cfg,
        target,
        devices,
        programs_lib.model_config(cfg),
        only=("experience", "update"),
        log=log,
      )
      fits = all(r["fits"] for r in train_rows)
      tried.append({"micro_batch_rows": rows, "remat": remat, "fits": fits})
      if fits:
        break
    if fits:
      break
  program_rows = sampler_rows + train_rows
  report = {
    "model": model,
    "target": target_name,
    "chip": target.chip.name,
    "devices": target.devices,
    "mesh": dict(run.mesh.shape),
    "micro_batch_rows": rows,
    "remat": remat,
    "tried": tried,
    "programs": program_rows,
    "state_bytes_per_chip": plan_lib.state_breakdown(run),
    "iteration": plan_lib.iteration(cfg, run, program_rows, target),
    "fits": all(r["fits"] for r in program_rows),
    "chip_hbm_bytes": target.chip.hbm_bytes,
    "chip_source": target.chip.source,
    "compile_s": round(time.perf_counter() - start, 1),
    "machine": machine(),
  }
  return report


def table(rows: list[dict]) -> str:
  newest = {(r["model"], r["target"]): r for r in rows}
  lines = [
    "| model | target | mesh (data, fsdp, tensor) | micro-batch rows | remat | peak per chip "
    "| HBM per chip | fits | est. iteration | MFU at that time |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for model in MODELS:
    for target in TARGETS:
      r = newest.get((model, target))
      if r is None:
        continue
      mesh = ", ".join(str(r["mesh"][k]) for k in ("data", "fsdp", "tensor"))
      it = r.get("iteration") or {}
      peaks = [p["peak_bytes"] for p in r["programs"] if "peak_bytes" in p]
      peak = f"{max(peaks) / GiB:.1f} GiB" if peaks else "-"
      if not r["fits"] and any("error" in p for p in r["programs"]):
        peak = "refused by the compiler"
      est = f"{it['estimate_s']:.0f} s" if it else "-"
      mfu = f"{100 * it['mfu']:.0f}%" if it else "-"
      lines.append(
        f"| {model} | {target} | {mesh} | {r['micro_batch_rows']} | {r['remat']} | {peak} "
        f"| {r['chip_hbm_bytes'] / GiB:.0f} GiB | {'yes' if r['fits'] else 'no'} | {est} | {mfu} |"
      )
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--targets", default=",".join(TARGETS))
  parser.add_argument("--table", action="store_true", help="print the committed rows")
  args = parser.parse_args()
  OUT.mkdir(parents=True, exist_ok=True)
  if args.table:
    rows = [json.loads(line) for line in (OUT / "table.jsonl").read_text().splitlines()]
    print(table(rows))
    return
  for model in args.models.split(","):
    for target in args.targets.split(","):
      report = plan_row(model, target)
      (OUT / f"{model}_{target}.json").write_text(json.dumps(report, indent=2))
      with open(OUT / "table.jsonl", "a") as f:
        summary = {k: v for k, v in report.items() if k != "programs"}
        summary["programs"] = [
          {k: p.get(k) for k in ("program", "peak_bytes", "fits", "roofline_s", "error")}
          for p in report["programs"]
        ]
        f.write(json.dumps(summary) + "\n")
      print(table([summary]).splitlines()[-1], flush=True)


if __name__ == "__main__":
  main()
