"""The entropy bonus's coefficient: fixed, or steered toward a target entropy.

An `(init, update)` pair of pure functions over an `EntropyControllerState`, like
the KL controllers; the trainer keeps the state in its TrainState, so checkpoints
carry it.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp


class EntropyControllerState(NamedTuple):
  coef: jax.Array  # current entropy-bonus coefficient alpha


class EntropyController(NamedTuple):
  """init() -> state;  update(state, entropy) -> state, with `entropy` the mean per-token
  entropy of the last batch."""

  init: Callable[[], EntropyControllerState]
  update: Callable[..., EntropyControllerState]


def entropy_controller(coef, *, target=None, step_size=None, max_coef=None):
  """A constant coefficient, or with `target` the adaptive rule of Skywork-OR1 (He et al.,
  2025, arXiv:2505.22312, sec. 3.2):

    alpha <- clip(alpha + step_size * sign(target - entropy), 0, max_coef)

  which raises the bonus while entropy is below `target` and lowers it above.
  """
  init = lambda: EntropyControllerState(jnp.asarray(coef, jnp.float32))
  if target is None:
    return EntropyController(init=init, update=lambda state, entropy: state)
  if target <= 0 or step_size is None or step_size <= 0 or max_coef is None or max_coef < coef:
    raise ValueError(
      "adaptive entropy control needs target > 0, step_size > 0 and max_coef >= the "
      f"initial coef; got target={target}, step_size={step_size}, max_coef={max_coef}."
    )

  def update(state, entropy):
    step = step_size * jnp.sign(target - entropy)
    return EntropyControllerState(jnp.clip(state.coef + step, 0.0, max_coef))

  return EntropyController(init=init, update=update)
