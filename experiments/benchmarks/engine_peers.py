"""The rollout engine benchmark's measures (useful tokens, length quantiles, KV bytes, one
timed call) and its peers: `transformers.generate` at its fastest cache and thread setting,
transformers' continuous batching (`generate_batch`) and tunix's `Sampler` (in its own
environment, through `tunix_peer.py`). `bench_engine.py` runs them on its workload."""

import contextlib
import json
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

CALIBRATION_TOKENS = 32
THREADS = (1, 2)


def useful(tokens_BxN, end_ids) -> np.ndarray:
  """Each row's tokens up to and including its first end id (N when it has none)."""
  tokens_BxN = np.asarray(tokens_BxN)
  ends = np.isin(tokens_BxN, list(end_ids))
  first = np.where(ends.any(1), ends.argmax(1) + 1, tokens_BxN.shape[1])
  return first


def quantiles(lengths) -> dict:
  q = np.quantile(np.asarray(lengths), [0.1, 0.5, 0.9, 1.0])
  return {
    "mean": float(np.mean(lengths)),
    **{k: float(v) for k, v in zip(("p10", "p50", "p90", "max"), q, strict=True)},
  }


def measured(lengths, seconds: float) -> dict:
  """Useful tokens per second, the seconds, the useful tokens and their quantiles."""
  lengths = np.asarray(lengths)
  total = int(lengths.sum())
  return {"tokens_per_s": total / seconds, "seconds": seconds, "useful_tokens": total,
          "lengths": quantiles(lengths)}  # fmt: skip


def kv_bytes_per_token(cfg) -> int:
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize


def timed(fn, warmup=contextlib.nullcontext):
  """(result, seconds) of one call after a warm-up call made inside `warmup()`."""
  with warmup():
    jax.block_until_ready(fn())
  start = time.perf_counter()
  out = jax.block_until_ready(fn())
  return out, time.perf_counter() - start


TRANSFORMERS_CACHES = {
  "dynamic cache": {},
  "static cache": {"cache_implementation": "static"},
  "static cache + torch.compile": {"cache_implementation": "static", "compile": True},
}


def _hf_model(model_dir, setting):
  import torch
  import transformers

  hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
  if setting.get("compile"):
    hf.forward = torch.compile(hf.forward)
  return hf


def _hf_generate(hf, setting, ids, attn, args, end_ids, new_tokens, stop: bool):
  import torch

  kwargs = dict(
    attention_mask=attn,
    num_return_sequences=args.samples,
    do_sample=True,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    max_new_tokens=new_tokens,
    pad_token_id=0,
    eos_token_id=list(end_ids) if stop else None,
  )
  if not stop:
    kwargs["min_new_tokens"] = new_tokens
  if "cache_implementation" in setting:
    kwargs["cache_implementation"] = setting["cache_implementation"]
  with torch.no_grad():
    return hf.generate(ids, **kwargs)


def _fastest(calibration: dict) -> tuple[str, str, int]:
  """The fastest setting that ran: its name ("<label>, <n> torch threads"), label and n."""
  working = {k: v for k, v in calibration.items() if isinstance(v, float)}
  best = max(working, key=working.get)
  label, threads = best.rsplit(", ", 1)
  return best, label, int(threads.split()[0])


