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


CODE = ("*.py", "pyproject.toml", "constraints*.txt")  # what the figures depend on


def _git(*args) -> subprocess.CompletedProcess:
  return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)


def commit() -> str:
  """HEAD, marked `+changes` when the working tree's code (Python files, pyproject.toml,
  the constraints files) differs from it."""
  head = _git("rev-parse", "--short", "HEAD")
  if head.returncode:
    return "unknown (not a git checkout)"
  dirty = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE)
  return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def code_changed(since: str) -> bool:
  """Whether the code now differs from the code of `since`, a `commit()` string: a commit
  with uncommitted changes, or one the working tree's code no longer equals, has."""
  if since.endswith("+changes") or since.startswith("unknown"):
    return True
  return _git("diff", "--quiet", since, "--", *CODE).returncode != 0


def boot() -> str:
  """This machine's boot: its kernel boot id and boot time, so that figures are combined
  only within one boot of one machine (instances of one kind differ in speed)."""
  try:
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    btime = next(
      line.split()[1]
      for line in Path("/proc/stat").read_text().splitlines()
      if line.startswith("btime")
    )
  except (OSError, StopIteration):
    return "unknown"
  return f"{boot_id}@{btime}"


def stamp() -> dict:
  """The provenance fields every result row carries."""
  now = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
  return {"date": now, "machine": machine(), "commit": commit()}
