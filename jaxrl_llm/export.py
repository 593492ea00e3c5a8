"""Exports a trained policy from a checkpoint as a Hugging Face directory.

  python -m jaxrl_llm.export --checkpoint runs/default --out exported/default [--step 1500]
  python -m jaxrl_llm.export --checkpoint runs/lora --out exported/merged --merge
  python -m jaxrl_llm.export --checkpoint runs/lora --out exported/adapter --adapter

`--checkpoint` is a run directory, its `checkpoints/` directory, or one step's
directory. Only the policy is read (not the optimizer states or the critic). The
output has `config.json`, `generation_config.json`, safetensors weights (through
`jaxrl_llm.models.save_model`) and the tokenizer: the base model's tokenizer files
when the run started from `model.path`, or the character vocabulary as a fast
tokenizer otherwise, so `transformers.AutoModelForCausalLM.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` (and serving engines) read it.

A LoRA run's checkpoint is exported either `--merge`d (the base with every adapter folded
in, `W + (alpha / r) A B`, dequantized if the base was quantized: a plain model as above)
or as an `--adapter` directory that PEFT loads onto the base (`adapter_config.json` and
`adapter_model.safetensors`; `PeftModel.from_pretrained(base, out)`). The adapter names its
base: `model.path`, or, when the run made the base itself (random init or a warm start),
a copy written to `out/base`.
"""

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from flax import nnx

from jaxrl_llm.models import CausalLM, copy_tokenizer, load_model, save_model
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models.config import from_hf_config
from jaxrl_llm.train import state as state_lib
from jaxrl_llm.train.checkpoint import fingerprint
from jaxrl_llm.train.learner import policy_graphdef
from jaxrl_llm.train.validate import from_config_dict


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
  """The policy of a checkpoint's step (default: the newest), and the step's metadata. A
  LoRA policy comes with its adapters (and its base as it trained, quantized or not)."""
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
  base_def, base = nnx.split(nnx.eval_shape(lambda: CausalLM(model_cfg, rngs=nnx.Rngs(0))))
  lora_base = meta.get("lora_base")
  cfg = from_config_dict(meta["config"]) if meta["config"].get("lora", {}).get("rank") else None
  if cfg is None:
    graphdef, abstract = base_def, base
  else:
    abstract = jax.eval_shape(lambda b: state_lib.with_adapters(cfg, base_def, b), base)
    graphdef = policy_graphdef(cfg, model_cfg)
    if lora_base is not None:  # the checkpoint holds the adapters only
      abstract = nnx.state(nnx.merge(graphdef, abstract), nnx.LoRAParam)
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
  policy = restored.state["policy"]
  if lora_base is not None:
    policy = nnx.merge_state(policy, _lora_base(cfg, lora_base))
  return nnx.merge(graphdef, policy), meta


def _lora_base(cfg, recorded: dict) -> nnx.State:
  """The frozen base a LoRA checkpoint names (loaded from its path and quantized as in
  training), checked against the fingerprint the checkpoint recorded."""
  path = recorded["path"]
  dtype = jnp.dtype(cfg.model.param_dtype)
  try:
    model = load_model(path, dtype=dtype, param_dtype=dtype, scan_layers=cfg.model.scan_layers)
  except (OSError, ValueError) as e:
    raise ExportError(f"the LoRA base {path} cannot be loaded: {e}") from None
  base_def, base = nnx.split(model)
  frozen = lora_lib.split_trainable(state_lib.with_adapters(cfg, base_def, base))[1]
  if [int(v) for v in jax.device_get(fingerprint(frozen))] != recorded["fingerprint"]:
    raise ExportError(
      f"the weights at {path} are not the base these adapters were trained on (their "
      "fingerprint differs from the checkpoint's); restore that base there first."
    )
  return frozen


def export(
  checkpoint, out, step: int | None = None, *, merge: bool = False, adapter: bool = False
) -> Path:
  """Writes the policy of `checkpoint` (newest step unless `step`) to `out`: the model, or
  for a LoRA run the merged model (`merge`) or a PEFT adapter directory (`adapter`)."""
  if merge and adapter:
    raise ExportError("pass one of --merge and --adapter.")
  model, meta = load_policy(checkpoint, step)
  lora = model.cfg.lora
  if lora is None and (merge or adapter):
    raise ExportError(
      f"{checkpoint} is not a LoRA run (config.lora.rank=0); export it without "
      f"--{'merge' if merge else 'adapter'}."
    )
  if lora is not None and not (merge or adapter):
    raise ExportError(
      f"{checkpoint} is a LoRA run: pass --merge (the base with the adapters folded in) or "
      "--adapter (a PEFT adapter directory)."
    )
  out = Path(out)
  if adapter:
    base_path = (meta.get("lora_base") or {}).get("path")
    if base_path is None:  # the run made its base: write it beside the adapter
      base_path = str(save_model(lora_lib.merge_adapters(model, adapters=False), out / "base"))
      copy_tokenizer(meta, Path(base_path))
    save_adapter(model, out, base_path)
    return out
  out = save_model(lora_lib.merge_adapters(model) if merge else model, out)
  copy_tokenizer(meta, out)
  return out


def save_adapter(model, out, base_path: str) -> Path:
  """Writes `model`'s adapters as a PEFT LoRA directory for the Hugging Face model at
  `base_path`: `adapter_config.json` and `adapter_model.safetensors` (lora_A `[r, in]`,
  lora_B `[out, r]` per projection)."""
  from safetensors.numpy import save_file

  lora, out = model.cfg.lora, Path(out)
  out.mkdir(parents=True, exist_ok=True)
  tensors = {}
  for (layer, name), (a, b) in lora_lib.adapter_factors(model).items():
    prefix = f"base_model.model.model.layers.{layer}.{lora_lib.HF_MODULES[name]}"
    tensors[f"{prefix}.lora_A.weight"] = a.astype(np.float32)
    tensors[f"{prefix}.lora_B.weight"] = b.astype(np.float32)
  save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
  config = {
    "peft_type": "LORA",
    "task_type": "CAUSAL_LM",
    "base_model_name_or_path": str(Path(base_path).resolve()),
    "r": lora.rank,
    "lora_alpha": lora.alpha,
    "lora_dropout": lora.dropout,
    "target_modules": [lora_lib.HF_MODULES[t].split(".")[-1] for t in lora.targets],
    "bias": "none",
    "fan_in_fan_out": False,
    "use_rslora": False,
    "use_dora": False,
    "init_lora_weights": True,
    "inference_mode": True,
    "modules_to_save": None,
  }
  (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
  return out


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(
    prog="python -m jaxrl_llm.export", description=__doc__.split("\n")[0]
  )
  parser.add_argument("--checkpoint", required=True, help="run dir, checkpoints/ or a step dir")
  parser.add_argument("--out", required=True, help="the Hugging Face directory to write")
  parser.add_argument("--step", type=int, default=None, help="default: the newest step")
  parser.add_argument("--merge", action="store_true", help="LoRA: fold the adapters in")
  parser.add_argument("--adapter", action="store_true", help="LoRA: a PEFT adapter directory")
  args = parser.parse_args(argv)
  logging.set_verbosity(logging.ERROR)  # orbax announces that a read-only directory is read-only
  try:
    out = export(args.checkpoint, args.out, args.step, merge=args.merge, adapter=args.adapter)
  except ExportError as e:
    parser.exit(2, f"error: {e}\n")
  print(f"exported {args.checkpoint} -> {out}")


if __name__ == "__main__":
  main()
