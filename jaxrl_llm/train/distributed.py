"""Multi-process start-up: one call before anything touches the devices.

Every host of a TPU pod slice (or every task of a GPU cluster job) runs the same
command; `initialize` joins them into one JAX runtime, after which `jax.devices()` is
every device of every process and the trainer's mesh spans them all.
"""

import atexit
import importlib.util
import logging
import os
import sys
import threading
import time

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
  # JAX's own heartbeat ends a process whose peer is silent too, without saying which; ours
  # (PeerWatch) fires first and names it.
  heartbeat = int(max(100, 2 * d.peer_timeout_s))
  if d.coordinator_address:
    jax.distributed.initialize(
      d.coordinator_address,
      num_processes=d.num_processes,
      process_id=d.process_id,
      local_device_ids=list(d.local_device_ids) or None,
      heartbeat_timeout_seconds=heartbeat,
    )
  elif (launcher := _cluster_detected()) is not None:
    try:
      jax.distributed.initialize(heartbeat_timeout_seconds=heartbeat)
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
  if jax.process_count() > 1:
    PeerWatch(d.peer_timeout_s).start()
  return True


_checkpoints: list[str] = []  # the run's checkpoint directory, once it has one


def note_checkpoints(directory) -> None:
  """Where the run's checkpoints are, for the message of a lost peer."""
  _checkpoints[:] = [str(directory)]


def newest_checkpoint() -> str:
  """The newest finished checkpoint step and its directory, in words."""
  if not _checkpoints:
    return "the run had no checkpoint directory yet"
  from jaxrl_llm.train.checkpoint import finished_steps  # it imports this module

  directory = _checkpoints[0]
  steps = finished_steps(directory)
  if not steps:
    return f"no checkpoint is finished in {directory} yet"
  return f"the newest finished checkpoint is step {steps[-1]} in {directory}"


class PeerWatch:
  """Ends this process when another process of the run stops answering, instead of letting
  it wait in a collective (or a checkpoint's barrier) forever.

  A daemon thread bumps this process's counter under `jaxrl_llm/alive/<index>` in the
  coordination service's key-value store every `timeout_s / 6` seconds (at most 10) and
  reads the others'. A counter that has not moved for `timeout_s`, or a store that has not
  answered for as long (the coordinator, process 0, is gone), ends this process with exit
  code EXIT_CODE and a message naming the silent process and the checkpoint to resume
  from. A process that ends normally marks its counter done first.
  """

  EXIT_CODE = 75  # EX_TEMPFAIL: restart and it resumes
  PREFIX = "jaxrl_llm/alive/"

  def __init__(self, timeout_s: float):
    from jax._src import distributed as jax_distributed

    self.client = jax_distributed.global_state.client
    self.index, self.count = jax.process_index(), jax.process_count()
    self.timeout_s = timeout_s
    self.interval_s = min(10.0, timeout_s / 6)
    self.stopped = threading.Event()

  def start(self) -> None:
    self._beat(0)
    threading.Thread(target=self._run, daemon=True, name="peer watch").start()
    atexit.register(self.stop)  # before jax.distributed's own shutdown (atexit runs LIFO)

  def stop(self) -> None:
    if not self.stopped.is_set():
      self.stopped.set()
      try:
        self.client.key_value_set(f"{self.PREFIX}{self.index}", "done", allow_overwrite=True)
      except Exception:  # noqa: BLE001 - the store may be gone already
        pass

  def _beat(self, n: int) -> None:
    self.client.key_value_set(f"{self.PREFIX}{self.index}", str(n), allow_overwrite=True)

  def _run(self) -> None:
    now = time.monotonic()
    seen = {j: (None, now) for j in range(self.count) if j != self.index}
    answered, beat = now, 0
    while not self.stopped.wait(self.interval_s):
      now = time.monotonic()
      try:
        beat += 1
        self._beat(beat)
        values = {j: self._value(j) for j in seen}
        answered = now
      except Exception as e:  # noqa: BLE001 - the store is unreachable
        if now - answered > self.timeout_s and not self.stopped.is_set():
          self._lost(0, f"the coordination service (on process 0) stopped answering: {e}")
        continue
      for j, value in values.items():
        if value == "done":
          del seen[j]
        elif value != seen[j][0]:
          seen[j] = (value, now)
        elif now - seen[j][1] > self.timeout_s and not self.stopped.is_set():
          self._lost(j, "its heartbeat stopped")

  def _value(self, j: int) -> str | None:
    try:
      return self.client.key_value_try_get(f"{self.PREFIX}{j}")
    except Exception as e:  # noqa: BLE001 - not set yet reads as no beat
      if "NOT_FOUND" in str(e) or "not found" in str(e).lower():
        return None
      raise

  def _lost(self, j: int, why: str) -> None:
    message = (
      f"process {j} of {self.count} stopped answering for over {self.timeout_s:g} s "
      f"(config.distributed.peer_timeout_s; {why}): it was killed, crashed or lost its "
      f"network. Process {self.index} exits (code {self.EXIT_CODE}) rather than wait for it "
      f"in a collective; {newest_checkpoint()}. Restart every process with the same command "
      "to resume from it."
    )
    log.critical(message)
    print(message, file=sys.stderr, flush=True)
    os._exit(self.EXIT_CODE)
