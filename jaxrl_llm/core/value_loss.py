"""The critic's loss for PPO."""

import jax.numpy as jnp

from jaxrl_llm.core.stats import masked_mean


def clipped_value_loss(
  values_BxT, old_values_BxT, returns_BxT, mask_BxT, *, cliprange_value=0.2, axis_name=None
):
  """Clipped value loss, per token (Schulman et al., 2017; as in OpenAI baselines' PPO2).

    V_clip = clip(V, V_old - eps, V_old + eps)
    L_t    = 1/2 max((V - R)^2, (V_clip - R)^2)

  The critic cannot move further than `cliprange_value` from the values it
  had at rollout time, unless that moves it away from the return. Pass
  `cliprange_value=None` for the plain squared error. V_clip is the baselines' V_old +
  clip(V - V_old, -eps, eps) written as a clip of V itself, which is V exactly (not V to
  rounding) on tokens inside the range, so those never count as clipped. Aggregate with
  `aggregate`. Metrics: `vf_clipfrac`, the fraction of tokens where the clipped
  term was the larger, and `value_mean`, the masked mean of V.
  """
  v = values_BxT.astype(jnp.float32)
  returns = returns_BxT.astype(jnp.float32)
  unclipped_BxT = jnp.square(v - returns)
  mask_BxT = mask_BxT > 0
  if cliprange_value is None:
    loss_BxT, clipped_BxT = 0.5 * unclipped_BxT, jnp.zeros(v.shape, bool)
  else:
    old_v = old_values_BxT.astype(jnp.float32)
    v_clip = jnp.clip(v, old_v - cliprange_value, old_v + cliprange_value)
    clipped_sq_BxT = jnp.square(v_clip - returns)
    loss_BxT = 0.5 * jnp.maximum(unclipped_BxT, clipped_sq_BxT)
    clipped_BxT = clipped_sq_BxT > unclipped_BxT
  metrics = {
    "vf_clipfrac": masked_mean(clipped_BxT.astype(jnp.float32), mask_BxT, axis_name),
    "value_mean": masked_mean(v, mask_BxT, axis_name),
  }
  return loss_BxT, metrics
