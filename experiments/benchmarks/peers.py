"""Finding the benchmark peers that live outside this environment."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TUNIX_VENV = REPO / ".venv-tunix" / "bin" / "python"


def tunix_python(given: str | None = None) -> str | None:
  """The python of the tunix environment: `given`, $JAXRL_TUNIX_PYTHON, or .venv-tunix in the
  repository; None when there is none (the tunix lines are then left out)."""
  for candidate in (given, os.environ.get("JAXRL_TUNIX_PYTHON"), TUNIX_VENV):
    if candidate and Path(candidate).exists():
      return str(candidate)
  return None
