"""Seconds per GRPO iteration against TRL's GRPOTrainer on the same workload.

  python -m experiments.benchmarks.bench_grpo_step [--steps N]

Workload (as in TRL's GRPOTrainer): a random-init Qwen2-shaped policy (hidden
256, 4 layers, 4 heads / 2 kv heads, mlp 688, tied embeddings) over a 14-token
character vocabulary (pad, eos, digits, '+', '='); prompts like "123+456=",
16 prompts x 8 samples, 16 new tokens at temperature 1; exact-match reward;
beta = 0.04 with the k3 estimator in the loss; one optimizer step per generation
batch. jaxrl_llm runs its real training loop; with the `bench` extra installed,
TRL runs the identical weights (exported with `save_model`) in the same process.
Prints the median seconds per iteration after warm-up, the MFU estimate, and the
ratio.
"""

import argparse
import importlib.util
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from experiments.benchmarks.common import machine, write_results
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
    tensorboard=False,
    workdir=workdir,
  )
  c.checkpoint.update(every=0)  # iterations only; no checkpoint writes in the timing
  return from_config_dict(c)


def bench_jax(steps: int, workdir: str):
  summary = train(config(steps, workdir))
  rows = [json.loads(line) for line in open(summary["metrics"])][WARMUP:]
  return (
    statistics.median(r["step_time_s"] for r in rows),
    statistics.median(r["mfu"] for r in rows),
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


def bench_trl(learner, steps: int):
  import datasets
  import torch
  import transformers
  import trl

  tok = CharTokenizer(ArithmeticTask(digits=3).alphabet.replace("-", ""), with_bos=False)
  examples = ArithmeticTask(digits=3).examples("train", 2048, seed=0)
  dataset = datasets.Dataset.from_list(examples)

  def reward(completions, answer, **_):
    return exact_match(completions, [{"answer": a} for a in answer])

  times = []

  class Timer(transformers.TrainerCallback):
    def on_step_begin(self, *args, **kwargs):
      self.start = time.perf_counter()

    def on_step_end(self, *args, **kwargs):
      times.append(time.perf_counter() - self.start)

  with tempfile.TemporaryDirectory() as tmp:
    policy = nnx.merge(learner.policy_def, jax.device_get(learner.policy))
    save_model(policy, Path(tmp) / "model")
    model = transformers.AutoModelForCausalLM.from_pretrained(
      Path(tmp) / "model", dtype=torch.float32
    )
    args = trl.GRPOConfig(
      output_dir=str(Path(tmp) / "trl"),
      use_cpu=True,
      bf16=False,
      report_to="none",
      per_device_train_batch_size=PROMPTS * G,
      num_generations=G,
      steps_per_generation=1,
      gradient_accumulation_steps=1,
      max_completion_length=N,
      temperature=1.0,
      top_k=0,
      top_p=1.0,
      beta=BETA,
      learning_rate=LR,
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
      processing_class=hf_tokenizer(tok),
      callbacks=[Timer()],
    )
    trainer.train()
  return statistics.median(times[WARMUP:]), f"trl {trl.__version__}, torch {torch.__version__}"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=12)
  args = parser.parse_args(argv)
  print(f"machine: {machine()}")
  with tempfile.TemporaryDirectory() as tmp:
    t_jax, mfu, learner = bench_jax(args.steps, tmp)
  print(
    f"jaxrl_llm: {t_jax:.3f} s/iteration (median of {args.steps - WARMUP} after warm-up), "
    f"MFU {100 * mfu:.1f}% of the measured CPU matmul peak, {learner.num_params:,} params"
  )
  results = {"jax_s_per_iteration": t_jax, "jax_mfu": mfu, "params": learner.num_params}
  if importlib.util.find_spec("trl"):
    t_trl, info = bench_trl(learner, args.steps)
    results |= {"trl_s_per_iteration": t_trl, "speedup": t_trl / t_jax, "peer": info}
    print(
      f"TRL GRPOTrainer: {t_trl:.3f} s/iteration ({info}) -> jaxrl_llm is "
      f"{t_trl / t_jax:.1f}x faster"
    )
  print(f"wrote {write_results('bench_grpo_step', results)}")


if __name__ == "__main__":
  np.set_printoptions(precision=3)
  main()
