"""Policy-gradient objectives as per-token losses.

Every loss here has the signature

  loss_fn(logp_BxT, old_logp_BxT, advantages, mask_BxT, *, axis_name=None, **hparams)
      -> (loss_BxT, metrics)

`logp` is differentiated; `old_logp` is the behaviour policy's (the sampler's
or the recomputed pre-update policy's). `advantages` is `[B, T]`, or `[B]`
broadcast over tokens. The per-token loss is not yet masked or averaged:
pass it to `aggregate`. `metrics` are masked means over the batch (global over
`axis_name`): the fractions of tokens whose ratio was clipped below and above,
the approximate KL(old || new) = E[r - 1 - log r], and the ratio's mean, min
and max. Losses are minimised, so each is the negative of its paper's objective.
"""

import jax
import jax.numpy as jnp

from jaxrl_llm.common.registry import register
from jaxrl_llm.core.kl import LOG_RATIO_CLAMP
from jaxrl_llm.core.stats import masked_max, masked_mean, masked_min

POLICY_LOSSES: dict = {}  # name -> loss; `register(POLICY_LOSSES, name)` adds one


def _broadcast_advantages(advantages, logp_BxT):
  advantages = advantages.astype(jnp.float32)
  if advantages.shape == logp_BxT.shape:
    return advantages
  if advantages.shape == logp_BxT.shape[:1]:
    return advantages[:, None]
  raise ValueError(
    f"advantages {advantages.shape} must be [B, T] or [B] for log-probs {logp_BxT.shape}."
  )


def _ratio(logp_BxT, old_logp_BxT):
  """(log r, r) with log r clamped to +-20 so that exp never overflows."""
  log_ratio = jnp.clip(
    logp_BxT.astype(jnp.float32) - old_logp_BxT.astype(jnp.float32),
    -LOG_RATIO_CLAMP,
    LOG_RATIO_CLAMP,
  )
  return log_ratio, jnp.exp(log_ratio)


def ratio_metrics(log_ratio_BxT, mask_BxT, clipped_low_BxT, clipped_high_BxT, axis_name=None):
  """The metrics every policy loss reports, from its ratio and clip indicators."""
  log_ratio_BxT = jax.lax.stop_gradient(log_ratio_BxT)
  ratio_BxT = jnp.exp(log_ratio_BxT)
  mask_BxT = mask_BxT > 0
  mean = lambda x: masked_mean(x.astype(jnp.float32), mask_BxT, axis_name)
  return {
    "clipfrac_low": mean(clipped_low_BxT),
    "clipfrac_high": mean(clipped_high_BxT),
    "approx_kl": mean(ratio_BxT - 1.0 - log_ratio_BxT),
    "ratio_mean": mean(ratio_BxT),
    "ratio_min": masked_min(ratio_BxT, mask_BxT, axis_name),
    "ratio_max": masked_max(ratio_BxT, mask_BxT, axis_name),
  }


def _clipped_surrogate(ratio_BxT, adv_BxT, clip_low, clip_high):
  """max(-A r, -A clip(r, 1 - low, 1 + high)) and which side the clip was active on."""
  clipped_BxT = jnp.clip(ratio_BxT, 1.0 - clip_low, 1.0 + clip_high)
  loss_BxT = jnp.maximum(-adv_BxT * ratio_BxT, -adv_BxT * clipped_BxT)
  clipped_low_BxT = (ratio_BxT < 1.0 - clip_low) & (adv_BxT < 0)
  clipped_high_BxT = (ratio_BxT > 1.0 + clip_high) & (adv_BxT > 0)
  return loss_BxT, clipped_low_BxT, clipped_high_BxT


