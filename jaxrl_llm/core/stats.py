"""Masked statistics whose normalisers can span devices.

With `axis_name`, every sum that feeds a normaliser is `psum`-ed over that
axis, so the statistic is the one of the global batch when the function runs
per-device under `jax.shard_map` or `jax.pmap`.
"""

import jax
import jax.numpy as jnp


def psum_if(x, axis_name):
  """`lax.psum(x, axis_name)`, or `x` when `axis_name` is None."""
  return x if axis_name is None else jax.lax.psum(x, axis_name)


def masked_sum(x, mask, axis_name=None):
  """sum(x * mask) over all elements (and over `axis_name`); masked entries may be NaN."""
  return psum_if(jnp.sum(jnp.where(mask, x, 0.0)), axis_name)


def masked_mean(x, mask, axis_name=None):
  """sum(x * mask) / sum(mask); 0 when the mask is empty."""
  total = masked_sum(x, mask, axis_name)
  count = psum_if(jnp.sum(mask.astype(jnp.float32)), axis_name)
  return total / jnp.maximum(count, 1.0)


def masked_var(x, mask, unbiased=True, axis_name=None):
  """Variance of the masked entries; with `unbiased`, times n / (n - 1) (Bessel)."""
  count = psum_if(jnp.sum(mask.astype(jnp.float32)), axis_name)
  mean = masked_mean(x, mask, axis_name)
  var = masked_sum(jnp.square(x - mean), mask, axis_name) / jnp.maximum(count, 1.0)
  if unbiased:
    var = var * count / jnp.maximum(count - 1.0, 1.0)
  return var


def masked_max(x, mask, axis_name=None):
  """Max over masked entries (-inf if none)."""
  m = jnp.max(jnp.where(mask, x, -jnp.inf))
  return m if axis_name is None else jax.lax.pmax(m, axis_name)


def masked_min(x, mask, axis_name=None):
  """Min over masked entries (+inf if none)."""
  m = jnp.min(jnp.where(mask, x, jnp.inf))
  return m if axis_name is None else jax.lax.pmin(m, axis_name)


def masked_whiten(x, mask, *, shift_mean=True, eps=1e-8, axis_name=None):
  """Whitens the masked entries of `x` with their (global) mean and unbiased std.

    x' = (x - mean) / sqrt(var + eps)          (+ mean again if not shift_mean)

  Masked-out entries come back as 0. This is the batch whitening used by PPO
  implementations (Huang et al., 2022, "The 37 implementation details of PPO")
  and by REINFORCE++ (Hu, 2025).
  """
  mean = masked_mean(x, mask, axis_name)
  var = masked_var(x, mask, unbiased=True, axis_name=axis_name)
  out = (x - mean) * jax.lax.rsqrt(var + eps)
  if not shift_mean:
    out = out + mean
  return jnp.where(mask, out, 0.0)
