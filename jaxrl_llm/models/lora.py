"""LoRA adapters on the transformer's projections, and the base weights they ride on.

A targeted weight `W` (stored `[in..., out...]`) gains two `nnx.LoRAParam`s, `A: [in..., r]`
and `B: [r, out...]`, and its layer computes

  y = x W + (alpha / r) (x A) B                (Hu et al. 2021, "LoRA", eq. 3)

with `B = 0` at init, so a fresh adapter leaves the model exactly as it was. Only the
adapters train: `nnx.LoRAParam` is the filter that splits them from the frozen base.
Every adapter carries logical axes (the weight's own on its side, "lora" on the rank),
so it shards like the weight it adapts.

The base can be stored quantized (QLoRA, Dettmers et al. 2023): `quantize_base` replaces
each projection weight by a `qwix.QArray` (int8, int4 or nf4, one scale per output channel
and per `tile` inputs), which the layers dequantize on the fly. The adapters and their math
stay in float32 (or the compute dtype).

  lora = LoraConfig(rank=8, alpha=16)
  model = add_adapters(quantize_base(base_model, "nf4"), lora, seed=0)
  merged = merge_adapters(model)               # the plain model with W + (alpha/r) A B
"""

import contextlib
import contextvars
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx

# The projections an adapter can target: name -> (module, weight attribute, input ndim).
TARGETS = {
  "q": ("attn", "q_DxNxH", 1),
  "k": ("attn", "k_DxKxH", 1),
  "v": ("attn", "v_DxKxH", 1),
  "o": ("attn", "o_NxHxD", 2),
  "gate": ("mlp", "gate_DxF", 1),
  "up": ("mlp", "up_DxF", 1),
  "down": ("mlp", "down_FxD", 1),
}
# Hugging Face / PEFT module names of the targets.
HF_MODULES = {
  "q": "self_attn.q_proj",
  "k": "self_attn.k_proj",
  "v": "self_attn.v_proj",
  "o": "self_attn.o_proj",
  "gate": "mlp.gate_proj",
  "up": "mlp.up_proj",
  "down": "mlp.down_proj",
}
QUANT_TYPES = {"int8": jnp.int8, "int4": jnp.int4, "nf4": "nf4"}


