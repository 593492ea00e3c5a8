"""The reward model's loss on preference pairs, and a running normaliser for its scores."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.core.stats import masked_mean, masked_sum, psum_if


def bradley_terry_loss(
  chosen_B, rejected_B, *, margin_B=None, center_coef=0.0, mask_B=None, axis_name=None
):
  """Bradley-Terry loss of a reward model on pairs (Ouyang et al., 2022; as in TRL's reward
  trainer), a scalar:

    L = mean_i [ -log sigmoid(r_c,i - r_r,i - m_i) ] + center_coef * mean_i [ (r_c,i + r_r,i)^2 ]

  `chosen_B` and `rejected_B` are the model's scores of the preferred and the other response
  to the same prompt; `margin_B` an optional per-pair margin m (how much more the chosen is
  preferred); `center_coef` pulls the scores towards mean 0 (Eisenstein et al., 2023), which
  the first term leaves free. `mask_B` drops padding pairs; with `axis_name`, the means are
  over all shards' pairs. Metrics: `accuracy` (the share of pairs with r_c > r_r; a tie counts
  half), `margin` (mean r_c - r_r), `chosen` and `rejected` (mean scores).
  """
  chosen = chosen_B.astype(jnp.float32)
  rejected = rejected_B.astype(jnp.float32)
  mask_B = jnp.ones(chosen.shape, bool) if mask_B is None else mask_B > 0
  diff_B = chosen - rejected
  shifted_B = diff_B if margin_B is None else diff_B - margin_B.astype(jnp.float32)
  loss = masked_mean(-jax.nn.log_sigmoid(shifted_B), mask_B, axis_name)
  if center_coef:
    loss = loss + center_coef * masked_mean(jnp.square(chosen + rejected), mask_B, axis_name)
  won_B = jnp.where(diff_B > 0, 1.0, jnp.where(diff_B == 0, 0.5, 0.0))
  metrics = {
    "accuracy": masked_mean(won_B, mask_B, axis_name),
    "margin": masked_mean(diff_B, mask_B, axis_name),
    "chosen": masked_mean(chosen, mask_B, axis_name),
    "rejected": masked_mean(rejected, mask_B, axis_name),
  }
  return loss, metrics


class RunningMoments(NamedTuple):
  """Count, mean and sum of squared deviations of every score seen so far (Chan et al.)."""

  count: jax.Array
  mean: jax.Array
  m2: jax.Array


def running_moments_init() -> RunningMoments:
  zero = jnp.zeros((), jnp.float32)
  return RunningMoments(zero, zero, zero)


def running_moments_update(state: RunningMoments, x_B, mask_B=None, *, axis_name=None):
  """`state` with the masked entries of `x_B` merged in (the parallel-variance merge of Chan,
  Golub and LeVeque: the same moments, to rounding, for any split of the stream), and those
  entries normalised by the merged mean and standard deviation: `(state, normalised_B)`
  (masked entries 0)."""
  x = x_B.astype(jnp.float32)
  mask_B = jnp.ones(x.shape, bool) if mask_B is None else mask_B > 0
  n = psum_if(jnp.sum(mask_B.astype(jnp.float32)), axis_name)
  mean_b = masked_sum(x, mask_B, axis_name) / jnp.maximum(n, 1.0)
  m2_b = masked_sum(jnp.square(x - mean_b), mask_B, axis_name)
  count = state.count + n
  delta = mean_b - state.mean
  mean = state.mean + delta * n / jnp.maximum(count, 1.0)
  m2 = state.m2 + m2_b + jnp.square(delta) * state.count * n / jnp.maximum(count, 1.0)
  new = RunningMoments(count, mean, m2)
  return new, jnp.where(mask_B, running_moments_normalise(new, x), 0.0)


def running_moments_normalise(state: RunningMoments, x):
  """`x` standardised by the moments' mean and (Bessel-corrected) standard deviation; the
  scale is 1 until two values are seen."""
  std = jnp.where(state.count > 1, jnp.sqrt(state.m2 / jnp.maximum(state.count - 1.0, 1.0)), 1.0)
  return (x.astype(jnp.float32) - state.mean) / jnp.maximum(std, 1e-6)
