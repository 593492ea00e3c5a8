"""Hugging Face checkpoints in and out: `config.json` plus safetensors, never pickle.

  model = load_model("/path/to/Qwen2.5-0.5B-Instruct", dtype=jnp.bfloat16)
  save_model(model, "/path/to/out")       # transformers' from_pretrained reads it
  rm = load_reward_model("/path/to/a/Qwen2ForSequenceClassification")
  save_reward_model(rm, "/path/to/out", pad_token_id=0)

Tensors are read one at a time into an abstract (shape-only) model, converted to
our layout and placed (optionally straight onto their shardings), so peak host
memory is the loaded arrays plus about one tensor.
"""

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, for safetensors' numpy reader)
import numpy as np
import safetensors
from flax import nnx
from safetensors.numpy import save_file

from jaxrl_llm.models.config import (
  SEQUENCE_CLASSIFIERS,
  ModelConfig,
  from_hf_config,
  to_hf_config,
)
from jaxrl_llm.models.heads import RewardModel
from jaxrl_llm.models.transformer import CausalLM

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the model recomputes or does not use.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
  """A checkpoint directory that cannot be loaded as it is; the message names what and where."""


@dataclasses.dataclass(frozen=True)
class TensorSpec:
  """Where one Hugging Face tensor lives in our model, and how its layout differs.

  Linear weights are stored `[out, in]` by PyTorch and `[in, ..., out...]` here, so
  `transposed` ones are `w.T.reshape(ours)`; the others only reshape.
  """

  hf_name: str
  path: tuple
  hf_shape: tuple[int, ...]
  shape: tuple[int, ...]
  transposed: bool

  def to_ours(self, w: np.ndarray) -> np.ndarray:
    return (w.T if self.transposed else w).reshape(self.shape)

  def to_hf(self, a: np.ndarray) -> np.ndarray:
    if self.transposed:
      return np.ascontiguousarray(a.reshape(self.hf_shape[::-1]).T)
    return a.reshape(self.hf_shape)


def tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
  """Every tensor of a Llama/Qwen2 checkpoint for `cfg`, in file order."""
  D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  F, V = cfg.intermediate_size, cfg.vocab_size
  specs = [TensorSpec("model.embed_tokens.weight", ("decoder", "embed_VxD"), (V, D), (V, D), False)]
  for i in range(cfg.num_layers):
    hf, at = f"model.layers.{i}.", ("decoder", "layers", i)

    def add(name, path, hf_shape, shape, transposed, hf=hf, at=at):
      specs.append(TensorSpec(hf + name, at + path, hf_shape, shape, transposed))

    add("input_layernorm.weight", ("attn_norm", "scale"), (D,), (D,), False)
    add("self_attn.q_proj.weight", ("attn", "q_DxNxH"), (N * H, D), (D, N, H), True)
    add("self_attn.k_proj.weight", ("attn", "k_DxKxH"), (K * H, D), (D, K, H), True)
    add("self_attn.v_proj.weight", ("attn", "v_DxKxH"), (K * H, D), (D, K, H), True)
    add("self_attn.o_proj.weight", ("attn", "o_NxHxD"), (D, N * H), (N, H, D), True)
    if cfg.qkv_bias:
      add("self_attn.q_proj.bias", ("attn", "q_bias_NxH"), (N * H,), (N, H), False)
      add("self_attn.k_proj.bias", ("attn", "k_bias_KxH"), (K * H,), (K, H), False)
      add("self_attn.v_proj.bias", ("attn", "v_bias_KxH"), (K * H,), (K, H), False)
    if cfg.o_bias:
      add("self_attn.o_proj.bias", ("attn", "o_bias_D"), (D,), (D,), False)
    add("post_attention_layernorm.weight", ("mlp_norm", "scale"), (D,), (D,), False)
    add("mlp.gate_proj.weight", ("mlp", "gate_DxF"), (F, D), (D, F), True)
    add("mlp.up_proj.weight", ("mlp", "up_DxF"), (F, D), (D, F), True)
    add("mlp.down_proj.weight", ("mlp", "down_FxD"), (D, F), (F, D), True)
  specs.append(TensorSpec("model.norm.weight", ("decoder", "norm", "scale"), (D,), (D,), False))
  if not cfg.tie_word_embeddings:
    specs.append(TensorSpec("lm_head.weight", ("lm_head_DxV",), (V, D), (D, V), True))
  return specs


def reward_tensor_specs(cfg: ModelConfig) -> list[TensorSpec]:
  """Every tensor of a `*ForSequenceClassification` checkpoint with one label: the backbone
  and `score.weight` `[1, D]`, our `RewardModel.head_D` (transformers' score has no bias)."""
  backbone = [spec for spec in tensor_specs(cfg) if spec.hf_name != "lm_head.weight"]
  D = cfg.hidden_size
  return [*backbone, TensorSpec("score.weight", ("head_D",), (1, D), (D,), False)]


