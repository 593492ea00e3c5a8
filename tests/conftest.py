"""Test setup: the CPU backend with 8 fake devices, set before JAX initialises it."""

import os

# CPU only, for the test processes and the runs they start: with the plan extra installed,
# JAX would otherwise probe for TPUs and GPUs it cannot find.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The tests' programs are tiny and compiled once or twice each: compiling them is most of the
# suite's time, and XLA:CPU compiles some 40% faster without LLVM's optimisation passes
# (level 0). Every comparison a test makes is between runs under the same flags, or to a
# reference within a tolerance. Subprocesses inherit it; benchmarks never run under it.
if "--xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0"
  ).strip()

import jax  # noqa: E402

# The suite's own process keeps no persistent compilation cache unless the caller sets one
# (JAX_COMPILATION_CACHE_DIR, read when JAX is imported above): it compiles most programs
# once. The runs it starts as subprocesses (the CLI, kill-9 resumes, multihost launches)
# compile the same few programs again and again, so they share one, set here after the
# import: a resumed or second process reads its executables back instead of compiling.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(_REPO, ".pytest_cache", "jax"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(2 << 30))
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


def _memory_maps() -> int:
  with open("/proc/self/maps", "rb") as f:
    return sum(1 for _ in f)


@pytest.fixture(autouse=True)
def _bounded_executables():
  """Drops JAX's compiled programs once the process holds many memory maps. Every XLA:CPU
  executable keeps a few maps for its code, and the suite compiles tens of thousands of
  programs (each eager op is one): a process past the kernel's vm.max_map_count (65530)
  crashes inside the next compile (a segfault or an abort, some 650 tests in)."""
  yield
  if os.path.exists("/proc/self/maps") and _memory_maps() > 30_000:
    jax.clear_caches()


@pytest.fixture(scope="session")
def data_mesh():
  assert jax.device_count() == 8, "tests expect 8 fake CPU devices"
  return DataMesh()
