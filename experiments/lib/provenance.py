"""Where a result came from: the machine and the code, recorded beside every committed figure."""

import datetime
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def machine() -> str:
  """One line naming the hardware and the JAX backend the figures came from."""
  cpu = platform.processor() or platform.machine()
  try:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  import jax

  dev = jax.devices()[0]
  accel = "" if dev.platform == "cpu" else f", {len(jax.devices())} x {dev.device_kind}"
  return f"{cpu}, {os.cpu_count()} cores{accel}; jax {jax.__version__} on {dev.platform}"


def commit() -> str:
  """HEAD, marked `+changes` when the working tree's code (Python files, pyproject.toml)
  differs from it."""
  git = lambda *a: subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True)
  head = git("rev-parse", "--short", "HEAD")
  if head.returncode:
    return "unknown (not a git checkout)"
  dirty = git("status", "--porcelain", "--untracked-files=no", "--", "*.py", "pyproject.toml")
  return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def stamp() -> dict:
  """The provenance fields every result row carries."""
  now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  return {"date": now, "machine": machine(), "commit": commit()}
