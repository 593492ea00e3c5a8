"""The entropy-coefficient controller: fixed, or adaptive toward a target entropy."""

import jax
import jax.numpy as jnp
import pytest

from jaxrl_llm import core


def test_fixed_controller_never_moves():
  c = core.entropy_controller(0.01)
  state = c.init()
  for entropy in (0.1, 5.0):
    state = c.update(state, jnp.float32(entropy))
  assert float(state.coef) == pytest.approx(0.01)


def test_adaptive_controller_steers_toward_the_target_within_bounds():
  c = core.entropy_controller(0.0, target=1.0, step_size=0.01, max_coef=0.025)
  update = jax.jit(c.update)
  state = c.init()
  coefs = []
  for _ in range(4):  # entropy below target: the bonus grows, up to max_coef
    state = update(state, jnp.float32(0.5))
    coefs.append(float(state.coef))
  assert coefs == pytest.approx([0.01, 0.02, 0.025, 0.025])
  for _ in range(4):  # above target: it shrinks, down to 0
    state = update(state, jnp.float32(2.0))
  assert float(state.coef) == 0.0


def test_adaptive_controller_rejects_bad_settings():
  with pytest.raises(ValueError, match="step_size > 0"):
    core.entropy_controller(0.0, target=1.0, step_size=0.0, max_coef=0.1)
  with pytest.raises(ValueError, match="max_coef"):
    core.entropy_controller(0.2, target=1.0, step_size=0.01, max_coef=0.1)
