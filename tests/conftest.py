"""Test setup: the CPU backend with 8 fake devices, set before JAX initialises it, and a
persistent compilation cache shared by the test processes and the runs they start."""

import os
import tempfile

# CPU only, for the test processes and the runs they start: with the plan extra installed,
# JAX would otherwise probe for TPUs and GPUs it cannot find.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

CACHE = os.environ.setdefault(
  "JAX_COMPILATION_CACHE_DIR", os.path.join(tempfile.gettempdir(), "jaxrl_llm_test_cache")
)
# Programs that compile in under a second are not written: the suite's eager ops compile
# thousands of them, each cached in memory by its process anyway, and writing them all cost
# more than it saved on a cold cache. The trainer's programs, which the CLI runs reuse, take
# longer and are written.
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "1")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_compilation_cache_dir", CACHE)
jax.config.update(
  "jax_persistent_cache_min_compile_time_secs",
  float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
)

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
