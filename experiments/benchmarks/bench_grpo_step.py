"""Seconds per GRPO iteration against TRL's GRPOTrainer and tunix's GRPOLearner on one workload.

  python -m experiments.benchmarks.bench_grpo_step [--steps N] [--tunix-python PATH]

Workload (as in TRL's GRPOTrainer): a random-init Qwen2-shaped policy (hidden
256, 4 layers, 4 heads / 2 kv heads, mlp 688, tied embeddings) over the 15-token
character vocabulary of 3-digit arithmetic (pad, EOS, digits, '=', '+', '-'); prompts
like "123+456=", 16 prompts x 8 samples, 16 new tokens at temperature 1; exact-match
reward; beta = 0.04 with a KL penalty to the reference in the loss; one optimizer step
per generation batch; float32. jaxrl_llm runs its real training loop. With the `bench`
extra installed, TRL runs the identical weights (exported with `save_model`) in the same
process, twice: at its fastest setting for this workload (`gradient_checkpointing=False`:
jaxrl_llm recomputes nothing either) and at its default (gradient checkpointing on), each
on its own line. With tunix installed in its own environment (`.venv-tunix`, see
experiments/benchmarks/README.md; tunix needs safetensors < 0.8, transformers >= 5.23 needs
0.8), its GRPOLearner runs the same weights in a subprocess of the same run. Prints the
median seconds per iteration after warm-up, the MFU estimate, and the ratios; appends the
figures to results/bench_grpo_step.jsonl.
"""

import argparse
import importlib.util
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from experiments.benchmarks.common import machine, write_results
from experiments.benchmarks.peers import tunix_python
from jaxrl_llm.data import ArithmeticTask
from jaxrl_llm.models import CharTokenizer, save_model
from jaxrl_llm.rewards import exact_match
from jaxrl_llm.train import from_config_dict, train
from jaxrl_llm.train.config import default_config_dict

PROMPTS, G, N, BETA, LR = 16, 8, 16, 0.04, 1e-5
WARMUP = 2


def config(steps: int, workdir: str):
  c = default_config_dict()
  c.model.update(
    hidden_size=256,
    intermediate_size=688,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
  )
  c.task.update(digits=3, prompt_length=8, train_examples=2048)
  c.rollout.update(prompts_per_step=PROMPTS, group_size=G, max_new_tokens=N, temperature=1.0)
  c.algo.update(
    estimator="grpo",
    policy_loss="ppo_clip",
    aggregation="token-mean",
    kl_placement="loss",
    kl_estimator="k3",
    kl_coef=BETA,
    ppo_epochs=1,
    num_minibatches=1,
  )
  c.optim.update(learning_rate=LR)
  c.run.update(
    steps=steps,
    eval_examples=16,
    eval_batch_size=16,
    progress=False,
    loggers="jsonl",
    workdir=workdir,
  )
  c.checkpoint.update(every=0)  # iterations only; no checkpoint writes in the timing
  return from_config_dict(c)


def bench_jax(steps: int, workdir: str):
  summary = train(config(steps, workdir))
  rows = [json.loads(line) for line in open(summary["metrics"])][WARMUP:]
  return (
    statistics.median(r["perf/step_time_s"] for r in rows),
    statistics.median(r["perf/mfu"] for r in rows),
    summary["learner"],
  )


def hf_tokenizer(tok: CharTokenizer):
  import tokenizers
  import transformers

  vocab = {s: i for i, s in enumerate(tok.specials)} | {c: tok.encode(c)[0] for c in tok.alphabet}
  core = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<pad>"))
  core.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), "isolated")
  core.decoder = tokenizers.decoders.Fuse()
  return transformers.PreTrainedTokenizerFast(
    tokenizer_object=core, pad_token="<pad>", eos_token="<eos>"
  )


def export(learner, directory: Path) -> Path:
  """The policy's weights as a Hugging Face directory, for the peers."""
  return save_model(nnx.merge(learner.policy_def, jax.device_get(learner.policy)), directory)


