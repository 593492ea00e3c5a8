"""Sampler throughput against transformers' and tunix's, and against the memory-bandwidth roofline.

  python -m experiments.benchmarks.bench_sampler [--repeats N] [--dtype float32|bfloat16]

Model: random-init Qwen2 shape (vocab 32000, hidden 512, 8 layers, 8 heads,
2 kv heads, mlp 1408, tied embeddings). Run: batch 16, prompt 64, 128 new
tokens, temperature 1, no early stop. Prints tokens/s after compilation.

Peers, on the identical weights (exported with `save_model`) and prompts, in the same run:
- with torch and transformers installed (the `bench` extra), `transformers.generate` with
  each cache it offers on CPU: the default dynamic cache (`DynamicCache`), the static cache
  (`cache_implementation="static"`), and the static cache with the model's forward under
  `torch.compile`; a setting that fails is reported as such. The ratio is against the
  fastest that works.
- with tunix in its own environment (`.venv-tunix`, see experiments/benchmarks/README.md),
  tunix's sampler, in a subprocess.

The roofline fraction compares the bytes a decode step must read (params plus the whole KV
cache) per step time with the bandwidth of a streaming read measured in the same run. To
show where a decode step's time goes, it also measures how fast a chain of decode-shaped
matmuls reads its weights when they are runtime arguments (as in decoding) and when they
are compile-time constants.

A second workload has GRPO's shape: 2 prompts of up to 512 tokens x 8 samples each, 128 new
tokens. It runs the sampler as it is (each group attends to one copy of its prompt's keys
and values) and with `shared_prompt_kv=False` (the prompt's KV repeated into every row, the
layout before), with their KV bytes, and `transformers.generate(num_return_sequences=8)`
with each cache. `--torch-device cuda` runs the transformers peer on a GPU. Appends the
figures to results/bench_sampler.jsonl.
"""

import argparse
import importlib.util
import json
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from experiments.benchmarks.common import machine, time_fn, write_results
from experiments.benchmarks.peers import tunix_python
from jaxrl_llm.models import CausalLM, ModelConfig, save_model
from jaxrl_llm.rollout import generate

B, P, N = 16, 64, 128


def model_config(dtype):
  return ModelConfig(
    vocab_size=32000,
    hidden_size=512,
    intermediate_size=1408,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    qkv_bias=True,
    tie_word_embeddings=True,
    param_dtype=dtype,
    dtype=dtype,
  )


def measure_bandwidth(gib=1.0):
  """Bytes/s of a jitted streaming read (a sum over a large array), median of several."""
  n = int(gib * 2**30 / 4)
  x = jnp.ones((n,), jnp.float32)
  read = jax.jit(jnp.sum)
  return x.nbytes / time_fn(read, x, repeats=10)


def measure_matmul_flops(m, k, n, dtype):
  """FLOP/s of a jitted [m, k] x [k, n] matmul."""
  a, b = jnp.ones((m, k), dtype), jnp.ones((k, n), dtype)
  return 2 * m * k * n / time_fn(jax.jit(jnp.matmul), a, b, repeats=10)


def measure_weight_streaming(cfg, constant: bool, layers=16, repeats=20):
  """Bytes/s at which a chain of decode-shaped matmuls (`[B, D] x [D, F]`, `layers` distinct
  weights, more than the last-level cache holds) reads its weights: passed as runtime
  arguments, as a decode step gets them, or baked in as compile-time constants."""
  D, F = cfg.hidden_size, cfg.intermediate_size
  ws = jax.random.normal(jax.random.key(0), (layers, D, F), cfg.dtype)
  x = jnp.ones((B, D), cfg.dtype)

  def chain(x, ws):
    def body(_, x):
      for w in ws:
        x = x + (x @ w)[:, :D] * 1e-3
      return x

    return jax.lax.fori_loop(0, repeats, body, x)

  fn = jax.jit(lambda x: chain(x, ws)) if constant else jax.jit(chain)
  args = (x,) if constant else (x, ws)
  return repeats * ws.nbytes / time_fn(fn, *args, repeats=5)


def decode_step_flops(cfg):
  """Multiply-adds x 2 of one decode step: every matmul parameter once per row, plus attention
  over the full cache."""
  D, F, V, H = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
  per_layer = D * H * (2 * cfg.num_heads + 2 * cfg.num_kv_heads) + 3 * D * F
  attention = 2 * cfg.num_heads * H * (P + N)
  return 2 * B * (cfg.num_layers * (per_layer + attention) + D * V)


