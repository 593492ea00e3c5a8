"""Peak host memory (max RSS) of a real GRPO run at a 49,152-token vocabulary on the CPU.

  python -m experiments.benchmarks.bench_host_memory [--steps 2]

Workload: a random-init 2-layer, 64-wide Llama (4 heads, 2 kv heads, mlp 176, tied) whose
vocabulary has SmolLM2's size, 49,152 ids (a character-level tokenizer for the task's
characters plus filler ids, written by this script, so nothing is downloaded); the default
experiment's GRPO on 2-digit addition with 8 prompts x 8 completions, `--steps` RL steps,
no warm start. Each setting runs `python -m jaxrl_llm.train` in a fresh process and reads
that process's peak resident memory from the kernel (`os.wait4`).

Settings:
  full logits   model.logprob_chunk_tokens=0, model.attention_chunk=0 (every pass forms
                the [B, T, V] logits), 128 new tokens
  default       the defaults (log-probs from hidden states in chunks), 128 and 512 new
                tokens

The full-logit path at 512 new tokens is left out: it needs more than this machine's
24 GB. Appends one row per setting to results/bench_host_memory.jsonl.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import tokenizers
from flax import nnx

from experiments.benchmarks.common import machine, write_results
from jaxrl_llm.models import CausalLM, ModelConfig, save_model

VOCAB = 49152
TASK_CHARS = "0123456789+=-"
RUNS = (
  ("full logits", 128, {"model.logprob_chunk_tokens": 0, "model.attention_chunk": 0}),
  ("default", 128, {}),
  ("default", 512, {}),
)


def write_model(path: Path) -> Path:
  """A random-init Llama directory with a 49,152-id tokenizer whose first ids spell the task."""
  specials = ["<pad>", "<eos>"]
  filler = [f"<x{i}>" for i in range(VOCAB - len(specials) - len(TASK_CHARS))]
  vocab = {t: i for i, t in enumerate([*specials, *TASK_CHARS, *filler])}
  tok = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True) for t in specials + filler])
  tok.decoder = tokenizers.decoders.Fuse()
  cfg = ModelConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=176,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    tie_word_embeddings=True,
    architecture="llama",
    eos_token_id=vocab["<eos>"],
  )
  save_model(CausalLM(cfg, rngs=nnx.Rngs(0)), path)
  tok.save(str(path / "tokenizer.json"))
  config = {"eos_token": "<eos>", "pad_token": "<pad>"}
  (path / "tokenizer_config.json").write_text(json.dumps(config))
  return path


def peak_rss_gb(cmd: list[str]) -> tuple[float, int]:
  """Runs `cmd`; its exit status and the peak resident memory of the process, in GB."""
  process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  _, status, usage = os.wait4(process.pid, 0)
  process.returncode = os.waitstatus_to_exitcode(status)
  if process.returncode:
    print(process.stderr.read()[-2000:], file=sys.stderr)
  return usage.ru_maxrss * 1024 / 1e9, process.returncode


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=2)
  args = parser.parse_args(argv)
  print(f"machine: {machine()}")
  with tempfile.TemporaryDirectory() as tmp:
    model = write_model(Path(tmp) / "model")
    for name, tokens, overrides in RUNS:
      flags = {
        "model.path": str(model),
        "rollout.prompts_per_step": 8,
        "rollout.group_size": 8,
        "rollout.max_new_tokens": tokens,
        "run.steps": args.steps,
        "run.eval_examples": 8,
        "run.eval_batch_size": 8,
        "run.progress": False,
        "run.loggers": "jsonl",
        "run.workdir": f"{tmp}/run-{name.replace(' ', '_')}-{tokens}",
        "warmstart.steps": 0,
        **overrides,
      }
      cmd = [sys.executable, "-m", "jaxrl_llm.train", "--config", "experiments/configs/default.py"]
      cmd += [f"--config.{k}={v}" for k, v in flags.items()]
      gb, code = peak_rss_gb(cmd)
      row = dict(setting=name, new_tokens=tokens, vocab=VOCAB, peak_rss_gb=gb, exit_code=code)
      row |= dict(overrides=overrides, steps=args.steps, rows=64)
      print(f"{name:12s} {tokens:4d} new tokens: peak RSS {gb:5.2f} GB (exit {code})", flush=True)
      write_results("bench_host_memory", row)


if __name__ == "__main__":
  main()
