"""jaxrl_llm: functional JAX/Flax reinforcement learning for language models.

`import jaxrl_llm` is cheap; each subpackage loads on first use
(`jaxrl_llm.models.load_model(...)`, `jaxrl_llm.train.train(...)`).
"""

import importlib

__version__ = "0.1.0"

_SUBPACKAGES = ("core", "data", "models", "rewards", "rollout", "train")


def __getattr__(name: str):
  if name in _SUBPACKAGES:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
  return sorted([*globals(), *_SUBPACKAGES])