def decode_step_bytes(cfg, params):
  param_bytes = sum(x.nbytes for x in jax.tree.leaves(params))
  cache_bytes = (
    2
    * cfg.num_layers
    * B
    * (P + N)
    * cfg.num_kv_heads
    * cfg.head_dim
    * jnp.dtype(cfg.dtype).itemsize
  )
  return param_bytes, cache_bytes


def bench_jax(model, prompt, mask, repeats):
  graphdef, params = nnx.split(model)
  run = lambda n: generate(
    graphdef, prompt, mask, jax.random.key(0), params=params, max_new_tokens=n, temperature=1.0
  )
  t_full = time_fn(lambda: run(N), repeats=repeats)
  t_prefill = time_fn(lambda: run(1), repeats=repeats)
  out = run(N)
  assert int(out.lengths_B.min()) == N  # no early stop
  return t_full, t_prefill, params


TRANSFORMERS_CACHES = {
  "dynamic cache (generate's default)": {},
  "static cache": {"cache_implementation": "static"},
  "static cache + torch.compile": {"cache_implementation": "static", "compile": True},
}


def bench_transformers(
  model_dir, dtype, prompt, mask, repeats, num_return_sequences=1, device="cpu"
) -> dict:
  """tokens/s of `transformers.generate` with each cache setting (or the error it raised)."""
  import torch
  import transformers

  ids = torch.from_numpy(np.array(prompt)).long().to(device)
  attn = torch.from_numpy(np.array(mask)).to(device)
  rows, width = ids.shape[0] * num_return_sequences, ids.shape[1]
  common = dict(
    num_return_sequences=num_return_sequences,
    attention_mask=attn,
    do_sample=True,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    max_new_tokens=N,
    min_new_tokens=N,
    pad_token_id=0,
  )
  out = {}
  for label, setting in TRANSFORMERS_CACHES.items():
    torch_dtype = torch.float32 if dtype == jnp.float32 else torch.bfloat16
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype)
    hf = hf.to(device).eval()
    kwargs = dict(common)
    if "cache_implementation" in setting:
      kwargs["cache_implementation"] = setting["cache_implementation"]
    if setting.get("compile"):
      hf.forward = torch.compile(hf.forward)

    def run(hf=hf, kwargs=kwargs):
      with torch.no_grad():
        return hf.generate(ids, **kwargs)

    try:
      start = time.perf_counter()
      run()  # warm-up (and compilation)
      first = time.perf_counter() - start
      times = []
      for _ in range(repeats):
        start = time.perf_counter()
        tokens = run()
        times.append(time.perf_counter() - start)
      assert tokens.shape == (rows, width + N)
      out[label] = {"tokens_per_s": rows * N / float(np.median(times)), "first_call_s": first}
    except Exception as e:  # noqa: BLE001 - a setting CPU cannot run is a result too
      out[label] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
  info = f"transformers {transformers.__version__}, torch {torch.__version__}, "
  return out | {"versions": info + f"{torch.get_num_threads()} threads"}


