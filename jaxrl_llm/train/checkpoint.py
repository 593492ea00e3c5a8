"""Orbax checkpoints of a run, and exact resume.

A checkpoint at step s (RL iterations done) holds two items:

- `state`: the whole `TrainState` (policy, reference, critic, both optimizer states,
  the KL controller, update count, rng), each device writing its own shards;
- `meta` (JSON): the prompt stream's position, the held-out accuracy before RL, the
  config and its hash, and a fingerprint of every state array.

Restoring builds the state's shardings for the *current* mesh first and reads each
shard straight onto its devices, so a checkpoint written on 8 devices restores onto
1 and the reverse. Orbax writes each step into a temporary directory and renames it
when complete, so a SIGKILL mid-save leaves only finished steps visible. A step that
fails to read, or whose arrays do not match their fingerprint, is moved aside (never
deleted) and the previous one is used.
"""

import dataclasses
import datetime
import hashlib
import json
import logging

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from etils import epath

from jaxrl_llm.models import hosts
from jaxrl_llm.train import distributed
from jaxrl_llm.train.config import ConfigError, TrainConfig

log = logging.getLogger(__name__)

# Settings that may change between a run and its resumption: they touch neither the
# state's shapes nor the math of the steps still to come. Everything else must match.
RESUMABLE = (
  "run.steps",
  "run.progress",
  "run.loggers",
  "run.wandb_project",
  "run.profile_steps",
  "run.eval_batch_size",
  "run.eval_every",
  "run.peak_flops_per_device",
  "rewards.timeout_s",  # a deadline, not the scores (on_error changes them, so it must match)
  "run.workdir",
  "mesh.data",
  "mesh.fsdp",
  "mesh.tensor",
)
RESUMABLE_SECTIONS = ("checkpoint", "distributed")


def config_dict(cfg: TrainConfig) -> dict:
  """The config as plain JSON values (tuples become lists), for the checkpoint and wandb."""
  return json.loads(json.dumps(dataclasses.asdict(cfg)))


def config_hash(config: dict) -> str:
  return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def config_differences(saved: dict, current: dict) -> list[str]:
  """`key: saved -> current` for every setting that differs and may not.

  `run.steps` may grow, except under a cosine schedule, whose decay it sets.
  """
  cosine = current.get("optim", {}).get("schedule") == "cosine"
  out = []
  for section in sorted(set(saved) | set(current)):
    if section in RESUMABLE_SECTIONS:
      continue
    old, new = saved.get(section, {}), current.get(section, {})
    for key in sorted(set(old) | set(new)):
      name = f"{section}.{key}"
      if name in RESUMABLE and not (name == "run.steps" and cosine):
        continue
      if old.get(key, "<absent>") != new.get(key, "<absent>"):
        out.append(f"{name}: {old.get(key, '<absent>')!r} -> {new.get(key, '<absent>')!r}")
  return out


@jax.jit
def fingerprint(tree) -> jax.Array:
  """A position-weighted uint32 sum of each leaf's bits: exact, so independent of how
  the leaf is sharded, and it changes when any element does."""

  def one(x):
    bits = x.view(jnp.uint16).astype(jnp.uint32) if x.dtype.itemsize == 2 else x
    bits = bits.view(jnp.uint32) if bits.dtype.itemsize == 4 else bits.astype(jnp.uint32)
    flat = bits.reshape(-1)
    weights = jnp.arange(1, flat.size + 1, dtype=jnp.uint32) * jnp.uint32(2654435761)
    return jnp.sum(flat * weights, dtype=jnp.uint32)

  leaves = jax.tree.leaves(tree)
  return jnp.stack([one(x) for x in leaves]) if leaves else jnp.zeros((0,), jnp.uint32)


@dataclasses.dataclass
class Restored:
  step: int
  state: object
  meta: dict


class CorruptCheckpoint(RuntimeError):
  """A step that cannot be read back as it was written."""


def finished_steps(directory) -> list[int]:
  """The steps whose checkpoints finished in `directory`, read from the file system alone
  (no JAX): Orbax names a finished step's directory by its number, an unfinished one not."""
  directory = epath.Path(directory)
  try:
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit())
  except OSError:  # no such directory yet
    return []


class CheckpointWriteError(RuntimeError):
  """A checkpoint could not be written (no space left, no permission); the steps before it
  are intact and the run resumes from the newest of them."""


def _os_error(e: BaseException) -> OSError | None:
  """The OSError behind `e` (itself, or in its chain of causes), if any."""
  while e is not None:
    if isinstance(e, OSError):
      return e
    e = e.__cause__ or e.__context__
  return None


