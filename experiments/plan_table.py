"""The planning table of docs/planning.md: each model shape on each target, compiled by the planner.

  python -m experiments.plan_table [--models qwen2.5-0.5b,...] [--targets v5e-8,...]
  python -m experiments.plan_table --table   # the committed rows, as Markdown
  python -m experiments.plan_table --finetune full,lora,qlora --models qwen2.5-7b,llama-3.1-8b \
      --targets v5e-8,h100x1                  # LoRA and QLoRA against full fine-tuning
  python -m experiments.plan_table --table lora
  python -m experiments.plan_table --out DIR ...  # rows into another results folder
  python -m experiments.plan_table --table --compare experiments/results/plan/before_decode_layout

Workload: experiments/configs/plan_grpo.py (GRPO with a reference model, 16 x 16 completions,
512 + 2048 tokens, bf16 compute over float32 master weights, scanned layers, chunked
log-probs and attention). Per row the mesh is FSDP over every chip and a micro-batch holds
one row per chip (the smallest that still splits over the mesh). The update step, the
program that needs the most memory, is compiled without remat, then with
`model.remat=full`, then with the log-probs' vocabulary-sized chunk halved and quartered,
until it fits; the first setting that fits is the row (or the last tried, marked as not
fitting). A run whose train state alone exceeds the chip's HBM is compiled once, with
remat. The sampler and the experience pass are then compiled at the chosen setting. Each
row's full report is written to results/plan/<model>_<target>.json, and one line per row
appended to results/plan/table.jsonl. These are compile-time figures, not timings.

`--finetune lora` trains rank-16 adapters (alpha 32) on every projection of a frozen bfloat16
base, whose reference is the base itself; `qlora` stores that base as nf4 (tiles of 64).
Their rows go to results/plan/<model>_<target>_<finetune>.json and lora_table.jsonl.
"""

import argparse
import json
import os
import re
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments.benchmarks.common import machine  # noqa: E402
from experiments.configs.plan_grpo import get_config  # noqa: E402
from jaxrl_llm import plan as plan_lib  # noqa: E402
from jaxrl_llm.plan import programs as programs_lib  # noqa: E402
from jaxrl_llm.train import from_config_dict  # noqa: E402

MODELS = ["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-8b"]
TARGETS = ["v5e-8", "v5e-16", "v5p-8", "v6e-8", "h100x8", "h200x8"]
CHUNK = 2048  # experiments/configs/plan_grpo.py's model.logprob_chunk_tokens
OUT = Path(__file__).parent / "results" / "plan"
GiB = 2**30


FINETUNE = {
  "full": {},
  "lora": {"lora.rank": 16, "lora.alpha": 32.0, "model.param_dtype": "bfloat16"},
  "qlora": {
    "lora.rank": 16,
    "lora.alpha": 32.0,
    "model.param_dtype": "bfloat16",
    "lora.quantize": "nf4",
    "lora.quant_tile": 64,
  },
}