def resolve_targets(patterns) -> tuple[str, ...]:
  """The targets named by `patterns`: each a regular expression matched in full against a
  target's short name ("q", "gate") or its module path ("attn.q", "mlp.gate"). Raises
  ValueError for a pattern that matches nothing."""
  if isinstance(patterns, str):
    patterns = [p.strip() for p in patterns.split(",") if p.strip()]
  chosen = set()
  for pattern in patterns:
    try:
      regex = re.compile(pattern)
    except re.error as e:
      raise ValueError(f"{pattern!r} is not a regular expression ({e}).") from None
    hits = {
      name
      for name, (module, _, _) in TARGETS.items()
      if regex.fullmatch(name) or regex.fullmatch(f"{module}.{name}")
    }
    if not hits:
      paths = ", ".join(f"{m}.{n}" for n, (m, _, _) in TARGETS.items())
      raise ValueError(f"{pattern!r} matches no projection; the projections are {paths}.")
    chosen |= hits
  return tuple(name for name in TARGETS if name in chosen)


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Adapters of rank `rank` on `targets` (names from `TARGETS`), scaled by `alpha / rank`.

  `dropout`: the rate at which the adapters' inputs are dropped in a differentiated pass
  run inside `dropout_key` (rollouts, old and reference log-probs never drop).
  """

  rank: int
  alpha: float = 16.0
  targets: tuple[str, ...] = tuple(TARGETS)
  dropout: float = 0.0

  def __post_init__(self):
    if self.rank <= 0:
      raise ValueError(f"LoraConfig.rank must be positive, got {self.rank}.")
    unknown = [t for t in self.targets if t not in TARGETS]
    if unknown or not self.targets:
      raise ValueError(f"LoraConfig.targets {self.targets} must be among {tuple(TARGETS)}.")
    if not 0.0 <= self.dropout < 1.0:
      raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout}.")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def init_adapter(module, name, lora, in_shape, in_axes, out_shape, out_axes, rngs):
  """Adds `<name>_lora_a` (`[in..., r]`, uniform in +-1/sqrt(in) as PEFT's Kaiming init) and
  `<name>_lora_b` (`[r, out...]`, zeros) to `module`, in float32, when `lora` targets it."""
  if name not in lora.targets:
    return
  r, fan_in = lora.rank, int(np.prod(in_shape))
  bound = 1.0 / np.sqrt(fan_in)
  a = jax.random.uniform(rngs.params(), (*in_shape, r), jnp.float32, -bound, bound)
  setattr(module, f"{name}_lora_a", nnx.LoRAParam(a, logical_axes=(*in_axes, "lora")))
  b = jnp.zeros((r, *out_shape), jnp.float32)
  setattr(module, f"{name}_lora_b", nnx.LoRAParam(b, logical_axes=("lora", *out_axes)))


_DROPOUT = contextvars.ContextVar("jaxrl_llm_lora_dropout", default=None)


@contextlib.contextmanager
def dropout_key(key, rate: float):
  """Within it (while a differentiated pass is traced), each adapter drops its input at
  `rate`, with its own key folded from `key` in call order."""
  if key is None or not rate:
    yield
    return
  token = _DROPOUT.set([key, rate, 0])
  try:
    yield
  finally:
    _DROPOUT.reset(token)


def delta(module, name, lora, x, dtype):
  """`(alpha / r) (x A) B` for `module`'s adapter `name`, shaped `[..., out...]`, or None when
  the projection has none. `x` is `[..., in]` with the input axes flattened."""
  if lora is None or name not in lora.targets:
    return None
  a = getattr(module, f"{name}_lora_a")[...]
  b = getattr(module, f"{name}_lora_b")[...]
  out_shape = b.shape[1:]
  state = _DROPOUT.get()
  if state is not None:
    key, rate, count = state
    state[2] += 1
    keep = jax.random.bernoulli(jax.random.fold_in(key, count), 1.0 - rate, x.shape)
    x = jnp.where(keep, x / (1.0 - rate), 0.0).astype(x.dtype)
  flat = x.reshape(-1, x.shape[-1])
  h = flat @ a.reshape(-1, a.shape[-1]).astype(dtype)
  y = (h @ b.reshape(b.shape[0], -1).astype(dtype)) * jnp.asarray(lora.scale, dtype)
  return y.reshape(*x.shape[:-1], *out_shape)


def weight(variable, dtype):
  """A base weight in `dtype`, dequantized when it is stored as a `qwix.QArray`."""
  value = variable[...]
  if isinstance(value, qwix.QArray):
    value = qwix.dequantize(value)
  return value.astype(dtype)


def _block_modules(model):
  """Each block's (attention, MLP) modules: one pair, stacked, with scanned layers."""
  layers = model.decoder.layers
  blocks = [layers] if model.cfg.scan_layers else list(layers)
  return [{"attn": block.attn, "mlp": block.mlp} for block in blocks]


def quantize_base(model, qtype: str, tile: int = 64):
  """`model` with every projection weight stored as a `qwix.QArray` of `qtype` ("int8",
  "int4" or "nf4"): one scale per output channel and per `tile` consecutive inputs (the
  last input axis; with fewer inputs there, one tile). Embeddings, norms and biases keep
  their dtype. Modifies and returns `model`."""
  if qtype not in QUANT_TYPES:
    raise ValueError(f"quantization {qtype!r} is unknown; use one of {sorted(QUANT_TYPES)}.")
  for modules in _block_modules(model):
    for module_name, attr, in_ndim in TARGETS.values():
      variable = getattr(modules[module_name], attr)
      value = variable[...]
      if isinstance(value, qwix.QArray):
        continue
      lead = 1 if model.cfg.scan_layers else 0  # the stacked layers axis
      in_axes = list(range(lead, lead + in_ndim))
      out_axes = list(range(lead + in_ndim, value.ndim))
      last_in = in_axes[-1]
      tiled = {last_in: min(tile, value.shape[last_in])}
      if value.shape[last_in] % tiled[last_in]:
        raise ValueError(
          f"{attr}: {value.shape[last_in]} inputs do not split into tiles of {tile}; "
          "choose a quantization tile that divides them."
        )
      channels = [*range(lead), *in_axes[:-1], *out_axes]
      variable.set_value(
        qwix.quantize(value, QUANT_TYPES[qtype], channelwise_axes=channels, tiled_axes=tiled)
      )
  return model


def add_adapters(model, lora: LoraConfig, seed: int):
  """A copy of `model` (a `CausalLM` without adapters) with fresh adapters: its weights are
  `model`'s own arrays (no copy), the adapters are drawn from `seed` (B = 0). Placement is
  the caller's: the trainer runs this inside its jitted, sharded state init."""
  cfg = model.cfg.replace(lora=lora)
  make = lambda: type(model)(cfg, rngs=nnx.Rngs(seed))
  graphdef = nnx.split(nnx.eval_shape(make))[0]
  # Only the adapters leave the jitted init, so XLA drops the base weights' initialisation.
  adapters = jax.jit(lambda: nnx.split(make(), nnx.LoRAParam, ...)[1])()
  return nnx.merge(graphdef, adapters, nnx.state(model))


def split_trainable(params: nnx.State) -> tuple[nnx.State, nnx.State | None]:
  """(what an optimizer updates, the frozen rest or None): with adapters in `params`, the
  adapters (`nnx.LoRAParam`) and the base, which stays as it is; without, all of `params`
  and None. The base is frozen by filtering params, not by copying models."""
  adapters, base = nnx.split_state(params, nnx.LoRAParam, ...)
  if not jax.tree.leaves(adapters):
    return params, None
  return adapters, base


def join_trainable(trainable: nnx.State, frozen: nnx.State | None) -> nnx.State:
  """The params `split_trainable` split, whole again."""
  return trainable if frozen is None else nnx.merge_state(trainable, frozen)


def merge_adapters(model, *, adapters: bool = True):
  """`model`'s base with each adapter folded in, `W + (alpha / r) A B`, as a `CausalLM`
  without adapters (quantized weights are dequantized to the config's `param_dtype`).
  `adapters=False`: the base alone."""
  lora, cfg = model.cfg.lora if adapters else None, model.cfg.replace(lora=None)
  graphdef, base = nnx.split(nnx.eval_shape(lambda: type(model)(cfg, rngs=nnx.Rngs(0))))
  params = nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.LoRAParam)))
  blocks = _block_paths(cfg)
  for path, modules in zip(blocks, _block_modules(model), strict=True):
    for name, (module_name, attr, _) in TARGETS.items():
      module = modules[module_name]
      w = weight(getattr(module, attr), cfg.param_dtype)
      if lora is not None and name in lora.targets:
        a, b = getattr(module, f"{name}_lora_a")[...], getattr(module, f"{name}_lora_b")[...]
        w = w + lora.scale * _product(a, b, w.shape, cfg.scan_layers).astype(w.dtype)
      tree = params
      for key in (*path, module_name):
        tree = tree[key]
      tree[attr] = w
  nnx.replace_by_pure_dict(base, params)
  return nnx.merge(graphdef, base)