@register(POLICY_LOSSES, "ppo_clip")
def ppo_clip(
  logp_BxT,
  old_logp_BxT,
  advantages,
  mask_BxT,
  *,
  clip_low=0.2,
  clip_high=0.2,
  dual_clip=None,
  axis_name=None,
):
  """PPO's clipped surrogate (Schulman et al., 2017, arXiv:1707.06347), per token.

    r_t  = pi(y_t) / pi_old(y_t)
    L_t  = max(-A_t r_t, -A_t clip(r_t, 1 - clip_low, 1 + clip_high))

  Asymmetric ranges give DAPO's clip-higher (Yu et al., 2025, arXiv:2503.14476:
  clip_low=0.2, clip_high=0.28). With `dual_clip=c > 1` (Ye et al., 2020,
  arXiv:1912.09729), tokens with A_t < 0 are also bounded by the constant
  -c A_t, so a huge ratio on a negative advantage cannot blow up the loss:

    L_t = min(L_t, -c A_t)   where A_t < 0

  Extra metric with dual clip: `dualclip_frac`, the fraction of tokens it bound.
  """
  if dual_clip is not None and dual_clip <= 1.0:
    raise ValueError(f"dual_clip must be > 1 (Ye et al. use 3), got {dual_clip}.")
  adv_BxT = _broadcast_advantages(advantages, logp_BxT)
  log_ratio, ratio = _ratio(logp_BxT, old_logp_BxT)
  loss_BxT, low_BxT, high_BxT = _clipped_surrogate(ratio, adv_BxT, clip_low, clip_high)
  metrics = {}
  if dual_clip is not None:
    bound_BxT = -dual_clip * adv_BxT
    dual_BxT = (adv_BxT < 0) & (loss_BxT > bound_BxT)
    loss_BxT = jnp.where(dual_BxT, bound_BxT, loss_BxT)
    metrics["dualclip_frac"] = masked_mean(dual_BxT.astype(jnp.float32), mask_BxT > 0, axis_name)
  metrics.update(ratio_metrics(log_ratio, mask_BxT, low_BxT, high_BxT, axis_name))
  return loss_BxT, metrics


@register(POLICY_LOSSES, "gspo")
def gspo(
  logp_BxT,
  old_logp_BxT,
  advantages,
  mask_BxT,
  *,
  clip_low=3e-4,
  clip_high=4e-4,
  axis_name=None,
):
  """GSPO, Group Sequence Policy Optimization (Zheng et al., 2025, arXiv:2507.18071).

    s_i   = exp( (1/|y_i|) sum_t log(pi(y_it) / pi_old(y_it)) )    (sequence ratio)
    s_it  = sg(s_i) * pi(y_it) / sg(pi(y_it))                     (token form)
    L_it  = max(-A_it s_it, -A_it clip(s_it, 1 - clip_low, 1 + clip_high))

  Every token of a sequence shares the value s_i and its clip decision, and the
  gradient of s_it is s_i times the token's own score function: with
  sequence-level advantages this is GSPO, and per-token advantages give the
  paper's GSPO-token. `clip_low` and `clip_high` bound the sequence ratio s_i, not a
  token's: the paper's ranges are 3e-4 and 4e-4 because s_i is a geometric mean. No dual
  clip. Aggregate with 'seq-mean-token-mean' to match the paper.
  """
  adv_BxT = _broadcast_advantages(advantages, logp_BxT)
  log_ratio, _ = _ratio(logp_BxT, old_logp_BxT)
  mask_BxT = mask_BxT > 0
  length_Bx1 = jnp.maximum(mask_BxT.sum(-1, keepdims=True), 1)
  log_s_Bx1 = jnp.sum(jnp.where(mask_BxT, log_ratio, 0.0), -1, keepdims=True) / length_Bx1
  logp32_BxT = logp_BxT.astype(jnp.float32)
  log_s_BxT = jax.lax.stop_gradient(log_s_Bx1) + logp32_BxT - jax.lax.stop_gradient(logp32_BxT)
  loss_BxT, low_BxT, high_BxT = _clipped_surrogate(jnp.exp(log_s_BxT), adv_BxT, clip_low, clip_high)
  return loss_BxT, ratio_metrics(log_s_BxT, mask_BxT, low_BxT, high_BxT, axis_name)


