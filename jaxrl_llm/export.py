"""Exports a trained policy from a checkpoint as a Hugging Face directory.

  python -m jaxrl_llm.export --checkpoint runs/default --out exported/default [--step 1500]

`--checkpoint` is a run directory, its `checkpoints/` directory, or one step's
directory. Only the policy is read (not the optimizer states or the critic). The
output has `config.json`, `generation_config.json`, safetensors weights (through
`jaxrl_llm.models.save_model`) and the tokenizer: the base model's tokenizer files
when the run started from `model.path`, or the character vocabulary as a fast
tokenizer otherwise, so `transformers.AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` (and serving engines) read it.
"""

import argparse
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from jaxrl_llm.models import CausalLM, CharTokenizer, save_model
from jaxrl_llm.models.config import from_hf_config

TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "chat_template.jinja",
  "vocab.json",
  "merges.txt",
  "tokenizer.model",
)


class ExportError(ValueError):
  """A checkpoint that cannot be exported; the message says why and what to pass."""


def _locate(checkpoint) -> tuple[epath.Path, int | None]:
  """(the checkpoints directory, a step named by the path or None)."""
  path = epath.Path(checkpoint)
  if "://" not in str(checkpoint):  # a local path: Orbax reads absolute ones only
    path = epath.Path(Path(checkpoint).resolve())
  if not path.exists():
    raise ExportError(f"{path} does not exist; pass a run directory or its checkpoints/.")
  if (path / "checkpoints").is_dir():
    return path / "checkpoints", None
  if path.name.isdigit() and (path / "meta").exists():
    return path.parent, int(path.name)
  if any(p.name.isdigit() for p in path.iterdir()):
    return path, None
  raise ExportError(
    f"{path} holds no checkpoints (no numbered step directories); pass the run directory "
    "given as config.run.workdir, or its checkpoints/ directory."
  )


def load_policy(checkpoint, step: int | None = None) -> tuple[CausalLM, dict]:
  """The policy of a checkpoint's step (default: the newest), and the step's metadata."""
  directory, named = _locate(checkpoint)
  options = ocp.CheckpointManagerOptions(read_only=True, create=False, save_interval_steps=0)
  manager = ocp.CheckpointManager(directory, options=options)
  steps = sorted(manager.all_steps())
  step = step if step is not None else named if named is not None else (steps or [None])[-1]
  if step not in steps:
    raise ExportError(f"no step {step} in {directory}; it has steps {steps}.")
  meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
  if "model_config" not in meta:
    raise ExportError(f"step {step} in {directory} has no model config in its metadata.")
  model = meta["config"]["model"]
  dtype = jnp.dtype(model["param_dtype"])
  model_cfg = from_hf_config(
    meta["model_config"],
    param_dtype=dtype,
    dtype=dtype,
    scan_layers=bool(model.get("scan_layers", False)),  # the layout the checkpoint holds
  )
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: CausalLM(model_cfg, rngs=nnx.Rngs(0))))
  device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  item = {"policy": jax.tree.map(lambda x: x.update(sharding=device), abstract)}
  restored = manager.restore(
    step,
    args=ocp.args.Composite(
      state=ocp.args.PyTreeRestore(
        item=item,
        restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True,
      )
    ),
  )
  manager.close()
  return nnx.merge(graphdef, restored.state["policy"]), meta


def export(checkpoint, out, step: int | None = None) -> Path:
  """Writes the policy of `checkpoint` (newest step unless `step`) to `out`."""
  model, meta = load_policy(checkpoint, step)
  out = save_model(model, out)
  tok = meta.get("tokenizer", {})
  if tok.get("kind") == "char":
    CharTokenizer(tok["alphabet"], with_bos=tok["with_bos"]).save(out)
  elif tok.get("kind") == "hf":
    source = Path(tok["path"])
    copied = [f for f in TOKENIZER_FILES if (source / f).exists()]
    for name in copied:
      shutil.copy2(source / name, out / name)
    if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
      print(f"warning: no tokenizer files in {source}; copy them into {out}.", file=sys.stderr)
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m jaxrl_llm.export", description=__doc__.split("\n")[0]
  )
  parser.add_argument("--checkpoint", required=True, help="run dir, checkpoints/ or a step dir")
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
  parser.add_argument("--step", type=int, default=None, help="default: the newest step")
  args = parser.parse_args(argv)
  logging.set_verbosity(logging.ERROR)  # orbax announces that a read-only directory is read-only
  try:
    out = export(args.checkpoint, args.out, args.step)
  except ExportError as e:
    parser.exit(2, f"error: {e}\n")
  print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
  main()