def bench_tunix(python, model_dir, prompt, mask, dtype, repeats) -> dict:
  """tunix's sampler on the same weights and prompts, in its own environment."""
  prompts = Path(model_dir) / "prompts.npz"
  np.savez(prompts, tokens=np.asarray(prompt), mask=np.asarray(mask))
  command = [python, str(Path(__file__).with_name("tunix_peer.py")), "sampler"]
  command += ["--model", str(model_dir), "--prompts", str(prompts), "--max-new-tokens", str(N)]
  command += ["--repeats", str(repeats), "--dtype", dtype]
  out = subprocess.run(command, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  parser.add_argument("--tunix-python", default=None, help="python of the tunix environment")
  parser.add_argument("--torch-device", default="cpu", help="where transformers runs (cuda)")
  args = parser.parse_args(argv)
  cfg = model_config(jnp.dtype(args.dtype))
  model = CausalLM(cfg, rngs=nnx.Rngs(0))
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, P)), jnp.int32)
  lengths = rng.integers(P // 2, P + 1, B)
  mask = jnp.asarray(np.arange(P)[None, :] >= P - lengths[:, None])  # left-padded
  print(f"machine: {machine()}")
  print(
    f"model: {cfg.num_layers} layers, hidden {cfg.hidden_size}, vocab {cfg.vocab_size}, "
    f"{args.dtype}; batch {B}, prompt {P}, {N} new tokens"
  )

  t_full, t_prefill, params = bench_jax(model, prompt, mask, args.repeats)
  tok_s = B * N / t_full
  step_s = (t_full - t_prefill) / (N - 1)
  param_bytes, cache_bytes = decode_step_bytes(cfg, params)
  bandwidth = measure_bandwidth()
  roofline = (param_bytes + cache_bytes) / step_s / bandwidth
  results = dict(
    dtype=args.dtype,
    jax_tokens_per_s=tok_s,
    jax_total_s=t_full,
    jax_prefill_s=t_prefill,
    jax_decode_step_ms=1e3 * step_s,
    bytes_per_step=param_bytes + cache_bytes,
    bandwidth_gb_s=bandwidth / 1e9,
    roofline_fraction=roofline,
  )
  flops = decode_step_flops(cfg)
  peak = measure_matmul_flops(2048, 2048, 2048, cfg.dtype)
  small = measure_matmul_flops(B, cfg.hidden_size, cfg.intermediate_size, cfg.dtype)
  runtime_bw = measure_weight_streaming(cfg, constant=False)
  constant_bw = measure_weight_streaming(cfg, constant=True)
  results.update(
    flops_per_step=flops,
    achieved_gflops=flops / step_s / 1e9,
    matmul_peak_gflops=peak / 1e9,
    decode_matmul_gflops=small / 1e9,
    weight_stream_runtime_gb_s=runtime_bw / 1e9,
    weight_stream_constant_gb_s=constant_bw / 1e9,
  )
  print(
    f"jaxrl_llm generate: {tok_s:8.0f} tokens/s  ({t_full:.2f} s; decode step "
    f"{1e3 * step_s:.2f} ms)"
  )
  print(
    f"roofline: {(param_bytes + cache_bytes) / 1e6:.0f} MB read per decode step "
    f"(params {param_bytes / 1e6:.0f} MB + KV cache {cache_bytes / 1e6:.0f} MB) at "
    f"{bandwidth / 1e9:.1f} GB/s streaming read -> {100 * roofline:.0f}% of roofline"
  )
  print(
    f"compute: {flops / 1e9:.2f} GFLOP per decode step at {flops / step_s / 1e9:.0f} GFLOP/s; "
    f"a [{B}x{cfg.hidden_size}]x[{cfg.hidden_size}x{cfg.intermediate_size}] matmul alone "
    f"runs at {small / 1e9:.0f} GFLOP/s, a 2048^3 one at {peak / 1e9:.0f}"
  )
  print(
    f"weights: a chain of [{B}x{cfg.hidden_size}]x[{cfg.hidden_size}x{cfg.intermediate_size}] "
    f"matmuls reads its weights at {runtime_bw / 1e9:.1f} GB/s when they are runtime arguments "
    f"(as in decoding), {constant_bw / 1e9:.1f} GB/s when they are compile-time constants"
  )
  with tempfile.TemporaryDirectory() as model_dir:
    save_model(model, model_dir)
    if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
      hf = bench_transformers(
        model_dir, cfg.dtype, prompt, mask, args.repeats, device=args.torch_device
      )
      results["transformers"] = hf
      print(f"transformers ({hf['versions']}):")
      for label in TRANSFORMERS_CACHES:
        r = hf[label]
        line = r.get("error") or f"{r['tokens_per_s']:8.0f} tokens/s -> jaxrl_llm is "
        line += "" if "error" in r else f"{tok_s / r['tokens_per_s']:.2f}x faster"
        print(f"  {label}: {line}")
      working = [hf[k]["tokens_per_s"] for k in TRANSFORMERS_CACHES if "error" not in hf[k]]
      if working:
        results["speedup_vs_transformers_fastest"] = tok_s / max(working)
    python = tunix_python(args.tunix_python)
    if python:
      tunix = bench_tunix(python, model_dir, prompt, mask, args.dtype, args.repeats)
      results["tunix"] = tunix
      results["speedup_vs_tunix"] = tok_s / tunix["tokens_per_s"]
      print(
        f"{tunix['peer']}: {tunix['tokens_per_s']:8.0f} tokens/s -> jaxrl_llm is "
        f"{tok_s / tunix['tokens_per_s']:.2f}x faster"
      )
  results["groups"] = bench_groups(model, cfg, args)
  print(f"wrote {write_results('bench_sampler', results)}")


GROUP_PROMPTS, GROUP, GROUP_P = 2, 8, 512  # 2 prompts of up to 512 tokens x 8 samples


def kv_bytes(cfg, prompts, group, P, N, shared: bool) -> int:
  """KV-cache bytes of a rollout: one copy of each prompt per group plus each row's own
  slots (shared), or P + N slots per row (the prompt repeated)."""
  slots = prompts * P + prompts * group * N if shared else prompts * group * (P + N)
  itemsize = jnp.dtype(cfg.dtype).itemsize
  return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * slots * itemsize


def bench_shared_prompt(model, prompt, mask, group, new_tokens, repeats) -> dict:
  """tokens/s and KV bytes of the sampler on `group` samples of each prompt, with each group
  sharing one copy of its prompt's KV and with the prompt repeated per row (the layout before
  the shared cache); no early stop."""
  graphdef, params = nnx.split(model)
  rows, P = prompt.shape[0] * group, prompt.shape[1]
  out = {"prompts": prompt.shape[0], "group": group, "prompt_tokens": P, "new_tokens": new_tokens}
  for label, shared in (("shared prompt KV", True), ("prompt KV repeated per row", False)):

    def run(shared=shared):
      return generate(
        graphdef,
        prompt,
        mask,
        jax.random.key(0),
        params=params,
        max_new_tokens=new_tokens,
        num_samples=group,
        temperature=1.0,
        shared_prompt_kv=shared,
        trim=False,
      )

    seconds = time_fn(run, repeats=repeats)
    kv = kv_bytes(model.cfg, prompt.shape[0], group, P, new_tokens, shared)
    tok_s = rows * new_tokens / seconds
    out[label] = {"tokens_per_s": tok_s, "seconds": seconds, "kv_bytes": kv}
    print(f"  jaxrl_llm, {label}: {tok_s:8.0f} tokens/s, KV {kv / 2**20:.1f} MiB")
  new, old = out["shared prompt KV"], out["prompt KV repeated per row"]
  out["speedup_shared_vs_repeated"] = new["tokens_per_s"] / old["tokens_per_s"]
  print(f"  shared / repeated: {out['speedup_shared_vs_repeated']:.2f}x")
  return out


def fastest_working(hf: dict) -> float | None:
  """The best tokens/s among the transformers settings that ran."""
  working = [hf[k]["tokens_per_s"] for k in TRANSFORMERS_CACHES if "error" not in hf[k]]
  return max(working) if working else None


def bench_groups(model, cfg, args) -> dict:
  """GRPO's shape: few long prompts, many samples each (`bench_shared_prompt`), and
  `transformers.generate(num_return_sequences=G)` with each cache."""
  rng = np.random.default_rng(1)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (GROUP_PROMPTS, GROUP_P)), jnp.int32)
  lengths = rng.integers(GROUP_P // 2, GROUP_P + 1, GROUP_PROMPTS)
  mask = jnp.asarray(np.arange(GROUP_P)[None, :] >= GROUP_P - lengths[:, None])
  print(
    f"groups: {GROUP_PROMPTS} prompts of {GROUP_P} tokens (real lengths {lengths.tolist()}) x "
    f"{GROUP} samples, {N} new tokens"
  )
  out = bench_shared_prompt(model, prompt, mask, GROUP, N, args.repeats)
  if importlib.util.find_spec("torch") and importlib.util.find_spec("transformers"):
    with tempfile.TemporaryDirectory() as model_dir:
      save_model(model, model_dir)
      hf = bench_transformers(
        model_dir,
        cfg.dtype,
        prompt,
        mask,
        args.repeats,
        num_return_sequences=GROUP,
        device=args.torch_device,
      )
    out["transformers"] = hf
    for label in TRANSFORMERS_CACHES:
      r = hf[label]
      print(f"  transformers, {label}: " + (r.get("error") or f"{r['tokens_per_s']:8.0f} tokens/s"))
    if fastest_working(hf):
      out["speedup_vs_transformers_fastest"] = out["shared prompt KV"][
        "tokens_per_s"
      ] / fastest_working(hf)
  return out


if __name__ == "__main__":
  main()