def read_config(path) -> dict:
  """The parsed `config.json` of a checkpoint directory, with errors that say what is wrong."""
  path = Path(path)
  if not path.is_dir():
    raise CheckpointError(f"{path} is not a directory; pass a local Hugging Face model directory.")
  config_file = path / "config.json"
  try:
    return json.loads(config_file.read_text())
  except FileNotFoundError:
    raise CheckpointError(f"{config_file} is missing; a Hugging Face directory needs it.") from None
  except json.JSONDecodeError as e:
    raise CheckpointError(f"{config_file} is not valid JSON: {e}.") from None


def _ids(value, where: Path) -> set[int]:
  """An `eos_token_id` entry (an int, a list of ints, or null) as a set of ids."""
  if value is None:
    return set()
  values = value if isinstance(value, list) else [value]
  if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
    raise CheckpointError(
      f"{where}: eos_token_id must be a token id or a list of them, got {value!r}."
    )
  return set(values)


def end_token_ids(path) -> tuple[int, ...]:
  """Every id a checkpoint declares as ending generation: `eos_token_id` of
  `generation_config.json` and of `config.json` (each an int or a list).

  Chat models end a turn with an id that is not always the tokenizer's `eos_token`
  (Qwen2.5's `<|im_end|>` and `<|endoftext|>`, Llama-3-Instruct's `<|eot_id|>` and
  `<|end_of_text|>`), and list them here; the sampler stops on any of them.
  """
  path = Path(path)
  ids = _ids(read_config(path).get("eos_token_id"), path / "config.json")
  generation_file = path / "generation_config.json"
  if generation_file.exists():
    try:
      generation = json.loads(generation_file.read_text())
    except json.JSONDecodeError as e:
      raise CheckpointError(f"{generation_file} is not valid JSON: {e}.") from None
    ids |= _ids(generation.get("eos_token_id"), generation_file)
  return tuple(sorted(ids))


def tensor_files(path) -> dict[str, Path]:
  """Tensor name -> safetensors file, from the shard index or the single file."""
  path = Path(path)
  index_file = path / INDEX_FILE
  if index_file.exists():
    try:
      weight_map = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError) as e:
      raise CheckpointError(f"{index_file} is not a safetensors index ({e!r}).") from None
    return {name: path / file for name, file in weight_map.items()}
  single = path / SINGLE_FILE
  if not single.exists():
    found = sorted(p.name for p in path.iterdir())
    hint = ""
    if any(f.endswith(".bin") for f in found):
      hint = (
        " PyTorch .bin checkpoints are not read (pickle); convert them to safetensors, e.g."
        " with transformers: AutoModelForCausalLM.from_pretrained(<dir>).save_pretrained(<dir>)."
      )
    raise CheckpointError(
      f"{path} has neither {SINGLE_FILE} nor {INDEX_FILE} (found {found}).{hint}"
    )
  with safetensors.safe_open(single, framework="numpy") as f:
    return dict.fromkeys(f.keys(), single)


def _by_file(names_to_files: dict[str, Path], names) -> Iterator[tuple[Path, list[str]]]:
  groups: dict[Path, list[str]] = {}
  for name in names:
    groups.setdefault(names_to_files[name], []).append(name)
  yield from groups.items()


def _set(tree: dict, path: tuple, value) -> None:
  for key in path[:-1]:
    tree = tree[key]
  tree[path[-1]] = value


def load_model(
  path,
  *,
  dtype=jnp.float32,
  param_dtype=None,
  sharding: Callable[[tuple[str, ...]], jax.sharding.Sharding] | None = None,
  remat: str = "none",
  scan_layers: bool = False,
  attention_chunk: int = 0,
) -> CausalLM:
  """Loads a local Hugging Face Llama or Qwen2 directory as a `CausalLM`.

  Args:
    path: a directory with `config.json` and `model.safetensors`, or sharded
      `model-*.safetensors` files with `model.safetensors.index.json`.
    dtype: the compute dtype (activations, matmuls).
    param_dtype: the dtype parameters are stored in (default: `dtype`).
    sharding: maps a parameter's logical axes (e.g. `("vocab", "embed")`) and shape to
      the `jax.sharding.Sharding` it is placed with; default: the default device.
    remat, scan_layers, attention_chunk: see `ModelConfig`. With `scan_layers` each layer
      tensor is read into its slot of the stacked parameter, placed once it is complete.

  Raises:
    CheckpointError: unsupported architecture, missing or unexpected tensor, or a
      shape mismatch; the message names the tensor and the file.
  """
  path = Path(path)
  kwargs = dict(remat=remat, scan_layers=scan_layers, attention_chunk=attention_chunk)
  cfg = _checkpoint_config(path, False, dtype=dtype, param_dtype=param_dtype or dtype, **kwargs)
  return _load(path, cfg, CausalLM, tensor_specs(cfg), sharding)


