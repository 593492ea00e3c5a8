"""The recipe's trained model, exported and read back by transformers (the `bench` extra).

  python -m experiments.smollm2                 # the run (its checkpoint is in runs/)
  python -m experiments.smollm2_export [--checkpoint runs/smollm2_arithmetic]

Runs `python -m jaxrl_llm.export`, loads the result with transformers'
AutoModelForCausalLM and AutoTokenizer, asks it held-out problems in the recipe's chat form
(greedy, up to the end-of-turn id), compares its logits with jaxrl_llm's on the same ids, and
writes experiments/results/smollm2_export.json.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from experiments.configs.smollm2_arithmetic import get_config
from experiments.lib import provenance
from jaxrl_llm.data import ArithmeticTask
from jaxrl_llm.models import load_model
from jaxrl_llm.rewards import exact_match

RESULTS = Path(__file__).parent / "results"


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--checkpoint", default=get_config().run.workdir)
  parser.add_argument("--out", default="runs/smollm2_exported")
  parser.add_argument("--problems", type=int, default=4)
  args = parser.parse_args(argv)
  export = [sys.executable, "-m", "jaxrl_llm.export", "--checkpoint", args.checkpoint]
  subprocess.run([*export, "--out", args.out], check=True)

  import torch
  import transformers

  hf = transformers.AutoModelForCausalLM.from_pretrained(args.out, dtype=torch.float32).eval()
  tok = transformers.AutoTokenizer.from_pretrained(args.out)
  instruction = get_config().task.instruction
  examples = ArithmeticTask(digits=2, ops="+").examples("test", args.problems, seed=1)
  answers, worst = [], 0.0
  ours = load_model(args.out)
  for e in examples:
    messages = [{"role": "user", "content": instruction.replace("{question}", e["question"])}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    ids = torch.tensor([list(ids)])
    with torch.no_grad():
      out = hf.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=tok.eos_token_id)
      theirs = hf(out).logits[0].numpy()
    text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    n = out.shape[1]
    mine, _ = ours(jnp.asarray(out.numpy()), jnp.arange(n)[None], jnp.ones((1, n), bool))
    scale = float(np.abs(theirs).max())
    worst = max(worst, float(np.abs(np.asarray(mine[0]) - theirs).max()) / scale)
    correct = exact_match([text], [e])[0]
    answers.append(
      {"question": e["question"], "reply": text, "answer": e["answer"], "correct": correct}
    )
    print(f"{e['question']} -> {text!r} ({'right' if correct else 'wrong'})")
  row = provenance.stamp() | {
    "command": " ".join(["python -m experiments.smollm2_export", *(argv or sys.argv[1:])]),
    "exported": args.out,
    "loaded_by": f"transformers {transformers.__version__} AutoModelForCausalLM, AutoTokenizer",
    "replies": answers,
    "max_logit_difference_relative_to_scale": worst,
  }
  (RESULTS / "smollm2_export.json").write_text(json.dumps(row, indent=2) + "\n")
  print(f"logits: jaxrl_llm vs transformers within {worst:.1e} of the logit scale")


if __name__ == "__main__":
  main()
