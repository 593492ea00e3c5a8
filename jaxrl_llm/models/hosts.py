"""Host-side data across processes: which rows of a global batch this process owns, global
arrays from process-local rows, and host values gathered from every process.

With one process every function here is the identity (or a plain `device_put`), so the
host loop is written once: it tokenizes, decodes and scores only this process's rows
of each batch, and builds global arrays with `jax.make_array_from_process_local_data`.
A batch is sharded on its leading axis over the mesh's (data, fsdp) axes; each
process's devices must hold one contiguous block of rows, as they do on meshes built
by `jaxrl_llm.models.sharding.make_mesh` (devices in process order).
"""

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxrl_llm.models.sharding import batch_sharding


def local_rows(mesh: Mesh, global_rows: int) -> slice:
  """The rows of a `[global_rows, ...]` batch that this process's devices hold."""
  indices = batch_sharding(mesh, 1).addressable_devices_indices_map((global_rows,)).values()
  spans = sorted({(s[0].start or 0, s[0].stop or global_rows) for s in indices})
  start, stop = spans[0][0], spans[-1][1]
  per_process = global_rows // jax.process_count()
  if sum(b - a for a, b in spans) != stop - start or start != jax.process_index() * per_process:
    raise ValueError(
      f"process {jax.process_index()}'s devices hold rows {spans} of a {global_rows}-row "
      "batch, not its own contiguous block in process order; build the mesh with "
      "jaxrl_llm.models.sharding.make_mesh (devices in process order)."
    )
  return slice(start, stop)


def to_global(mesh: Mesh, local: np.ndarray, global_rows: int) -> jax.Array:
  """A batch-sharded global array from this process's rows of it."""
  local = np.asarray(local)
  shape = (global_rows, *local.shape[1:])
  return jax.make_array_from_process_local_data(batch_sharding(mesh, local.ndim), local, shape)


def global_batch(mesh: Mesh, tree):
  """Every leaf of `tree` (this process's rows, all rows with one process) as a global
  batch-sharded array; every process holds as many rows."""
  n = jax.process_count()
  return jax.tree.map(lambda x: to_global(mesh, x, np.shape(x)[0] * n), tree)


def to_local(x: jax.Array) -> np.ndarray:
  """This process's rows of a batch-sharded global array, as numpy."""
  if jax.process_count() == 1:
    return np.asarray(jax.device_get(x))
  blocks = {}
  for shard in x.addressable_shards:
    start = shard.index[0].start or 0
    blocks.setdefault(start, shard.data)
  return np.concatenate([np.asarray(blocks[k]) for k in sorted(blocks)])


def gather(local: np.ndarray) -> np.ndarray:
  """Every process's rows, in global order (each process passes its `local_rows`)."""
  local = np.asarray(local)
  if jax.process_count() == 1:
    return local
  return np.asarray(multihost_utils.process_allgather(local, tiled=True))


def global_max(value: int) -> int:
  if jax.process_count() == 1:
    return int(value)
  return int(np.max(multihost_utils.process_allgather(np.array(value))))


def any_process(flag: bool) -> bool:
  """Whether `flag` is set on any process."""
  if jax.process_count() == 1:
    return bool(flag)
  return bool(np.any(multihost_utils.process_allgather(np.array(flag))))


def barrier(name: str) -> None:
  """Waits for every process (after process 0 changed files the others will read)."""
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
