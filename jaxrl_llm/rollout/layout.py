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

import math

import jax
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


def weight_bytes(params: nnx.State, dtype) -> int:
  """Bytes of `params` in the decode copy: floating arrays in `dtype`, quantized ones as
  they are (4-bit values count half a byte)."""
  total = 0
  for x in jax.tree.leaves(params):
    if np.issubdtype(x.dtype, np.floating):
      total += math.prod(x.shape) * np.dtype(dtype).itemsize
    else:
      total += -(-math.prod(x.shape) * _bits(x.dtype) // 8)
  return total


def _bits(dtype) -> int:
  try:
    return np.iinfo(dtype).bits
  except ValueError:
    return 8 * np.dtype(dtype).itemsize


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
  """A device's memory in bytes, where its backend says (not on CPU)."""
  stats = getattr(mesh.devices.flat[0], "memory_stats", lambda: None)()
  return None if not stats else stats.get("bytes_limit")


def decode_shardings(params: nnx.State, mesh: Mesh):
  """The decode layout's NamedSharding for every parameter (see `DECODE_RULES`)."""
  return param_shardings(params, mesh, DECODE_RULES)


def _cast(params, dtype):
  def one(x):
    if isinstance(x, qwix.QArray) or not np.issubdtype(x.dtype, np.floating):
      return x
    return x.astype(dtype)

  return jax.tree.map(one, params, is_leaf=lambda x: isinstance(x, qwix.QArray))


def to_decode_layout(params: nnx.State, mesh: Mesh, dtype) -> nnx.State:
  """A copy of `params` in `dtype` (floating arrays; quantized ones stay quantized) placed
  by `DECODE_RULES` on `mesh` (a decode mesh of the same devices). When every array is
  already so, `params` itself."""
  shardings = decode_shardings(params, mesh)
  cast = jax.eval_shape(lambda p: _cast(p, np.dtype(dtype)), params)
  same = all(
    x.dtype == c.dtype
    and getattr(x, "sharding", None) is not None
    and x.sharding.is_equivalent_to(s, x.ndim)
    for x, c, s in zip(
      jax.tree.leaves(params), jax.tree.leaves(cast), jax.tree.leaves(shardings), strict=True
    )
  )
  if same:
    return params
  # Cast where the arrays lie, then move them: a device-to-device reshard.
  cast = jax.jit(lambda p: _cast(p, np.dtype(dtype)))(params)
  return jax.device_put(cast, shardings)
