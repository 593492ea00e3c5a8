"""Multi-process start-up: one call before anything touches the devices.

Every host of a TPU pod slice (or every task of a GPU cluster job) runs the same
command; `initialize` joins them into one JAX runtime, after which `jax.devices()` is
every device of every process and the trainer's mesh spans them all.
"""

import importlib.util
import logging
import os

import jax

from jaxrl_llm.train.config import DistributedSection

log = logging.getLogger(__name__)
TPU_VM = "Cloud TPU VM"


def _cluster_detected() -> str | None:
  """The launcher whose environment says this is one of several processes, if any."""
  env = os.environ
  if int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in env:
    return "SLURM"
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1:
    return "Open MPI"
  if "," in env.get("TPU_WORKER_HOSTNAMES", "") or env.get("MEGASCALE_COORDINATOR_ADDRESS"):
    return "Cloud TPU pod slice"
  if importlib.util.find_spec("libtpu") is not None:  # jax[tpu]: JAX asks the TPU metadata
    return TPU_VM
  return None


def initialize(d: DistributedSection | None = None) -> bool:
  """Calls `jax.distributed.initialize` when this run is one of several processes; returns
  whether it did. Explicit settings win; otherwise JAX detects the cluster from the TPU
  metadata, or SLURM's or Open MPI's variables."""
  d = d or DistributedSection()
  if d.coordinator_address:
    jax.distributed.initialize(
      d.coordinator_address,
      num_processes=d.num_processes,
      process_id=d.process_id,
      local_device_ids=list(d.local_device_ids) or None,
    )
  elif (launcher := _cluster_detected()) is not None:
    try:
      jax.distributed.initialize()
    except (ValueError, RuntimeError) as e:
      if launcher != TPU_VM:
        raise
      # libtpu is installed but this is no TPU VM JAX recognises (or a lone host).
      log.warning("jax.distributed not initialised (%s); running as one process", e)
      return False
  else:
    return False
  log.warning(
    "process %d of %d: %d local devices, %d in all",
    jax.process_index(),
    jax.process_count(),
    jax.local_device_count(),
    jax.device_count(),
  )
  return True