def load_reward_model(
  path,
  *,
  dtype=jnp.float32,
  param_dtype=None,
  sharding: Callable[[tuple[str, ...]], jax.sharding.Sharding] | None = None,
  remat: str = "none",
  scan_layers: bool = False,
  attention_chunk: int = 0,
) -> RewardModel:
  """Loads a local `LlamaForSequenceClassification` or `Qwen2ForSequenceClassification`
  directory with one label as a `RewardModel`: its score at each row's last real token equals
  transformers' logit (transformers finds that token by `pad_token_id`, we by the mask).
  Arguments as in `load_model`; the head stays float32.

  Raises:
    CheckpointError: not a one-label sequence classifier, or a tensor missing, unexpected or
      of the wrong shape; the message names the key or tensor and the file.
  """
  path = Path(path)
  kwargs = dict(remat=remat, scan_layers=scan_layers, attention_chunk=attention_chunk)
  cfg = _checkpoint_config(path, True, dtype=dtype, param_dtype=param_dtype or dtype, **kwargs)
  return _load(path, cfg, RewardModel, reward_tensor_specs(cfg), sharding)


def _checkpoint_config(path: Path, reward: bool, **kwargs) -> ModelConfig:
  """The ModelConfig of a directory's config.json, once it is the kind asked for: a causal
  LM, or (`reward`) a sequence classifier with one label."""
  hf = read_config(path)
  archs = hf.get("architectures") or []
  where = path / "config.json"
  if set(archs) & set(SEQUENCE_CLASSIFIERS) and not reward:
    raise CheckpointError(
      f"{where}: {archs} is a reward model (a sequence classifier, no language-model head); "
      "load it with `load_reward_model`."
    )
  if reward and not set(archs) & set(SEQUENCE_CLASSIFIERS):
    raise CheckpointError(
      f"{where}: architectures {archs} is not a reward model; pass a directory with one of "
      f"{sorted(SEQUENCE_CLASSIFIERS)} (a causal LM loads with `load_model`, and "
      "`RewardModel.from_policy` puts a fresh head on it)."
    )
  labels = hf.get("num_labels", len(hf.get("id2label") or {0: "LABEL_0", 1: "LABEL_1"}))
  if reward and labels != 1:
    raise CheckpointError(
      f"{where}: a reward model has one label (a scalar score); this one has {labels} "
      "(id2label); export it with num_labels=1."
    )
  try:
    return from_hf_config(hf, **kwargs)
  except (KeyError, ValueError) as e:
    raise CheckpointError(f"{where}: {str(e).removeprefix('config.json: ')}") from None


