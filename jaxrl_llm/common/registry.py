"""Name -> function lookups used at the edge between configs and the math.

Registries are plain dicts owned by the module that defines the functions
(`advantages.GROUP_ESTIMATORS`, `kl.KL_ESTIMATORS`,
`policy_loss.POLICY_LOSSES`, `aggregate.AGGREGATION_MODES`). Users add
their own entries with a plain assignment or with `register`.
"""

from collections.abc import Callable, MutableMapping
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def register(registry: MutableMapping[str, Any], name: str) -> Callable[[F], F]:
  """Decorator that adds a function to `registry` under `name`.

  Re-registering a name raises, so a typo cannot silently replace a
  built-in; delete the entry first to override it on purpose.
  """

  def decorator(fn: F) -> F:
    if name in registry:
      raise ValueError(
        f"{name!r} is already registered ({registry[name]!r}); "
        f"`del registry[{name!r}]` first to replace it on purpose."
      )
    registry[name] = fn
    return fn

  return decorator


def lookup(registry: MutableMapping[str, Any], name: str, what: str) -> Any:
  """Returns `registry[name]`, or raises an error listing the known names."""
  try:
    return registry[name]
  except KeyError:
    known = ", ".join(sorted(registry))
    raise ValueError(
      f"Unknown {what} {name!r}. Known: {known}. Register your own with "
      f"jaxrl_llm.core.register(<registry>, {name!r})."
    ) from None
