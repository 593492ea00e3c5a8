"""Test setup: 8 fake CPU devices, set before JAX initialises its backend."""

import jax

jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")

import pytest  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


class DataMesh:
  """A 1-D ('data',) mesh over the 8 fake devices, and placement onto it."""

  def __init__(self):
    self.mesh = jax.make_mesh((8,), ("data",))

  def shard(self, x):
    """Splits the leading axis of every leaf over 'data'."""
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(self.mesh, P("data"))), x)

  def replicate(self, x):
    return jax.tree.map(lambda a: jax.device_put(a, NamedSharding(self.mesh, P())), x)


@pytest.fixture(scope="session")
def data_mesh():
  assert jax.device_count() == 8, "tests expect 8 fake CPU devices"
  return DataMesh()
