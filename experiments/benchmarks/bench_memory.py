"""Device memory of the real GRPO experience and update steps at Qwen2.5 scale, compiled
ahead of time: no weights are loaded and nothing runs.

  python -m experiments.benchmarks.bench_memory [--models 0.5b,1.5b] [--devices 1,8]
      [--settings full_logits,chunked,remat_full,remat_dots] [--lengths 512,1024,2048]
      [--finetune full,lora,qlora]
  python -m experiments.benchmarks.bench_memory --table   # the committed rows, as Markdown

Each program is `jax.jit(...).lower(ShapeDtypeStructs).compile().memory_analysis()` of
the trainer's own `make_experience` and `update`, from `jax.eval_shape` params, on one CPU
device and on an 8-device fake CPU mesh with FSDP (`mesh.fsdp=8`). Workload: GRPO with a
reference model (k3 KL in the loss, coef 0.04), 16 prompts x 16 completions, 256-token
prompts, 1024-token completions (and the `--lengths` sweep), micro-batches of 16 rows
(one group, whose prompt runs once), AdamW, float32 params and compute.

Settings, each a set of `config.model` keys:
  full_logits logprob_chunk_tokens=0 (full [B, T, V] logits), attention_chunk=0, remat=none,
              unrolled layers
  chunked     logprob_chunk_tokens=2048, attention_chunk=256, scan_layers
  remat_full  chunked + remat=full
  remat_dots  chunked + remat=dots_with_no_batch_dims_saveable

Fine-tuning, each a set of `config.lora` keys on top of a setting:
  full   every weight trained: a reference copy, AdamW moments and gradients for all
  lora   rank-16 adapters (alpha 32) on q, k, v, o, gate, up, down; the float32 base frozen,
         the reference is the base without adapters (no copy)
  qlora  lora on a base stored nf4, one scale per 64 inputs per output channel
LoRA and QLoRA rows are compiled at 1024 completion tokens only; `full` covers the sweep.

Prints per-device bytes: arguments, outputs, temporaries, and the peak XLA plans
(arguments + outputs + temporaries - donated aliases), and appends one row per program
to results/bench_memory.jsonl. CPU programs are what is measured here; the compile-only
planner (`jaxrl_llm.plan`) does the same for TPU and GPU targets.
"""

import argparse
import time

import jax

jax.config.update("jax_num_cpu_devices", 8)

from experiments.benchmarks.common import machine, read_results, write_results  # noqa: E402
from jaxrl_llm.models import ModelConfig  # noqa: E402
from jaxrl_llm.models.sharding import make_mesh  # noqa: E402
from jaxrl_llm.plan import programs as programs_lib  # noqa: E402
from jaxrl_llm.train import from_config_dict  # noqa: E402
from jaxrl_llm.train import learner as learner_lib  # noqa: E402
from jaxrl_llm.train.config import default_config_dict  # noqa: E402

# Qwen2.5 shapes (config.json of Qwen/Qwen2.5-0.5B and -1.5B).
MODELS = {
  "0.5b": dict(hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2, mlp=4864),
  "1.5b": dict(hidden_size=1536, num_layers=28, num_heads=12, num_kv_heads=2, mlp=8960),
}
VOCAB = 151936
CHUNKED = dict(logprob_chunk_tokens=2048, attention_chunk=256, scan_layers=True)
SETTINGS = {
  "full_logits": dict(logprob_chunk_tokens=0, attention_chunk=0, remat="none", scan_layers=False),
  "chunked": CHUNKED | dict(remat="none"),
  "remat_full": CHUNKED | dict(remat="full"),
  "remat_dots": CHUNKED | dict(remat="dots_with_no_batch_dims_saveable"),
}
PROMPTS, GROUP, PROMPT_LEN, MICRO_ROWS = 16, 16, 256, 16
FINETUNE = {
  "full": {},
  "lora": dict(rank=16, alpha=32.0),
  "qlora": dict(rank=16, alpha=32.0, quantize="nf4", quant_tile=64),
}
GiB = 2**30


def train_config(model: str, setting: str, length: int, devices: int, finetune: str = "full"):
  m = MODELS[model]
  d = default_config_dict()
  d.lora.update(FINETUNE[finetune])
  d.model.update(
    architecture="qwen2",
    hidden_size=m["hidden_size"],
    intermediate_size=m["mlp"],
    num_layers=m["num_layers"],
    num_heads=m["num_heads"],
    num_kv_heads=m["num_kv_heads"],
    tie_word_embeddings=True,
    **SETTINGS[setting],
  )
  d.task.prompt_length = PROMPT_LEN
  d.rollout.update(prompts_per_step=PROMPTS, group_size=GROUP, max_new_tokens=length)
  d.algo.update(
    estimator="grpo",
    kl_coef=0.04,
    kl_placement="loss",
    kl_estimator="k3",
    num_minibatches=1,
    micro_batches=PROMPTS * GROUP // MICRO_ROWS,
  )
  d.mesh.update(data=1 if devices > 1 else -1, fsdp=devices)
  return from_config_dict(d)


def model_config(cfg) -> ModelConfig:
  """The trainer's own model config for `cfg`, at Qwen2.5's vocabulary and rope theta."""
  return learner_lib.model_config(cfg, VOCAB, eos_id=0).replace(rope_theta=1e6)


