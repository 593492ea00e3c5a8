"""Declared sharding: a mesh with axes (data, fsdp, tensor) and one table from logical axes to them.

Every parameter names its axes (`logical_axes` metadata: layers, vocab, embed, heads,
kv_heads, head_dim, mlp, and lora for an adapter's rank); `ShardingRules` maps each name
to a mesh axis (or None, replicated). Batches are split over `data` (and `fsdp`, which also holds
a shard of every parameter).
"""

import contextlib
import contextvars
import dataclasses

import jax
import numpy as np
import qwix
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # a batch's leading axis is split over both


@dataclasses.dataclass(frozen=True)
class ShardingRules:
  """Logical axis -> mesh axis. The default is FSDP over `fsdp` plus Megatron-style tensor
  parallelism over `tensor` (heads and the MLP's hidden axis)."""

  layers: str | None = None  # the stacked axis of scanned layers
  vocab: str | None = "tensor"
  embed: str | None = "fsdp"
  heads: str | None = "tensor"
  kv_heads: str | None = "tensor"
  head_dim: str | None = None
  mlp: str | None = "tensor"
  lora: str | None = None  # an adapter's rank axis

  def spec(self, logical_axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh) -> P:
    """The PartitionSpec for one array; an axis whose size the mesh axis does not divide
    (e.g. 2 kv heads over 4 tensor shards) stays replicated."""
    out, used = [], set()
    for name, size in zip(logical_axes, shape, strict=True):
      axis = getattr(self, name) if name is not None else None
      if axis is None or axis in used or size % mesh.shape[axis]:
        out.append(None)
      else:
        out.append(axis)
        used.add(axis)
    return P(*out)


DEFAULT_RULES = ShardingRules()


def make_mesh(data: int = -1, fsdp: int = 1, tensor: int = 1, devices=None) -> Mesh:
  """A (data, fsdp, tensor) mesh; -1 on `data` takes the devices the others leave."""
  devices = jax.devices() if devices is None else devices
  n = len(devices)
  if data == -1:
    if n % (fsdp * tensor):
      raise ValueError(f"mesh fsdp={fsdp} x tensor={tensor} does not divide {n} devices.")
    data = n // (fsdp * tensor)
  if data * fsdp * tensor != n:
    raise ValueError(
      f"mesh data={data} x fsdp={fsdp} x tensor={tensor} = {data * fsdp * tensor} must equal "
      f"the {n} devices; set mesh.data=-1 to take the rest."
    )
  return jax.make_mesh(
    (data, fsdp, tensor), MESH_AXES, axis_types=(AxisType.Auto,) * 3, devices=devices
  )


def batch_sharding(mesh: Mesh, ndim: int = 1) -> NamedSharding:
  """Leading axis over (data, fsdp); the rest replicated."""
  return NamedSharding(mesh, P(BATCH_AXES, *([None] * (ndim - 1))))


def batch_size_divisor(mesh: Mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in BATCH_AXES]))


def param_shardings(state: nnx.State, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
  """A NamedSharding for every parameter of `state`, from its logical axes. A quantized
  parameter (a `qwix.QArray`) gets one for its values and one for its scales, each split
  where the mesh divides that array's own axis."""

  def one(v):
    def place(x):
      return None if x is None else NamedSharding(mesh, rules.spec(v.logical_axes, x.shape, mesh))

    value = v.get_value()
    if isinstance(value, qwix.QArray):
      parts = {"qvalue": value.qvalue, "scale": value.scale, "zero_point": value.zero_point}
      return v.replace(dataclasses.replace(value, **{k: place(x) for k, x in parts.items()}))
    return place(v)

  return jax.tree.map(one, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_params(state: nnx.State, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
  """`state` placed by the rules (a no-op for arrays already placed so)."""
  shardings = param_shardings(state, mesh, rules)
  return jax.tree.map(
    lambda v, s: v.replace(
      jax.device_put(v.get_value(), s.get_value() if isinstance(s, nnx.Variable) else s)
    ),
    state,
    shardings,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )


_ROWS_MESH = contextvars.ContextVar("jaxrl_llm_rows_mesh", default=None)


@contextlib.contextmanager
def rows_over(mesh: Mesh | None):
  """Within it, `split_rows` splits activations' rows over `mesh`'s batch axes. The trainer's
  and the sampler's jitted functions trace the model inside it."""
  token = _ROWS_MESH.set(mesh)
  try:
    yield
  finally:
    _ROWS_MESH.reset(token)


def current_rows_mesh() -> Mesh | None:
  """The mesh set by the enclosing `rows_over` (None outside one)."""
  return _ROWS_MESH.get()


def split_rows(x):
  """`x` constrained to split its leading (row) axis over the batch axes of the mesh set by
  `rows_over` (unchanged without one, or when the rows do not divide). The decoder applies it
  to its embedded tokens: without it the partitioner may carry the embedding's FSDP split
  of the hidden axis into the activations, so that every device computes every row of
  attention and holds every row's activations."""
  mesh = _ROWS_MESH.get()
  if mesh is None or x.shape[0] % batch_size_divisor(mesh):
    return x
  return jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim))