def run_trl(
  model_dir,
  tokenizer,
  dataset,
  reward,
  steps: int,
  gradient_checkpointing: bool,
  prompts=PROMPTS,
  group=G,
  new_tokens=N,
  beta=BETA,
  lr=LR,
) -> list[float]:
  """Seconds of each of `steps` TRL GRPOTrainer iterations on `model_dir`'s float32 weights:
  one optimizer step per generation batch of `prompts x group`, temperature 1, no truncation."""
  import torch
  import transformers
  import trl

  times = []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, *args, **kwargs):
      self.start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
      times.append(time.perf_counter() - self.start)

  with tempfile.TemporaryDirectory() as tmp:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    args = trl.GRPOConfig(
      gradient_checkpointing=gradient_checkpointing,
      output_dir=str(Path(tmp) / "trl"),
      use_cpu=True,
      bf16=False,
      report_to="none",
      per_device_train_batch_size=prompts * group,
      num_generations=group,
      steps_per_generation=1,
      gradient_accumulation_steps=1,
      max_completion_length=new_tokens,
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      beta=beta,
      learning_rate=lr,
      num_iterations=1,
      max_steps=steps,
      logging_steps=steps,
      save_strategy="no",
      disable_dropout=True,
      seed=0,
    )
    trainer = trl.GRPOTrainer(
      model=model,
      reward_funcs=[reward],
      args=args,
      train_dataset=dataset,
      processing_class=tokenizer,
      callbacks=[Timer()],
    )
    trainer.train()
  return times


def bench_trl(model_dir: Path, steps: int, gradient_checkpointing: bool):
  import datasets
  import torch
  import trl

  tok = CharTokenizer(ArithmeticTask(digits=3).alphabet.replace("-", ""), with_bos=False)
  examples = ArithmeticTask(digits=3).examples("train", 2048, seed=0)
  dataset = datasets.Dataset.from_list(examples)

  def reward(completions, answer, **_):
    return exact_match(completions, [{"answer": a} for a in answer])

  times = run_trl(model_dir, hf_tokenizer(tok), dataset, reward, steps, gradient_checkpointing)
  return statistics.median(times[WARMUP:]), f"trl {trl.__version__}, torch {torch.__version__}"


def bench_tunix(python: str, model_dir: Path, steps: int) -> dict:
  """tunix's GRPOLearner on the same weights, in its own environment."""
  command = [python, str(Path(__file__).with_name("tunix_peer.py")), "grpo"]
  command += ["--model", str(model_dir), "--steps", str(steps)]
  out = subprocess.run(command, capture_output=True, text=True, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=12)
  parser.add_argument("--tunix-python", default=None, help="python of the tunix environment")
  args = parser.parse_args(argv)
  print(f"machine: {machine()}")
  with tempfile.TemporaryDirectory() as tmp:
    t_jax, mfu, learner = bench_jax(args.steps, tmp)
    model_dir = export(learner, Path(tmp) / "model")
    print(
      f"jaxrl_llm: {t_jax:.3f} s/iteration (median of {args.steps - WARMUP} after warm-up), "
      f"MFU {100 * mfu:.1f}% of the measured CPU matmul peak, {learner.num_params:,} params"
    )
    results = {"jax_s_per_iteration": t_jax, "jax_mfu": mfu, "params": learner.num_params}
    if importlib.util.find_spec("trl"):
      for label, checkpointing in (("fastest", False), ("default", True)):
        t_trl, info = bench_trl(model_dir, args.steps, checkpointing)
        results |= {f"trl_{label}_s_per_iteration": t_trl, "trl": info}
        print(
          f"TRL GRPOTrainer, gradient_checkpointing={checkpointing} ({label}): {t_trl:.3f} "
          f"s/iteration ({info}) -> jaxrl_llm is {t_trl / t_jax:.2f}x faster"
        )
      results["speedup_vs_trl"] = results["trl_fastest_s_per_iteration"] / t_jax
    python = tunix_python(args.tunix_python)
    if python:
      tunix = bench_tunix(python, model_dir, args.steps)
      t_tunix = tunix["s_per_iteration"]
      results |= {"tunix_s_per_iteration": t_tunix, "tunix": tunix}
      results["speedup_vs_tunix"] = t_tunix / t_jax
      print(
        f"{tunix['peer']}: {t_tunix:.3f} s/iteration -> jaxrl_llm is {t_tunix / t_jax:.2f}x faster"
      )
  print(f"wrote {write_results('bench_grpo_step', results)}")


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