def run_transformers(model_dir, prompt, mask, args, end_ids, cfg) -> dict:
  """Every cache and thread setting timed on the first CALIBRATION_TOKENS tokens (no early
  stop, after a warm-up call); the fastest then runs the workload on the same model object,
  after one more warm-up call of the whole workload only when it compiles (a static cache
  of the workload's length is a new program)."""
  import torch
  import transformers

  ids, attn = torch.from_numpy(np.asarray(prompt)).long(), torch.from_numpy(np.asarray(mask))
  rows, P = ids.shape[0] * args.samples, ids.shape[1]
  calibration, models = {}, {}
  for threads in THREADS:
    torch.set_num_threads(threads)
    for label, setting in TRANSFORMERS_CACHES.items():
      name = f"{label}, {threads} torch threads"
      try:
        hf = models[label] = models.get(label) or _hf_model(model_dir, setting)
        run = lambda hf=hf, setting=setting: _hf_generate(
          hf, setting, ids, attn, args, end_ids, CALIBRATION_TOKENS, stop=False
        )
        _, seconds = timed(run)
        calibration[name] = rows * CALIBRATION_TOKENS / seconds
      except Exception as e:  # noqa: BLE001 - a setting CPU cannot run is a result too
        calibration[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
      print(f"  transformers calibration, {name}: {calibration[name]}")
  best, label, threads = _fastest(calibration)
  torch.set_num_threads(threads)
  hf, setting = models[label], TRANSFORMERS_CACHES[label]
  run = lambda: _hf_generate(hf, setting, ids, attn, args, end_ids, args.max_new_tokens, stop=True)
  if setting.get("compile"):  # a static cache of a new length is compiled again: warm it up
    tokens, seconds = timed(run)
  else:  # eager: the calibration's two calls on this model and batch were its warm-up
    start = time.perf_counter()
    tokens = run()
    seconds = time.perf_counter() - start
  lengths = useful(tokens[:, P:].numpy(), end_ids)
  width = tokens.shape[1] if label == "dynamic cache" else P + args.max_new_tokens
  return {
    "setting": best,
    "calibration_tokens_per_s": calibration,
    **measured(lengths, seconds),
    "peak_kv_bytes": rows * width * kv_bytes_per_token(cfg),
    "versions": f"transformers {transformers.__version__}, torch {torch.__version__}",
  }


CB_SETTINGS = {  # (tokens a page, tokens a batch): the engine's pages, and transformers'
  "pages of 16, 128 tokens a batch": (16, 128),
  "pages of 16, 512 tokens a batch": (16, 512),
  "pages of 256, 512 tokens a batch": (256, 512),
}
CB_CALIBRATION_PROMPTS = 16


def run_continuous_batching(model_dir, prompts, args, end_ids, cfg, kv_bytes: int) -> dict:
  """transformers' `generate_batch` (continuous batching with a paged cache) with a cache of
  `kv_bytes`, the engine's pool. Not its default: on a CPU that sizes the cache at 60% of the
  free RAM, and every step's attention then spans it (a call took over a minute on the toy
  model, against seconds with a cache its size). Each of `CB_SETTINGS` at 2 torch threads,
  then the fastest at 1, is timed on the first 16 prompts' first 32 tokens after a warm-up
  call; the fastest runs the workload, the calibration having warmed it up (eager torch
  compiles nothing). A run past `args.cb_limit_s` seconds is stopped and recorded as
  unfinished, with the rows it had finished."""
  import torch
  import transformers

  out = {"versions": f"transformers {transformers.__version__}, torch {torch.__version__}"}
  sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
  sampling |= dict(eos_token_id=list(end_ids), num_return_sequences=args.samples)
  calibrate = transformers.GenerationConfig(max_new_tokens=CALIBRATION_TOKENS, **sampling)
  config = transformers.GenerationConfig(max_new_tokens=args.max_new_tokens, **sampling)
  hf = _hf_model(model_dir, {})

  def cache(label):
    page, batch_tokens = CB_SETTINGS[label]
    page_bytes = page * kv_bytes_per_token(cfg)
    blocks = kv_bytes // page_bytes
    return transformers.ContinuousBatchingConfig(
      page_size=page, num_blocks=blocks, max_batch_tokens=batch_tokens
    ), blocks * page_bytes

  def tokens_per_s(label, threads):
    torch.set_num_threads(threads)
    cb = cache(label)[0]
    run = lambda: hf.generate_batch(
      prompts[:CB_CALIBRATION_PROMPTS], generation_config=calibrate, continuous_batching_config=cb
    )
    result, seconds = timed(run)
    return sum(len(r.generated_tokens) for r in result.values()) / seconds

  calibration = {}

  def calibrate_at(label, threads):
    name = f"{label}, {threads} torch threads"
    try:
      calibration[name] = tokens_per_s(label, threads)
    except Exception as e:  # noqa: BLE001 - a failure is reported, not hidden
      calibration[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    print(f"  transformers generate_batch calibration, {name}: {calibration[name]}")

  for label in CB_SETTINGS:
    calibrate_at(label, 2)
  if not any(isinstance(v, float) for v in calibration.values()):
    return out | {"calibration_tokens_per_s": calibration, "error": "every setting failed"}
  calibrate_at(_fastest(calibration)[1], 1)  # the fastest setting at 2 threads, at 1
  best, label, threads = _fastest(calibration)
  torch.set_num_threads(threads)
  cb, allocated = cache(label)
  out |= {"setting": best, "calibration_tokens_per_s": calibration, "peak_kv_bytes": allocated}
  lengths, seconds = _generate_batch_until(hf, prompts, config, cb, args.cb_limit_s)
  rows = len(prompts) * args.samples
  if len(lengths) < rows:
    print(f"  transformers generate_batch: {len(lengths)} of {rows} rows after {seconds:.0f} s")
    return out | {
      "unfinished": {
        "limit_s": args.cb_limit_s, "seconds": seconds, "finished_rows": len(lengths),
        "rows": rows, "finished_useful_tokens": int(lengths.sum()),
      }
    }  # fmt: skip
  return out | measured(lengths, seconds)


def _generate_batch_until(hf, prompts, config, cb, limit_s: float) -> tuple[np.ndarray, float]:
  """The loop of `generate_batch` (transformers 5.23: its manager, sized by the same workload
  hints, warmed up and started, then every finished row collected), ended after `limit_s`
  seconds: the finished rows' lengths and the seconds, from before the manager's warm-up as a
  timed `generate_batch` call counts them."""
  import torch
  from transformers.generation.continuous_batching.utils import WorkloadHints

  rows = len(prompts) * config.num_return_sequences
  hints = WorkloadHints(
    max_prompt_length=max(map(len, prompts)),
    max_generated_length=config.max_new_tokens,
    num_requests=rows,
  )
  lengths = []
  start = time.perf_counter()
  with (
    torch.no_grad(),
    hf.continuous_batching_context_manager(
      generation_config=config, continuous_batching_config=cb, timeout=5, workload_hints=hints
    ) as manager,
  ):
    manager.add_requests(inputs=prompts, max_new_tokens=config.max_new_tokens)
    while len(lengths) < rows and time.perf_counter() - start < limit_s:
      result = manager.get_result(timeout=1)
      if result is not None and result.is_finished():
        lengths.append(len(result.generated_tokens))
      elif result is None and not manager.is_running():
        raise RuntimeError(f"transformers' generation thread stopped after {len(lengths)} rows")
    seconds = time.perf_counter() - start
  return np.array(lengths), seconds


def run_tunix(python, model_dir, prompt, mask, args, end_ids) -> dict:
  """tunix's sampler on the same weights (as a Qwen2 with zero q/k/v biases), the prompts
  repeated `samples` times, stopping at the end id."""
  from experiments.benchmarks.bench_smollm2 import as_qwen2

  with tempfile.TemporaryDirectory() as tmp:
    qwen2 = (
      as_qwen2(Path(model_dir), Path(tmp) / "qwen2") if args.model_kind == "smollm2" else model_dir
    )
    prompts = Path(tmp) / "prompts.npz"
    np.savez(
      prompts,
      tokens=np.repeat(np.asarray(prompt), args.samples, 0),
      mask=np.repeat(np.asarray(mask), args.samples, 0),
    )
    command = [python, str(Path(__file__).with_name("tunix_peer.py")), "sampler"]
    command += ["--model", str(qwen2), "--prompts", str(prompts)]
    command += ["--max-new-tokens", str(args.max_new_tokens), "--repeats", "1"]
    command += ["--warmup", "compile"]  # as the JAX samplers: compiled, not a whole workload
    command += ["--eos-ids", ",".join(map(str, end_ids))]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
      return {"error": out.stderr[-2000:]}
  return json.loads(out.stdout.strip().splitlines()[-1])