def measure(model: str, setting: str, length: int, devices: int, finetune: str) -> list[dict]:
  """Compiles both programs for one configuration; their memory, one row each."""
  cfg = train_config(model, setting, length, devices, finetune)
  mesh = make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor, jax.devices()[:devices])
  run = programs_lib.abstract_run(cfg, mesh, model_config(cfg))
  out = []
  for name, (fn, args) in (
    ("experience", programs_lib.experience_program(run)),
    ("update", programs_lib.update_program(run)),
  ):
    start = time.perf_counter()
    memory = fn.lower(*args).compile().memory_analysis()
    seconds = time.perf_counter() - start
    row = dict(
      model=f"qwen2.5-{model}",
      program=name,
      setting=setting,
      **SETTINGS[setting],
      finetune=finetune,
      devices=devices,
      completion_tokens=length,
      argument_bytes=memory.argument_size_in_bytes,
      output_bytes=memory.output_size_in_bytes,
      temp_bytes=memory.temp_size_in_bytes,
      alias_bytes=memory.alias_size_in_bytes,
      compile_s=round(seconds, 1),
    )
    row["peak_bytes"] = row["argument_bytes"] + row["output_bytes"] + row["temp_bytes"]
    row["peak_bytes"] -= row["alias_bytes"]
    out.append(row)
    print(
      f"{row['model']:13s} {devices} dev  T={length:5d}  {setting:10s} {finetune:5s} {name:10s} "
      f"args {row['argument_bytes'] / GiB:6.2f}  out {row['output_bytes'] / GiB:6.2f}  "
      f"temp {row['temp_bytes'] / GiB:7.2f}  peak {row['peak_bytes'] / GiB:7.2f} GiB"
      f"  ({seconds:.0f} s to compile)",
      flush=True,
    )
  return out


def plan(args) -> list[tuple[str, str, int, int, str]]:
  """(model, setting, length, devices, finetune) to compile: every setting at 1024 tokens,
  the length sweep for the full-logit path and remat_full, LoRA and QLoRA at 1024 only."""
  runs = []
  for model in args.models:
    for devices in args.devices:
      for setting in args.settings:
        for finetune in args.finetune:
          sweep = finetune == "full" and setting in ("full_logits", "remat_full")
          lengths = args.lengths if sweep else [1024]
          runs += [(model, setting, length, devices, finetune) for length in lengths]
  return runs


def table(rows: list[dict]) -> str:
  """The README's Markdown table from committed rows: the newest row of each program."""
  newest = {}
  for r in rows:  # rows from before the fine-tuning column trained every weight
    tune = r.get("finetune", "full")
    key = (r["model"], r["devices"], r["completion_tokens"], r["setting"], tune, r["program"])
    newest[key] = r
  lines = [
    "| model | devices | completion tokens | setting | fine-tuning | experience peak "
    "| update temporaries | update peak |",
    "|---|---|---|---|---|---|---|---|",
  ]
  order = lambda k: (k[0], k[1], list(SETTINGS).index(k[3]), k[2], list(FINETUNE).index(k[4]))
  for *key, program in sorted(newest, key=order):
    if program != "update":
      continue
    model, devices, length, setting, tune = key
    update = newest[(*key, "update")]
    exp = newest.get((*key, "experience"))
    exp_peak = f"{exp['peak_bytes'] / GiB:.2f} GiB" if exp else ""
    lines.append(
      f"| {model} | {devices} | {length} | {setting} | {tune} | {exp_peak} | "
      f"{update['temp_bytes'] / GiB:.2f} GiB | {update['peak_bytes'] / GiB:.2f} GiB |"
    )
  return "\n".join(lines)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  split = lambda t: lambda s: [t(x) for x in s.split(",")]
  parser.add_argument("--models", type=split(str), default=list(MODELS))
  parser.add_argument("--devices", type=split(int), default=[1, 8])
  parser.add_argument("--settings", type=split(str), default=list(SETTINGS))
  parser.add_argument("--lengths", type=split(int), default=[512, 1024, 2048])
  parser.add_argument("--finetune", type=split(str), default=list(FINETUNE))
  parser.add_argument("--no-write", action="store_true", help="print only")
  parser.add_argument("--table", action="store_true", help="print the committed rows as Markdown")
  args = parser.parse_args(argv)
  for name, known in (("models", MODELS), ("settings", SETTINGS), ("finetune", FINETUNE)):
    if unknown := set(getattr(args, name)) - set(known):
      parser.error(f"--{name}: unknown {sorted(unknown)}; choose from {', '.join(known)}")
  if args.table:
    print(table(read_results("bench_memory")))
    return
  print(f"machine: {machine()}; jax {jax.__version__}, backend {jax.default_backend()}")
  print(
    f"GRPO + reference, {PROMPTS} prompts x {GROUP} completions, prompt {PROMPT_LEN}, "
    f"micro-batches of {MICRO_ROWS} rows, vocab {VOCAB}, float32; per-device bytes"
  )
  rows = []
  for run in plan(args):
    rows += measure(*run)
  if not args.no_write:
    for row in rows:
      path = write_results("bench_memory", row)
    print(f"appended {len(rows)} rows to {path}")


if __name__ == "__main__":
  main()