def config(
  model: str, chips: int, micro_rows: int, remat: str, chunk: int = CHUNK, finetune: str = "full"
):
  c = get_config()
  for key, value in FINETUNE[finetune].items():
    section, name = key.split(".")
    c[section][name] = value
  c.model.update(
    path=f"experiments/configs/plan_models/{model}", remat=remat, logprob_chunk_tokens=chunk
  )
  c.mesh.update(data=-1, fsdp=chips)
  c.algo.update(micro_batches=c.rollout.prompts_per_step * c.rollout.group_size // micro_rows)
  return from_config_dict(c)


# (remat, log-prob chunk) in the order tried, the first that fits is the row: no remat, then
# `model.remat=full`, then the log-probs' vocabulary-sized chunk halved, twice.
SETTINGS = [("none", CHUNK), ("full", CHUNK), ("full", CHUNK // 2), ("full", CHUNK // 4)]


def plan_row(model: str, target_name: str, finetune: str = "full") -> dict:
  target = plan_lib.resolve(target_name)
  devices = plan_lib.target_devices(target)
  start = time.perf_counter()
  log = lambda line: print(f"[{model} {target_name} {finetune}] {line}", flush=True)
  compile_train = lambda cfg, only: plan_lib.compile_run(
    cfg, target, devices, programs_lib.model_config(cfg), only=only, log=log
  )[1]
  first = config(model, target.devices, target.devices, "none", finetune=finetune)
  run = programs_lib.abstract_run(
    first, plan_lib.run_mesh(first, devices), programs_lib.model_config(first)
  )
  resident = programs_lib.device_bytes(run.state)
  tried = []
  rows = target.devices  # one row per chip per micro-batch
  for remat, chunk in SETTINGS:
    if resident > target.chip.hbm_bytes and (remat, chunk) != ("full", CHUNK):
      continue  # the state alone does not fit: only one setting is compiled
    log(f"update with micro-batches of {rows} rows, remat {remat}, log-prob chunk {chunk}")
    update = compile_train(config(model, target.devices, rows, remat, chunk, finetune), ("update",))
    tried.append({"remat": remat, "logprob_chunk_tokens": chunk, "fits": update[0]["fits"]})
    if update[0]["fits"] or resident > target.chip.hbm_bytes:
      break
  cfg = config(model, target.devices, rows, remat, chunk, finetune)
  log(f"sampler and experience at {rows} rows, remat {remat}, log-prob chunk {chunk}")
  run, others = plan_lib.compile_run(
    cfg,
    target,
    devices,
    programs_lib.model_config(cfg),
    only=("prefill", "decode_step", "experience"),
    log=log,
  )
  program_rows = others + update
  report = {
    "model": model,
    "target": target_name,
    "finetune": finetune,
    "chip": target.chip.name,
    "devices": target.devices,
    "mesh": dict(run.mesh.shape),
    "micro_batch_rows": rows,
    "remat": remat,
    "logprob_chunk_tokens": chunk,
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


def engine_row(committed: dict) -> dict:
  """The rollout engine's decode step for a committed row, at that row's settings (mesh,
  micro-batch rows, remat, log-prob chunk, fine-tuning): its figures (`plan.engine_figures`,
  completions of N/2 tokens on average), with the iteration estimated from the row's own
  prefill, experience and update."""
  model, target_name = committed["model"], committed["target"]
  finetune = committed.get("finetune", "full")
  target = plan_lib.resolve(target_name)
  devices = plan_lib.target_devices(target)
  start = time.perf_counter()
  log = lambda line: print(f"[{model} {target_name} {finetune}] {line}", flush=True)
  cfg = config(
    model,
    target.devices,
    committed["micro_batch_rows"],
    committed["remat"],
    committed.get("logprob_chunk_tokens", CHUNK),
    finetune,
  )
  model_cfg = programs_lib.model_config(cfg)
  run = programs_lib.abstract_run(
    cfg, plan_lib.run_mesh(cfg, devices), model_cfg, target.chip.hbm_bytes
  )
  figures = plan_lib.engine_figures(run, committed["programs"], target, log=log)
  # The static sampler's step recounted beside it, by the same HLO walk.
  _, rows = plan_lib.compile_run(cfg, target, devices, model_cfg, only=("decode_step",), log=log)
  static_decode = None
  if rows and "error" not in rows[0]:
    static_decode = plan_lib.decode_figures(run, rows[0], target)
    static_decode["hbm_bytes"] = rows[0]["hbm_bytes"]
  static = (committed.get("iteration") or {}).get("estimate_s")
  if static is not None and static_decode is not None:  # the committed decode steps recounted
    N = cfg.rollout.max_new_tokens
    decode = committed["iteration"]["decode"]
    static += run.waves * N * (static_decode["step_s"] - decode["step_s"])
  return {
    "model": model,
    "target": target_name,
    "finetune": finetune,
    "engine": figures,
    "static_decode": static_decode,
    "static_estimate_s": static,
    "compile_s": round(time.perf_counter() - start, 1),
    "machine": machine(),
  }


def engine_table(rows: list[dict]) -> str:
  """Markdown: each row's engine decode step against the static sampler's."""
  lines = [
    "| model | target | fine-tuning | slots | engine step / its roofline "
    "| engine tokens/s per chip | static step / its roofline | static tokens/s per chip "
    "| est. iteration: static -> engine | engine peak per chip |",
    "|---|---|---|---|---|---|---|---|---|---|",
  ]
  for r in rows:
    e, s = r["engine"], r.get("static_decode") or {}
    if "error" in e:
      lines.append(
        f"| {r['model']} | {r['target']} | {r['finetune']} | - | refused | - | - | - | - | - |"
      )
      continue
    static = f"{s['step_over_roofline']:.2f}x | {s['tokens_per_s_per_chip']:,.0f}" if s else "- | -"
    before, after = r.get("static_estimate_s"), e.get("estimate_s")
    est = f"{before:.1f} s -> {after:.1f} s" if before and after else "-"
    lines.append(
      f"| {r['model']} | {r['target']} | {r['finetune']} | {e['slots']} "
      f"| {e['step_over_roofline']:.2f}x | {e['tokens_per_s_per_chip']:,.0f} | {static} | {est} "
      f"| {e['peak_bytes'] / GiB:.1f} GiB{'' if e['fits'] else ' (does not fit)'} |"
    )
  return "\n".join(lines)


def table(rows: list[dict], lora: bool = False) -> str:
  """The newest row of each (model, target) as Markdown; with `lora`, of each (model,
  target, fine-tuning), with a fine-tuning column."""
  key = lambda r: (r["model"], r["target"], r.get("finetune", "full") if lora else None)
  newest = {key(r): r for r in rows}
  lines = [
    "| model | target | "
    + ("fine-tuning | " if lora else "")
    + "mesh (data, fsdp, tensor) | micro-batch rows | remat | log-prob chunk "
    "| train state per chip | peak per chip | "
    + ("update's peak | " if lora else "")
    + "HBM per chip | fits "
    "| est. iteration (compute-bound) | MFU at that time "
    "| decode step / its roofline | decode tokens/s per chip |",
    "|---|---|" + ("---|---|" if lora else "") + "---|---|---|---|---|---|---|---|---|---|---|---|",
  ]
  targets = list(dict.fromkeys([*TARGETS, *(r["target"] for r in rows)]))
  for model in MODELS:
    for target in targets:
      for finetune in FINETUNE if lora else [None]:
        r = newest.get((model, target, finetune))
        if r is not None:
          lines.append(_row(r, finetune))
  return "\n".join(lines)


def _row(r: dict, finetune: str | None) -> str:
  mesh = ", ".join(str(r["mesh"][k]) for k in ("data", "fsdp", "tensor"))
  it = r.get("iteration") or {}
  state = sum(v for k, v in r["state_bytes_per_chip"].items() if k != "kv_cache")
  peaks = [p["peak_bytes"] for p in r["programs"] if p.get("peak_bytes") is not None]
  peak = f"{max(peaks) / GiB:.1f} GiB" if peaks else "-"
  errors = [p["error"] for p in r["programs"] if p.get("error")]
  if errors:  # the TPU compiler's refusal says how much it needed
    need = re.search(r"temporaries \(([\d.]+)G\)", errors[0])
    peak = "refused" + (f": {need.group(1)} G of temporaries" if need else "")
  est = f"{it['estimate_s']:.0f} s ({it['compute_bound_s']:.0f} s)" if it else "-"
  mfu = f"{100 * it['mfu']:.0f}%" if it else "-"
  decode = it.get("decode")
  decode_cells = (
    f"{decode['step_over_roofline']:.2f}x | {decode['tokens_per_s_per_chip']:,.0f}"
    if decode
    else "- | -"
  )
  update = ""
  if finetune:  # the training step's own peak: LoRA's memory saving is there
    peak_of = {p["program"]: p.get("peak_bytes") for p in r["programs"]}
    update = f"{peak_of['update'] / GiB:.1f} GiB | " if peak_of.get("update") else "refused | "
  return (
    f"| {r['model']} | {r['target']} | "
    + (f"{finetune} | " if finetune else "")
    + f"{mesh} | {r['micro_batch_rows']} | {r['remat']} "
    f"| {r.get('logprob_chunk_tokens', CHUNK)} | {state / GiB:.1f} GiB | {peak} | {update}"
    f"{r['chip_hbm_bytes'] / GiB:.0f} GiB | {'yes' if r['fits'] else 'no'} | {est} | {mfu} "
    f"| {decode_cells} |"
  )


def compare(before: list[dict], now: list[dict], lora: bool = False) -> str:
  """Markdown: each row's iteration estimate before and now, the factor, and whether it fits."""
  key = lambda r: (r["model"], r["target"], r.get("finetune", "full"))
  old = {key(r): r for r in before}
  est = lambda r: (r.get("iteration") or {}).get("estimate_s")
  lines = [
    "| model | target | "
    + ("fine-tuning | " if lora else "")
    + "fits before -> now | est. iteration before -> now | lower by |",
    "|---|---|" + ("---|" if lora else "") + "---|---|---|",
  ]
  for k, r in {key(r): r for r in now}.items():
    b = old.get(k)
    if b is None:
      continue
    e0, e1 = est(b), est(r)
    seconds = lambda e: f"{e:.0f} s" if e else "-"
    span = f"{seconds(e0)} -> {seconds(e1)}"
    factor = f"{e0 / e1:.2f}x" if e0 and e1 else "-"
    fits = f"{'yes' if b['fits'] else 'no'} -> {'yes' if r['fits'] else 'no'}"
    lines.append(
      f"| {k[0]} | {k[1]} | " + (f"{k[2]} | " if lora else "") + f"{fits} | {span} | {factor} |"
    )
  return "\n".join(lines)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--models", default=",".join(MODELS))
  parser.add_argument("--targets", default=",".join(TARGETS))
  parser.add_argument("--finetune", default="full", help="comma-separated: full, lora, qlora")
  parser.add_argument(
    "--table", nargs="?", const="full", choices=["full", "lora", "engine"], help="print rows"
  )
  parser.add_argument(
    "--engine",
    action="store_true",
    help="compile the rollout engine's decode step for each committed row (table.jsonl and "
    "lora_table.jsonl) into engine_table.jsonl",
  )
  parser.add_argument("--out", default=str(OUT), help="the results folder")
  parser.add_argument(
    "--compare", default=None, help="with --table: a results folder to compare the rows against"
  )
  args = parser.parse_args()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  if args.engine:
    for name in ("table.jsonl", "lora_table.jsonl"):
      for committed in [json.loads(line) for line in (out / name).read_text().splitlines()]:
        row = engine_row(committed)
        with open(out / "engine_table.jsonl", "a") as f:
          f.write(json.dumps(row) + "\n")
    return
  if args.table == "engine":
    rows = [json.loads(line) for line in (out / "engine_table.jsonl").read_text().splitlines()]
    print(engine_table(rows))
    return
  if args.table:
    name = "table.jsonl" if args.table == "full" else "lora_table.jsonl"
    read = lambda folder: [json.loads(line) for line in (folder / name).read_text().splitlines()]
    rows = read(out)
    if args.compare:
      print(compare(read(Path(args.compare)), rows, lora=args.table == "lora"))
    else:
      print(table(rows, lora=args.table == "lora"))
    return
  finetunes = args.finetune.split(",")
  lora = finetunes != ["full"]
  for model in args.models.split(","):
    for target in args.targets.split(","):
      for finetune in finetunes:
        report = plan_row(model, target, finetune)
        suffix = f"_{finetune}" if lora else ""
        (out / f"{model}_{target}{suffix}.json").write_text(json.dumps(report, indent=2))
        with open(out / ("lora_table.jsonl" if lora else "table.jsonl"), "a") as f:
          summary = {k: v for k, v in report.items() if k != "programs"}
          summary["programs"] = [
            {k: p.get(k) for k in ("program", "peak_bytes", "fits", "roofline_s", "error")}
            for p in report["programs"]
          ]
          f.write(json.dumps(summary) + "\n")
        print(table([summary], lora).splitlines()[-1], flush=True)


if __name__ == "__main__":
  main()