def _product(a, b, shape, stacked: bool):
  """`A B` reshaped to the weight's `shape`; with `stacked`, per layer of the leading axis."""
  if stacked:
    L, r = a.shape[0], a.shape[-1]
    ab = jnp.matmul(a.reshape(L, -1, r), b.reshape(L, r, -1))
  else:
    ab = a.reshape(-1, a.shape[-1]) @ b.reshape(b.shape[0], -1)
  return ab.reshape(shape)


def _block_paths(cfg):
  if cfg.scan_layers:
    return [("decoder", "layers")]
  return [("decoder", "layers", i) for i in range(cfg.num_layers)]


def adapter_factors(model):
  """Per layer and target, the adapter as PEFT stores it: `{(layer, name): (lora_A [r, in],
  lora_B [out, r])}` numpy arrays, the inputs and outputs flattened as Hugging Face's."""
  lora = model.cfg.lora
  out = {}
  for i, modules in enumerate(_block_modules(model)):
    for name in lora.targets:
      module = modules[TARGETS[name][0]]
      a = np.asarray(jax.device_get(getattr(module, f"{name}_lora_a")[...]))
      b = np.asarray(jax.device_get(getattr(module, f"{name}_lora_b")[...]))
      layers = range(a.shape[0]) if model.cfg.scan_layers else [i]
      for j, layer in enumerate(layers):
        aj, bj = (a[j], b[j]) if model.cfg.scan_layers else (a, b)
        r = aj.shape[-1]
        out[layer, name] = (aj.reshape(-1, r).T.copy(), bj.reshape(r, -1).T.copy())
  return out
