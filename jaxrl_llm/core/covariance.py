"""Clip-Cov and KL-Cov: policy losses that restrain the tokens driving entropy collapse.

Cui et al., 2025, "The Entropy Mechanism of Reinforcement Learning for Reasoning
Language Models", arXiv:2505.22617, show that under policy gradient the entropy
change is driven by the covariance between a token's log-probability and its
advantage, and restrain the few tokens where that covariance is large. Each
token's share of the batch covariance is

  Cov_t = (log pi(y_t) - mean log pi) * (A_t - mean A)

with both means over the batch's response tokens (global over `axis_name`).
log pi is taken without gradient: the covariance only chooses tokens.

Both losses pick tokens by rank over the whole batch. Under `jax.shard_map` the
k-th largest value is found without gathering the batch: its 32 bits are decided
from the top, each with one psum-ed count (`_top_k_mask`), so the selection is the
one of the unsplit batch. Ties at the threshold are all selected.

The covariance and the top-k are over the arrays passed in (and `axis_name`): in the
trainer, one micro-batch. The authors' code computes them per micro-batch on each GPU.
"""

import jax
import jax.numpy as jnp

from jaxrl_llm.common.registry import register
from jaxrl_llm.core.policy_loss import (
  POLICY_LOSSES,
  _broadcast_advantages,
  _clipped_surrogate,
  _ratio,
  ratio_metrics,
)
from jaxrl_llm.core.stats import masked_mean, psum_if


def token_covariance(logp_BxT, adv_BxT, mask_BxT, axis_name=None):
  """Cov_t = (log pi_t - mean log pi) (A_t - mean A), means over masked tokens; no gradient."""
  mask_BxT = mask_BxT > 0
  logp_BxT = jax.lax.stop_gradient(logp_BxT.astype(jnp.float32))
  adv_BxT = jax.lax.stop_gradient(adv_BxT.astype(jnp.float32))
  centred_logp = logp_BxT - masked_mean(logp_BxT, mask_BxT, axis_name)
  centred_adv = adv_BxT - masked_mean(adv_BxT, mask_BxT, axis_name)
  return centred_logp * centred_adv


def _count_to_select(fraction, mask_BxT, axis_name):
  """max(1, floor(fraction * N)) with N the response tokens of the (global) batch."""
  n = psum_if(jnp.sum(mask_BxT, dtype=jnp.float32), axis_name)
  return jnp.maximum(jnp.floor(fraction * n), 1.0).astype(jnp.int32)


def _sortable_bits(x):
  """float32 -> uint32 with the same order (negative floats have their bits flipped)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  return jnp.where(bits >> 31 == 1, ~bits, bits | jnp.uint32(1 << 31))


def _top_k_mask(key_BxT, valid_BxT, k, axis_name=None):
  """The valid entries whose uint32 key is among the k largest over the (global) batch.

  The threshold v is the largest uint32 with #{valid, key >= v} >= k, i.e. the
  k-th largest key; it is built bit by bit from the top, keeping a bit when enough
  keys lie at or above it. All valid entries when k exceeds their number.
  """

  def decide_bit(i, v):
    candidate = v | (jnp.uint32(1) << (31 - i).astype(jnp.uint32))
    count = psum_if(jnp.sum(valid_BxT & (key_BxT >= candidate), dtype=jnp.int32), axis_name)
    return jnp.where(count >= k, candidate, v)

  threshold = jax.lax.fori_loop(0, 32, decide_bit, jnp.uint32(0))
  return valid_BxT & (key_BxT >= threshold)


def _mix32(x):
  """murmur3's 32-bit finaliser: a bijection of uint32 that spreads every input bit."""
  x = (x ^ (x >> 16)) * jnp.uint32(0x85EBCA6B)
  x = (x ^ (x >> 13)) * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _token_hash(logp_BxT, old_logp_BxT, key=None):
  """A pseudo-random uint32 per token from its position in the row and its log-probs."""
  bits = lambda x: jax.lax.bitcast_convert_type(
    jax.lax.stop_gradient(x).astype(jnp.float32), jnp.uint32
  )
  seed = jnp.uint32(0) if key is None else jax.random.bits(key, (), jnp.uint32)
  t_BxT = jnp.broadcast_to(jnp.arange(logp_BxT.shape[-1], dtype=jnp.uint32), logp_BxT.shape)
  h_BxT = _mix32(t_BxT ^ _mix32(seed))
  h_BxT = _mix32(h_BxT ^ bits(old_logp_BxT))
  return _mix32(h_BxT ^ bits(logp_BxT))