@register(POLICY_LOSSES, "cispo")
def cispo(
  logp_BxT,
  old_logp_BxT,
  advantages,
  mask_BxT,
  *,
  clip_low=None,
  clip_high=4.0,
  axis_name=None,
):
  """CISPO, Clipped IS-weight Policy Optimization (MiniMax-M1, 2025, arXiv:2506.13585).

    w_t = sg(clip(r_t, 1 - clip_low, 1 + clip_high)),   grad L = -sum_t w_t A_t grad log pi(y_t)

  Unlike PPO, the importance weight is clipped and stopped, never the token's
  gradient: a clipped token still learns, with weight w_t. MiniMax-M1 sets no lower
  bound (`clip_low=None`: w_t >= 0) and tunes only the upper one, without publishing
  it; the default upper bound is ScaleRL's (Khatri et al., 2025, arXiv:2510.13786),
  which clips the weight to [0, 5] and reports results insensitive to that cap
  between 4 and 8. This returns the token form

    L_t = -A_t * (w_t + w_t * (log pi(y_t) - sg(log pi(y_t))))

  whose gradient is CISPO's and whose value is -w_t A_t (so -A_t at r_t = 1,
  like the other clipped objectives), rather than the paper's -w_t A_t log pi,
  which has the same gradient but a value that depends on log pi.
  """
  adv_BxT = _broadcast_advantages(advantages, logp_BxT)
  log_ratio, ratio = _ratio(logp_BxT, old_logp_BxT)
  lower = 0.0 if clip_low is None else 1.0 - clip_low
  w_BxT = jax.lax.stop_gradient(jnp.clip(ratio, lower, 1.0 + clip_high))
  logp32_BxT = logp_BxT.astype(jnp.float32)
  score_BxT = logp32_BxT - jax.lax.stop_gradient(logp32_BxT)
  loss_BxT = -adv_BxT * (w_BxT + w_BxT * score_BxT)
  low_BxT = ratio < lower
  high_BxT = ratio > 1.0 + clip_high
  return loss_BxT, ratio_metrics(log_ratio, mask_BxT, low_BxT, high_BxT, axis_name)


@register(POLICY_LOSSES, "reinforce")
def reinforce(logp_BxT, old_logp_BxT, advantages, mask_BxT, *, axis_name=None):
  """Vanilla policy gradient (Williams, 1992): L_t = -A_t log pi(y_t).

  Unbiased only on-policy (`old_logp` is used for metrics alone). The value is
  -A log pi, not -A; its gradient is -A grad log pi. Nothing is clipped: it takes no clip
  knob.
  """
  adv_BxT = _broadcast_advantages(advantages, logp_BxT)
  log_ratio, _ = _ratio(logp_BxT, old_logp_BxT)
  loss_BxT = -adv_BxT * logp_BxT.astype(jnp.float32)
  never_BxT = jnp.zeros(logp_BxT.shape, bool)
  return loss_BxT, ratio_metrics(log_ratio, mask_BxT, never_BxT, never_BxT, axis_name)


@register(POLICY_LOSSES, "sapo")
def sapo(
  logp_BxT,
  old_logp_BxT,
  advantages,
  mask_BxT,
  *,
  tau_pos=1.0,
  tau_neg=1.05,
  axis_name=None,
):
  """SAPO, Soft Adaptive Policy Optimization (Gao et al., Qwen, 2025, arXiv:2511.20347).

  A smooth gate on the token ratio replaces PPO's hard clip:

    f_t(r) = (4 / tau_t) sigmoid(tau_t (r - 1)),   tau_t = tau_pos if A_t > 0 else tau_neg
    J      = E[ f_t(r_t) A_t ],   grad J = E[ 4 s_t (1 - s_t) r_t A_t grad log pi(y_t) ]

  with s_t = sigmoid(tau_t (r_t - 1)). At r = 1 the gradient weight is 1 (the
  policy gradient); it decays smoothly as r leaves 1, faster for larger tau. The
  paper sets tau_neg > tau_pos (1.05 and 1.0) so negative-advantage updates, which
  raise the logits of every unsampled token, are damped sooner. Aggregate with
  'seq-mean-token-mean' to match the paper. This returns

    L_t = -A_t (f_t(r_t) - 2 / tau_t + 1)

  whose gradient is SAPO's and whose value is -A_t at r = 1 like the other losses;
  the paper's -A_t f_t(r_t) differs by the constant A_t (2 / tau_t - 1). The gate replaces
  the clip: it takes no clip knob (`tau_pos` and `tau_neg` set its softness).
  Extra metric: `gate_weight_mean`, the mean gradient weight 4 s (1 - s) r.
  """
  adv_BxT = _broadcast_advantages(advantages, logp_BxT)
  log_ratio, ratio = _ratio(logp_BxT, old_logp_BxT)
  tau_BxT = jnp.where(adv_BxT > 0, tau_pos, tau_neg)
  gate_BxT = jax.nn.sigmoid(tau_BxT * (ratio - 1.0))
  loss_BxT = -adv_BxT * (4.0 / tau_BxT * gate_BxT - 2.0 / tau_BxT + 1.0)
  weight_BxT = jax.lax.stop_gradient(4.0 * gate_BxT * (1.0 - gate_BxT) * ratio)
  never_BxT = jnp.zeros(logp_BxT.shape, bool)
  metrics = {"gate_weight_mean": masked_mean(weight_BxT, mask_BxT > 0, axis_name)}
  metrics.update(ratio_metrics(log_ratio, mask_BxT, never_BxT, never_BxT, axis_name))
  return loss_BxT, metrics


