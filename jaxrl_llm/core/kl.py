"""Per-token KL estimators between the policy and a reference, and the KL coefficient controller.

With log-ratio `d_t = log pi(y_t) - log pi_ref(y_t)` at sampled tokens
y_t ~ pi, the estimators of KL(pi || pi_ref) are (Schulman, 2020,
"Approximating KL divergence", http://joschu.net/blog/kl-approx.html):

  k1  = d                         unbiased, high variance, can be negative
  abs = |d|
  k2  = d^2 / 2                   biased, low variance; its gradient is the KL's
  k3  = exp(-d) - 1 + d           unbiased, >= 0, low variance
  k1+, k3+                        k1 or k3's value with k2's gradient
                                  (straight-through), as in verl

Only the value of each estimator is unbiased; when the KL is a loss term
(GRPO's placement) the gradient matters, which is what the "+" forms fix.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.common.registry import lookup, register

K3_CLAMP = 10.0  # |k3| is clamped to this, as in verl's low_var_kl.
LOG_RATIO_CLAMP = 20.0  # exp(-d) is computed from d clamped to this, so it never overflows.

KL_ESTIMATORS: dict = {}  # name -> fn(logp, ref_logp) -> per-token KL estimate


def _log_ratio(logp, ref_logp):
  return logp.astype(jnp.float32) - ref_logp.astype(jnp.float32)


@register(KL_ESTIMATORS, "k1")
def kl_k1(logp, ref_logp):
  """k1 = log pi - log pi_ref."""
  return _log_ratio(logp, ref_logp)


@register(KL_ESTIMATORS, "abs")
def kl_abs(logp, ref_logp):
  """|log pi - log pi_ref|."""
  return jnp.abs(_log_ratio(logp, ref_logp))


@register(KL_ESTIMATORS, "k2")
def kl_k2(logp, ref_logp):
  """k2 = (log pi - log pi_ref)^2 / 2."""
  return 0.5 * jnp.square(_log_ratio(logp, ref_logp))


@register(KL_ESTIMATORS, "k3")
def kl_k3(logp, ref_logp):
  """k3 = pi_ref/pi - 1 - log(pi_ref/pi), clamped to [-10, 10]."""
  d = jnp.clip(_log_ratio(logp, ref_logp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  return jnp.clip(jnp.exp(-d) - 1.0 + d, -K3_CLAMP, K3_CLAMP)


def _straight_through(value, grad_source):
  """`value` in the forward pass, `grad_source`'s gradient in the backward pass."""
  return grad_source + jax.lax.stop_gradient(value - grad_source)


@register(KL_ESTIMATORS, "k1+")
def kl_k1_plus(logp, ref_logp):
  """k1's value with k2's gradient."""
  return _straight_through(kl_k1(logp, ref_logp), kl_k2(logp, ref_logp))


@register(KL_ESTIMATORS, "k3+")
def kl_k3_plus(logp, ref_logp):
  """k3's value with k2's gradient."""
  return _straight_through(kl_k3(logp, ref_logp), kl_k2(logp, ref_logp))


def kl_penalty(logp, ref_logp, kind):
  """Per-token KL estimate by name: one of `KL_ESTIMATORS` (k1, abs, k2, k3, k1+, k3+)."""
  return lookup(KL_ESTIMATORS, kind, "KL estimator")(logp, ref_logp)


class KLControllerState(NamedTuple):
  coef: jax.Array  # current KL coefficient beta


class KLController(NamedTuple):
  """An `(init, update)` pair of pure functions over a `KLControllerState`.

  init() -> state;  update(state, kl, n_steps) -> state,
  with `kl` the mean per-sequence KL of the last batch and `n_steps` the number
  of samples (or steps) it covered.
  """

  init: Callable[[], KLControllerState]
  update: Callable[..., KLControllerState]


def fixed_kl_controller(coef):
  """A constant KL coefficient."""
  return KLController(
    init=lambda: KLControllerState(jnp.asarray(coef, jnp.float32)),
    update=lambda state, kl, n_steps: state,
  )


def adaptive_kl_controller(init_coef, *, target, horizon):
  """Proportional controller of Ziegler et al. (2019, arXiv:1909.08593, sec. 2.2).

    e    = clip(KL / target - 1, -0.2, 0.2)
    beta <- beta * (1 + e * n_steps / horizon)

  It raises beta when the measured KL is above `target` and lowers it below.
  """
  if target <= 0 or horizon <= 0:
    raise ValueError(f"adaptive KL needs target > 0 and horizon > 0, got {target}, {horizon}.")

  def update(state, kl, n_steps):
    error = jnp.clip(kl / target - 1.0, -0.2, 0.2)
    return KLControllerState(state.coef * (1.0 + error * n_steps / horizon))

  return KLController(
    init=lambda: KLControllerState(jnp.asarray(init_coef, jnp.float32)), update=update
  )


def kl_controller(mode, coef, *, target=None, horizon=None):
  """'fixed' or 'adaptive' KL controller from config values."""
  if mode == "fixed":
    return fixed_kl_controller(coef)
  if mode == "adaptive":
    if target is None or horizon is None:
      raise ValueError("kl controller 'adaptive' needs target= and horizon=.")
    return adaptive_kl_controller(coef, target=target, horizon=horizon)
  raise ValueError(f"Unknown KL controller mode {mode!r}; use 'fixed' or 'adaptive'.")
