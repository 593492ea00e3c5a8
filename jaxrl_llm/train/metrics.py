"""Metrics to JSONL, TensorBoard and Weights & Biases (`run.loggers`), written by process 0
only; every logger gets the same names and values.

Names are grouped by what they measure: `rollout/` (the producer's samples: rewards,
accuracy, lengths, truncation), `train/` (the learner's experience pass and update: losses,
KL, ratios, clip fractions, importance weights, gradient norms, learning rates), `eval/`
(held-out evaluation), `perf/` (throughput and MFU) and `timing/` (seconds per phase and
each phase's share of the iteration)."""

import itertools
import json
import math
import os
import zlib
from pathlib import Path

import jax
import numpy as np

from jaxrl_llm.train.checkpoint import config_dict


def to_python(metrics: dict) -> dict:
  """Device scalars to floats (NaN stays NaN; JSON writes it as NaN)."""
  return {k: float(np.asarray(v)) for k, v in metrics.items()}


GROUPS = ("rollout", "train", "eval", "perf", "timing")


def grouped(group: str, metrics: dict) -> dict:
  """`metrics` with names under `group/`; a name already under one of GROUPS keeps it (the
  producer's stats carry their own `timing/` entries)."""
  assert group in GROUPS, group
  return {k if k.split("/", 1)[0] in GROUPS else f"{group}/{k}": v for k, v in metrics.items()}


_WRITERS = itertools.count()


def _step(line: str) -> float:
  """A row's step; a torn row (the process died mid-write) counts as after every step."""
  try:
    return json.loads(line)["step"]
  except (json.JSONDecodeError, KeyError, TypeError):
    return math.inf


class MetricsWriter:
  """Appends one JSON object per step to `<workdir>/metrics.jsonl` ("jsonl"), and mirrors
  its numbers to TensorBoard under `<workdir>/tb` ("tensorboard") and to a wandb run named
  after the workdir, its files under `<workdir>/wandb` ("wandb"). `config`: the run's
  config as a dict, for wandb."""

  def __init__(
    self,
    workdir,
    loggers=("jsonl", "tensorboard"),
    start_step: int = 0,
    config: dict | None = None,
    wandb_project: str = "jaxrl_llm",
  ):
    self.workdir = Path(workdir)
    self.enabled = jax.process_index() == 0
    self.path = self.workdir / "metrics.jsonl"
    self._jsonl = "jsonl" in loggers
    self._tb = self._wandb = None
    if self.enabled:
      self.workdir.mkdir(parents=True, exist_ok=True)
      if self._jsonl:
        self._truncate(start_step)
      if "tensorboard" in loggers:
        from tensorboardX import SummaryWriter

        # A resumed run recomputes the steps after its checkpoint: TensorBoard drops the
        # events of the stopped run from there on (purge_step), as the JSONL is truncated.
        purge = start_step + 1 if start_step else None
        # Unique file names: a resume within the same second must not overwrite the first.
        suffix = f".{os.getpid()}.{next(_WRITERS)}"
        self._tb = SummaryWriter(str(self.workdir / "tb"), purge_step=purge, filename_suffix=suffix)
      if "wandb" in loggers:
        self._wandb = _wandb_run(self.workdir, wandb_project, config)

  @classmethod
  def for_run(cls, cfg, start_step: int = 0) -> "MetricsWriter":
    """The writer of `cfg.run`'s loggers, from `start_step` on."""
    config = config_dict(cfg)
    return cls(cfg.run.workdir, cfg.loggers(), start_step, config, cfg.run.wandb_project)

  def _truncate(self, start_step: int) -> None:
    """Keeps the rows of steps up to `start_step`: a resumed run recomputes the rest."""
    if not self.path.exists():
      return
    kept = [line for line in self.path.read_text().splitlines() if _step(line) <= start_step]
    tmp = self.path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    tmp.replace(self.path)

  def write(self, step: int, metrics: dict) -> None:
    if not self.enabled:
      return
    if self._jsonl:
      row = {"step": step} | {
        k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()
      }
      with self.path.open("a") as f:
        f.write(json.dumps(row) + "\n")
    # A value that is None or not finite has no point to plot (and TensorBoard warns).
    points = {k: v for k, v in metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
    if self._tb is not None:
      for k, v in points.items():
        self._tb.add_scalar(k, v, step)
    if self._wandb is not None:
      self._wandb.log(points, step=step)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.finish()


def _wandb_run(workdir: Path, project: str, config: dict | None):
  """A wandb run named after the workdir, its id a hash of the workdir's path, so a resumed
  run continues the same one."""
  import wandb

  path = str(workdir.resolve())
  run_id = f"{workdir.name}-{zlib.crc32(path.encode()):08x}"
  return wandb.init(
    project=project, name=workdir.name, id=run_id, resume="allow", dir=path, config=config
  )