@register(POLICY_LOSSES, "gmpo")
def gmpo(
  logp_BxT,
  old_logp_BxT,
  advantages,
  mask_BxT,
  *,
  clip_low=0.4,
  clip_high=0.4,
  axis_name=None,
):
  """GMPO, Geometric-Mean Policy Optimization (Zhao et al., 2025, arXiv:2507.20673).

  GRPO with the geometric mean of the token ratios in place of their arithmetic
  mean, clipped per token in log space:

    c_it = min(log r_it, clip(log r_it, -clip_low, clip_high))   if A_i >= 0
           max(log r_it, clip(log r_it, -clip_low, clip_high))   if A_i < 0
    s_i  = exp( (1/|y_i|) sum_t c_it )
    L_i  = -A_i s_i

  so J = E[A_i (prod_t min(r_it, clip(r_it)))^(1/|y_i|)] for A_i >= 0 (the paper's
  sgn(A_i) prod_t |min(r_it A_i, clip(r_it) A_i)|^(1/|y_i|)). A clipped token has no
  gradient; an unclipped one gets -A_i s_i / |y_i| times its score function. The
  paper's range is (e^-0.4, e^0.4), i.e. `clip_low = clip_high = 0.4` in log space.
  Every token of row i carries L_i: aggregate with 'seq-mean-token-mean' to get the
  paper's mean over sequences. `clip_low` and `clip_high` are these log-space bounds, not
  PPO's ratio range; no dual clip. `[B, T]` advantages are averaged over each row's
  tokens first (GMPO is defined for sequence-level advantages), as in verl.
  """
  adv_BxT = _broadcast_advantages(advantages, logp_BxT)
  log_ratio, _ = _ratio(logp_BxT, old_logp_BxT)
  mask_BxT = mask_BxT > 0
  length_Bx1 = jnp.maximum(mask_BxT.sum(-1, keepdims=True), 1)
  adv_Bx1 = jnp.sum(jnp.where(mask_BxT, adv_BxT, 0.0), -1, keepdims=True) / length_Bx1
  bounded_BxT = jnp.clip(log_ratio, -clip_low, clip_high)
  pessimistic_BxT = jnp.where(
    adv_Bx1 >= 0, jnp.minimum(log_ratio, bounded_BxT), jnp.maximum(log_ratio, bounded_BxT)
  )
  log_s_Bx1 = jnp.sum(jnp.where(mask_BxT, pessimistic_BxT, 0.0), -1, keepdims=True) / length_Bx1
  loss_BxT = jnp.broadcast_to(-adv_Bx1 * jnp.exp(log_s_Bx1), logp_BxT.shape)
  low_BxT = (log_ratio < -clip_low) & (adv_Bx1 < 0)
  high_BxT = (log_ratio > clip_high) & (adv_Bx1 > 0)
  return loss_BxT, ratio_metrics(log_ratio, mask_BxT, low_BxT, high_BxT, axis_name)
