"""The sampler's own placement of the weights: the decode layout.

Training keeps its weights split by FSDP, so a decode step laid out like a training step
would all-gather every weight for every token. The sampler instead runs on a copy made
once per update: cast to the compute dtype (exact: every layer casts its weights to that
dtype before using them) and placed on a *decode mesh* of the same devices,

  (data, fsdp, tensor) = (devices / t, 1, t),  t = rollout.tensor

with rows over `data`, attention heads, KV heads, MLP columns and the vocabulary over
`tensor` where they divide (Megatron-style), and everything else replicated. A decode step
then reads only its own shard of the weights; its collectives are the tensor-parallel
reductions of activations (after the output and down projections, the embedding lookup,
and the logits' vocabulary shards). The KV cache follows: rows over `data`, KV heads over
`tensor`.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
from jax.sharding import AxisType, Mesh

from jaxrl_llm.models.sharding import MESH_AXES, ShardingRules, param_shardings

DECODE_RULES = ShardingRules(
  layers=None,
  vocab="tensor",
  embed=None,
  heads="tensor",
  kv_heads="tensor",
  head_dim=None,
  mlp="tensor",
  lora=None,
)


def decode_mesh(mesh: Mesh, tensor: int) -> Mesh:
  """The decode mesh of `mesh`'s devices, in their order (so a jitted function may take
  arrays on both): `tensor` consecutive devices share each row group, so over several
  slices a tensor group stays inside one (the data axis is the mesh's outermost)."""
  devices = list(mesh.devices.flat)
  if tensor < 1 or len(devices) % tensor:
    raise ValueError(
      f"rollout.tensor={tensor} must divide the mesh's {len(devices)} devices; set it to a "
      "divisor (or 0 to let the sampler choose)."
    )
  grid = np.array(devices, dtype=object).reshape(len(devices) // tensor, 1, tensor)
  return Mesh(grid, MESH_AXES, axis_types=(AxisType.Auto,) * 3)


def dtype_bits(dtype) -> int:
  """Bits an element of `dtype` takes, 4 for int4 and nf4 (as accelerators pack them)."""
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.iinfo(dtype).bits
  if jnp.issubdtype(dtype, jnp.floating):
    return jnp.finfo(dtype).bits
  return 8 * dtype.itemsize


def weight_bytes(params: nnx.State, dtype) -> int:
  """Bytes of `params`' decode copy (`cast_weights(params, dtype)`), all devices together."""
  cast = jax.eval_shape(functools.partial(cast_weights, dtype=np.dtype(dtype)), params)
  return sum(-(-math.prod(x.shape) * dtype_bits(x.dtype) // 8) for x in jax.tree.leaves(cast))


def choose_tensor(mesh: Mesh, decode_weight_bytes: int, device_memory: int | None) -> int:
  """`rollout.tensor=0`'s choice: the training mesh's own tensor axis, widened (doubling,
  while it divides the devices) until the decode copy takes at most a quarter of a device's
  memory, when that memory is known. Fewer tensor shards mean fewer reductions per token
  and more rows per device; more shards mean less of the weights per device."""
  n, t = mesh.size, mesh.shape["tensor"]
  if device_memory is None:
    return t
  while decode_weight_bytes / t > device_memory / 4 and n % (2 * t) == 0:
    t *= 2
  return t


def device_memory(mesh: Mesh) -> int | None:
  """A device's memory in bytes, where its backend says (not on CPU); the same on every
  process (each asks one of its own devices: the mesh's devices are of one kind)."""
  device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
  stats = getattr(device, "memory_stats", lambda: None)()
  return None if not stats else stats.get("bytes_limit")


def decode_shardings(params: nnx.State, mesh: Mesh):
  """The decode layout's NamedSharding for every parameter (see `DECODE_RULES`)."""
  return param_shardings(params, mesh, DECODE_RULES)


def cast_weights(params, dtype):
  """`params` with every floating array in `dtype` and every quantized weight (a QLoRA base's
  `qwix.QArray`) dequantized into `dtype`, as each layer would do on every call
  (`lora.weight`), so a decode step reads plain weights and computes the same numbers."""

  def one(x):
    if isinstance(x, qwix.QArray):
      return qwix.dequantize(x).astype(dtype)
    if not np.issubdtype(x.dtype, np.floating):
      return x
    return x.astype(dtype)

  return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, qwix.QArray))


def _cast_to(params, *, dtype, shardings):
  leaves, treedef = jax.tree.flatten(shardings)
  return _caster(dtype, treedef, tuple(leaves))(params)


@functools.lru_cache(maxsize=16)
def _caster(dtype, treedef, shardings):
  """`cast_weights` jitted to place its result by `shardings` (flattened by `treedef`)."""
  out = jax.tree.unflatten(treedef, shardings)
  return jax.jit(functools.partial(cast_weights, dtype=dtype), out_shardings=out)


def to_decode_layout(params: nnx.State, mesh: Mesh, dtype) -> nnx.State:
  """A copy of `params` in `dtype` (`cast_weights`) placed by `DECODE_RULES` on `mesh` (a
  decode mesh of the same devices). When every array is already so, `params` itself (the
  check is cached by the arrays' shapes, dtypes and shardings: it runs on every call)."""
  dtype = np.dtype(dtype)
  leaves, treedef = jax.tree.flatten(params)
  placed = tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)
  if _in_decode_layout(treedef, placed, mesh, dtype):
    return params
  # One program casts and reshards (its collectives span every process of a multi-host
  # mesh, where a device_put between processes could not).
  cast = jax.eval_shape(functools.partial(cast_weights, dtype=dtype), params)
  return _cast_to(params, dtype=dtype, shardings=decode_shardings(cast, mesh))


@functools.lru_cache(maxsize=64)
def _in_decode_layout(treedef, placed, mesh: Mesh, dtype) -> bool:
  """Whether arrays of these shapes, dtypes and shardings are their own decode copy."""
  if any(sharding is None for _, _, sharding in placed):
    return False
  params = jax.tree.unflatten(
    treedef, [jax.ShapeDtypeStruct(shape, dt, sharding=sh) for shape, dt, sh in placed]
  )
  cast = jax.eval_shape(functools.partial(cast_weights, dtype=dtype), params)
  if jax.tree.structure(cast) != treedef:
    return False
  shardings = jax.tree.leaves(decode_shardings(cast, mesh))
  return all(
    dt == c.dtype and sh.is_equivalent_to(s, len(shape))
    for (shape, dt, sh), c, s in zip(placed, jax.tree.leaves(cast), shardings, strict=True)
  )
