"""Launching training runs as subprocesses: config flags, a shared compilation cache, a log
per run, and whether a run already finished."""

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def flags(settings: dict) -> list[str]:
  return [f"--config.{k}={v}" for k, v in settings.items()]


def env(out: Path, extra=()) -> dict:
  """The runs share a persistent compilation cache: seeds 2.. skip XLA compilation."""
  environ = dict(os.environ) | dict(extra)
  environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(out / ".jax_cache"))
  environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
  return environ


def run(command: list[str], log: Path, out: Path, extra_env=()) -> None:
  """Runs `command` from the repository root, appending its output to `log`; raises with
  the log's tail when it fails."""
  log.parent.mkdir(parents=True, exist_ok=True)
  with log.open("a") as f:
    f.write(f"\n$ {' '.join(command)}\n")
    f.flush()
    proc = subprocess.run(
      command, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env(out, extra_env)
    )
  if proc.returncode != 0:
    tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
    raise RuntimeError(f"{' '.join(command[:6])} ... failed ({proc.returncode}); {log}:\n{tail}")


def is_done(workdir: Path, steps: int) -> bool:
  """Whether the run in `workdir` finished all `steps` (its summary.json says so)."""
  path = workdir / "summary.json"
  return path.exists() and json.loads(path.read_text()).get("steps") == steps