class Checkpointer:
  """Saves and restores a run's state under `directory` (local or gs://). `read_only`: for
  readers beside a run (evaluation), which neither write, clean up nor set aside anything."""

  def __init__(self, cfg: TrainConfig, read_only: bool = False):
    c = cfg.checkpoint
    path = c.directory or f"{cfg.run.workdir}/checkpoints"
    # Orbax wants absolute paths; gs:// and other remote paths already are.
    self.directory = epath.Path(path) if "://" in path else epath.Path(path).resolve()
    self.config = config_dict(cfg)
    self.read_only = read_only
    options = ocp.CheckpointManagerOptions(
      max_to_keep=c.keep,
      enable_async_checkpointing=c.async_save,
      cleanup_tmp_directories=not read_only,  # what a killed save left behind
      create=not read_only,
      read_only=read_only,
    )
    self.manager = ocp.CheckpointManager(self.directory, options=options)
    self._pending = None  # (step, bytes) of the save in flight
    if not read_only:
      distributed.note_checkpoints(self.directory)

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state, meta: dict) -> None:
    """Starts writing step `step`; returns once the arrays are copied off the devices
    (with async saves the files are written in the background). Raises
    CheckpointWriteError when this save, or the one before it, fails to write."""
    self._finish_pending()
    meta = meta | {
      "step": step,
      "config": self.config,
      "config_hash": config_hash(self.config),
      "fingerprint": [int(v) for v in jax.device_get(fingerprint(state))],
      "saved_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    self._pending = (step, sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes")))
    try:
      self.manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
        force=True,
      )
    except Exception as e:  # noqa: BLE001 - reported with the directory and the size
      raise self._write_error(e) from e

  def wait(self) -> None:
    """Waits for the save in flight; raises CheckpointWriteError if it failed."""
    self._finish_pending()

  def _finish_pending(self) -> None:
    try:
      self.manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001
      if self._pending is None:
        raise
      raise self._write_error(e) from e
    if self._pending is not None:
      self.manager.reload()  # the steps on disk, not the manager's cached list
      if self._pending[0] not in self.manager.all_steps():
        raise self._write_error(RuntimeError("the save ended without the step on disk"))
    self._pending = None

  def _write_error(self, e: BaseException) -> CheckpointWriteError:
    step, nbytes = self._pending
    self._pending = None
    os_error = _os_error(e)
    reason = f"{os_error.strerror or os_error} (errno {os_error.errno})" if os_error else repr(e)
    kept = [s for s in self.manager.all_steps() if s != step]
    intact = (
      f"the newest complete checkpoint, step {max(kept)}, is intact: free the space or fix "
      f"the permissions there (or set config.checkpoint.directory), then re-run the same "
      f"command to resume from it"
      if kept
      else "no earlier checkpoint exists"
    )
    return CheckpointWriteError(
      f"checkpoint step {step} could not be written to {self.directory}: {reason}. It "
      f"needs about {nbytes / 2**20:.1f} MiB ({nbytes} bytes) of arrays plus small metadata; "
      f"{intact}."
    )

  def abandon(self) -> None:
    """For a run stopping on an error: lets the save in flight finish (a failure of it is
    logged, not raised, so the run's own error is the one reported) and closes."""
    try:
      self._finish_pending()
    except Exception as e:  # noqa: BLE001
      log.error("%s", e)
    try:
      self.manager.close()
    except Exception as e:  # noqa: BLE001
      log.error("closing the checkpoint manager of %s: %r", self.directory, e)

  def close(self) -> None:
    self.manager.close()

  def read_meta(self, step: int) -> dict:
    return self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta

  def restore_latest(self, target, only: int | None = None) -> Restored | None:
    """The newest readable step (or step `only`), restored onto `target`'s shardings; None if
    there is none.

    `target` is the state as ShapeDtypeStructs with shardings. A config that differs
    from the checkpoint's in a way that matters raises ConfigError before any array
    is read; an unreadable step is moved aside and the one before it is tried (read-only,
    CorruptCheckpoint is raised instead).
    """
    if only is not None and only not in self.steps():
      raise ConfigError(f"{self.directory} has no step {only}; it has steps {self.steps()}.")
    for step in [only] if only is not None else reversed(self.steps()):
      try:
        meta = self.read_meta(step)
      except Exception as e:  # noqa: BLE001 - any failure to read means this step is unusable
        self._set_aside(step, f"its metadata cannot be read ({type(e).__name__}: {e})")
        continue
      self._check_config(step, meta)
      try:
        state = self.manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target))
        ).state
        expected = meta.get("fingerprint")
        actual = [int(v) for v in jax.device_get(fingerprint(state))]
        if expected != actual:
          raise CorruptCheckpoint("its arrays do not match the fingerprint written with them")
      except Exception as e:  # noqa: BLE001
        self._set_aside(step, f"its arrays cannot be restored ({type(e).__name__}: {e})")
        continue
      return Restored(step, state, meta)
    return None

  def _check_config(self, step: int, meta: dict) -> None:
    saved = meta.get("config", {})
    if config_hash(saved) == config_hash(self.config):
      return
    diffs = config_differences(saved, self.config)
    if diffs:
      raise ConfigError(
        f"the checkpoint at {self.directory / str(step)} was written by a different "
        f"config; these settings differ (checkpoint -> now):\n  "
        + "\n  ".join(diffs)
        + "\nResume with the original settings, or start over with "
        "--config.checkpoint.fresh=True (the old checkpoints are kept aside) or a new "
        "--config.run.workdir."
      )

  def _set_aside(self, step: int, why: str) -> None:
    """Moves an unusable step out of the manager's view, keeping its files."""
    if self.read_only:
      raise CorruptCheckpoint(f"checkpoint step {step} in {self.directory} is unusable: {why}.")
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S")
    aside = self.directory.parent / "corrupt_checkpoints" / f"{step}-{stamp}"
    if jax.process_index() == 0:
      aside.parent.mkdir(parents=True, exist_ok=True)
      (self.directory / str(step)).rename(aside)
    hosts.barrier(f"set aside checkpoint {step}")
    log.warning(
      "checkpoint step %d in %s is unusable: %s. Moved it to %s and falling back to the "
      "previous step.",
      step,
      self.directory,
      why,
      aside,
    )
    self.manager.reload()