@register(POLICY_LOSSES, "clip_cov")
def clip_cov(
  logp_BxT,
  old_logp_BxT,
  advantages,
  mask_BxT,
  *,
  clip_cov_ratio=2e-4,
  clip_cov_lb=1.0,
  clip_cov_ub=5.0,
  clip_low=1.0,
  clip_high=1.0,
  key=None,
  axis_name=None,
):
  """Clip-Cov (Cui et al., 2025, arXiv:2505.22617), per token.

    I    = max(1, floor(clip_cov_ratio * N)) tokens drawn uniformly from
           {t : clip_cov_lb < Cov_t < clip_cov_ub, not clipped by PPO}
    L_t  = 0                                                   t in I (no gradient)
           max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))   otherwise

  N counts the batch's response tokens. The paper's defaults are r = 2e-4 and
  [1, 5]. The authors' Clip-Cov runs keep PPO's clip but at ratio 1 (r in [0, 2]),
  leaving the covariance clip to do the work; set 0.2 for PPO with Clip-Cov.

  The draw: the authors use `torch.randperm`; a loss here receives only arrays, so
  the tokens are the eligible ones with the largest hash of (position in the row,
  log pi_old, log pi). The hash changes with every update (log pi does), which makes
  the draw uniform in effect, and it depends on each token alone, so it is the same
  whole, vmapped or sharded. Pass `key` (a PRNG key, the same on every device) to
  mix it into the hash. Identical rows (duplicate completions) are drawn together.

  Extra metrics: `covclip_frac`, the fraction of tokens detached, and `cov_mean`,
  the batch covariance (the mean of Cov_t).
  """
  adv_BxT = _broadcast_advantages(advantages, logp_BxT)
  log_ratio, ratio = _ratio(logp_BxT, old_logp_BxT)
  mask_BxT = mask_BxT > 0
  loss_BxT, low_BxT, high_BxT = _clipped_surrogate(ratio, adv_BxT, clip_low, clip_high)
  cov_BxT = token_covariance(logp_BxT, adv_BxT, mask_BxT, axis_name)
  eligible_BxT = (
    mask_BxT & ~(low_BxT | high_BxT) & (cov_BxT > clip_cov_lb) & (cov_BxT < clip_cov_ub)
  )
  k = _count_to_select(clip_cov_ratio, mask_BxT, axis_name)
  hash_BxT = _token_hash(logp_BxT, old_logp_BxT, key)
  detached_BxT = _top_k_mask(hash_BxT, eligible_BxT, k, axis_name)
  loss_BxT = jnp.where(detached_BxT, 0.0, loss_BxT)
  metrics = {
    "covclip_frac": masked_mean(detached_BxT.astype(jnp.float32), mask_BxT, axis_name),
    "cov_mean": masked_mean(cov_BxT, mask_BxT, axis_name),
  }
  metrics.update(ratio_metrics(log_ratio, mask_BxT, low_BxT, high_BxT, axis_name))
  return loss_BxT, metrics


@register(POLICY_LOSSES, "kl_cov")
def kl_cov(
  logp_BxT,
  old_logp_BxT,
  advantages,
  mask_BxT,
  *,
  kl_cov_ratio=2e-3,
  kl_cov_coef=1.0,
  axis_name=None,
):
  """KL-Cov (Cui et al., 2025, arXiv:2505.22617), per token.

    I    = the max(1, floor(kl_cov_ratio * N)) tokens with the largest Cov_t
    L_t  = -A_t r_t + kl_cov_coef * |log r_t|     t in I
           -A_t r_t                               otherwise

  No ratio clipping (it takes no clip knob): the penalty restrains the high-covariance
  tokens instead. The
  paper states the penalty as a per-token KL between pi_old and pi with weight beta;
  the authors' code (and verl's) computes it as |log r_t|, as here. Defaults: the
  paper's Qwen2.5-7B setting, k = 2e-3 (2e-4 for 32B), beta = 1.

  Extra metrics: `klcov_frac`, the fraction of tokens penalised, `kl_abs`, the mean
  |log r|, and `cov_mean`, the batch covariance.
  """
  adv_BxT = _broadcast_advantages(advantages, logp_BxT)
  log_ratio, ratio = _ratio(logp_BxT, old_logp_BxT)
  mask_BxT = mask_BxT > 0
  cov_BxT = token_covariance(logp_BxT, adv_BxT, mask_BxT, axis_name)
  k = _count_to_select(kl_cov_ratio, mask_BxT, axis_name)
  penalised_BxT = _top_k_mask(_sortable_bits(cov_BxT), mask_BxT, k, axis_name)
  abs_log_ratio = jnp.abs(log_ratio)
  loss_BxT = -adv_BxT * ratio + jnp.where(penalised_BxT, kl_cov_coef * abs_log_ratio, 0.0)
  never_BxT = jnp.zeros(logp_BxT.shape, bool)
  mean = lambda x: masked_mean(x, mask_BxT, axis_name)
  metrics = {
    "klcov_frac": mean(penalised_BxT.astype(jnp.float32)),
    "kl_abs": mean(jax.lax.stop_gradient(abs_log_ratio)),
    "cov_mean": mean(cov_BxT),
  }
  metrics.update(ratio_metrics(log_ratio, mask_BxT, never_BxT, never_BxT, axis_name))
  return loss_BxT, metrics
