"""Metrics to JSONL and TensorBoard, written by process 0 only."""

import itertools
import json
import math
import os
from pathlib import Path

import jax
import numpy as np


def to_python(metrics: dict) -> dict:
  """Device scalars to floats (NaN stays NaN; JSON writes it as NaN)."""
  return {k: float(np.asarray(v)) for k, v in metrics.items()}


_WRITERS = itertools.count()


def _step(line: str) -> float:
  """A row's step; a torn row (the process died mid-write) counts as after every step."""
  try:
    return json.loads(line)["step"]
  except (json.JSONDecodeError, KeyError, TypeError):
    return math.inf


class MetricsWriter:
  """Appends one JSON object per step to `<workdir>/metrics.jsonl`, and mirrors scalars to
  TensorBoard under `<workdir>/tb` when enabled."""

  def __init__(self, workdir, tensorboard: bool = True, start_step: int = 0):
    self.workdir = Path(workdir)
    self.enabled = jax.process_index() == 0
    self.path = self.workdir / "metrics.jsonl"
    self._tb = None
    if self.enabled:
      self.workdir.mkdir(parents=True, exist_ok=True)
      self._truncate(start_step)
      if tensorboard:
        from tensorboardX import SummaryWriter

        # A resumed run recomputes the steps after its checkpoint: TensorBoard drops the
        # events of the stopped run from there on (purge_step), as the JSONL is truncated.
        purge = start_step + 1 if start_step else None
        # Unique file names: a resume within the same second must not overwrite the first.
        suffix = f".{os.getpid()}.{next(_WRITERS)}"
        self._tb = SummaryWriter(str(self.workdir / "tb"), purge_step=purge, filename_suffix=suffix)

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
    row = {"step": step} | {
      k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in metrics.items()
    }
    with self.path.open("a") as f:
      f.write(json.dumps(row) + "\n")
    if self._tb is not None:
      for k, v in metrics.items():
        # A value that is None or not finite has no point to plot (and TensorBoard warns).
        if isinstance(v, int | float) and math.isfinite(v):
          self._tb.add_scalar(k, v, step)

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
