"""Test setup: the CPU backend with 8 fake devices, set before JAX initialises it."""

import os

# CPU only, for the test processes and the runs they start: with the plan extra installed,
# JAX would otherwise probe for TPUs and GPUs it cannot find.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

# No persistent compilation cache unless the caller sets one (JAX_COMPILATION_CACHE_DIR):
# executables that XLA:CPU read back from it crashed this long-lived process (a segfault in
# a later compile or cache read, some 650 tests in), and without it the suite took about as
# long (899 s against some 820 s with it, up to the crash).
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