def _load(path: Path, cfg: ModelConfig, cls, specs: list[TensorSpec], sharding):
  """An abstract `cls(cfg)` filled from the directory's tensors (`specs`), each in its
  parameter's own dtype (a scalar head stays float32); a parameter no file holds is 0."""
  files = tensor_files(path)
  specs = {spec.hf_name: spec for spec in specs}
  _check_tensor_names(path, cfg, files, specs)
  abstract = nnx.eval_shape(lambda: cls(cfg, rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(abstract)
  params = nnx.to_pure_dict(state)
  place = lambda at, value: jax.device_put(
    value, None if sharding is None else sharding(_get(state, at).logical_axes, value.shape)
  )
  _read_tensors(cfg, files, specs, params, place)
  params = jax.tree_util.tree_map_with_path(  # what no file holds (a reward model's bias): 0
    lambda keys, x: (
      place(tuple(k.key for k in keys), np.zeros(x.shape, x.dtype))
      if isinstance(x, jax.ShapeDtypeStruct)
      else x
    ),
    params,
  )
  nnx.replace_by_pure_dict(state, params)
  return nnx.merge(graphdef, state)


def _check_tensor_names(path: Path, cfg, files: dict, specs: dict) -> None:
  """Every tensor the config implies is in the files, and every file tensor is one of them."""
  missing = [name for name in specs if name not in files]
  if missing:
    where = INDEX_FILE if (path / INDEX_FILE).exists() else SINGLE_FILE
    raise CheckpointError(
      f"tensor {missing[0]!r} is missing from {path / where}"
      f"{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}."
    )
  unexpected = [
    n
    for n in files
    if n not in specs
    and not _IGNORED.match(n)
    and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
  ]
  if unexpected:
    raise CheckpointError(
      f"tensor {unexpected[0]!r} in {files[unexpected[0]]} is not part of a {cfg.architecture} "
      f"model with this config.json ({len(unexpected)} unexpected in all)."
    )


def _read_tensors(cfg, files: dict, specs: dict, params: dict, place) -> None:
  """Each file's tensors into `params`, placed by `place(path, value)`; a scanned layer's
  tensor goes into its slot of the stacked parameter, placed once the stack is complete."""
  stacks: dict[tuple, np.ndarray] = {}  # scanned layers: stacked path -> [L, ...] buffer
  for file, names in _by_file(files, specs):
    with safetensors.safe_open(file, framework="numpy") as f:
      for name in names:
        spec = specs[name]
        if name not in f.keys():
          raise CheckpointError(f"tensor {name!r} is missing from {file}.")
        shape = tuple(f.get_slice(name).get_shape())
        if shape != spec.hf_shape:
          raise CheckpointError(
            f"tensor {name!r} in {file} has shape {list(shape)}; this "
            f"config.json implies {list(spec.hf_shape)}."
          )
        at, layer = _stacked_at(cfg, spec.path)
        np_dtype = np.dtype(_get(params, at).dtype)  # the parameter's own (heads: float32)
        value = spec.to_ours(f.get_tensor(name)).astype(np_dtype, copy=False)
        if layer is None:
          _set(params, at, place(at, value))
        else:
          if at not in stacks:
            stacks[at] = np.empty((cfg.num_layers, *spec.shape), np_dtype)
          stacks[at][layer] = value
        del value
  for at, value in stacks.items():
    _set(params, at, place(at, value))


def _get(tree: dict, path: tuple):
  for key in path:
    tree = tree[key]
  return tree


def _stacked_at(cfg: ModelConfig, path: tuple) -> tuple[tuple, int | None]:
  """Where a tensor of `tensor_specs` lives in this layout: its own path and no layer, or,
  with scanned layers, the stacked parameter's path and its layer index."""
  if cfg.scan_layers and path[:2] == ("decoder", "layers"):
    return ("decoder", "layers", *path[3:]), path[2]
  return path, None


def _tensor(cfg: ModelConfig, params: dict, path: tuple):
  at, layer = _stacked_at(cfg, path)
  value = _get(params, at)
  return value if layer is None else value[layer]


def save_model(model: CausalLM, path, *, max_shard_bytes: int = 5 * 2**30) -> Path:
  """Writes `model` as a Hugging Face directory (config.json, generation_config.json,
  safetensors, sharded above `max_shard_bytes`) that `from_pretrained` loads."""
  return _save(model, to_hf_config(model.cfg), tensor_specs(model.cfg), path, max_shard_bytes)


def save_reward_model(
  model: RewardModel, path, *, pad_token_id: int, max_shard_bytes: int = 5 * 2**30
) -> Path:
  """Writes `model` as a one-label `*ForSequenceClassification` directory that
  `AutoModelForSequenceClassification.from_pretrained` loads. transformers finds each row's
  last token by `pad_token_id` (the tokenizer's pad id), so it goes into config.json; its
  score has no bias, so the model's `head_bias` must be 0 (the reward trainer keeps it so)."""
  bias = float(jax.device_get(model.head_bias[...]))
  if bias != 0.0:
    raise ValueError(
      f"head_bias is {bias}; transformers' score layer has no bias. Subtract it from the "
      "scores (a constant shift leaves every preference unchanged) and set it to 0 first."
    )
  hf = to_hf_config(model.cfg)
  hf["architectures"] = [
    next(k for k, v in SEQUENCE_CLASSIFIERS.items() if v == model.cfg.architecture)
  ]
  hf.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
  hf["pad_token_id"] = int(pad_token_id)
  return _save(model, hf, reward_tensor_specs(model.cfg), path, max_shard_bytes)


def _save(model, hf_config: dict, specs: list[TensorSpec], path, max_shard_bytes: int) -> Path:
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  cfg = model.cfg
  (path / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
  generation = {
    k: v
    for k, v in (("bos_token_id", cfg.bos_token_id), ("eos_token_id", cfg.eos_token_id))
    if v is not None
  }
  (path / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
  params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  for spec in specs:
    tensor = spec.to_hf(np.asarray(jax.device_get(_tensor(cfg, params, spec.path))))
    if shards[-1] and size + tensor.nbytes > max_shard_bytes:
      shards.append({})
      size = 0
    shards[-1][spec.hf_name] = tensor
    size += tensor.nbytes
  for stale in list(path.glob("model*.safetensors")) + [path / INDEX_FILE]:
    stale.unlink(missing_ok=True)
  if len(shards) == 1:
    save_file(shards[0], path / SINGLE_FILE, metadata={"format": "pt"})
    return path
  weight_map, total = {}, 0
  for i, shard in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    save_file(shard, path / name, metadata={"format": "pt"})
    weight_map.update(dict.fromkeys(shard, name))
    total += sum(t.nbytes for t in shard.values())
  index = {"metadata": {"total_size": total}, "weight_map": weight_map}
  (path / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
  return path
