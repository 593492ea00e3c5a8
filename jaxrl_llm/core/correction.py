"""Corrections for the gap between the policy that sampled and the one being trained.

A rollout's tokens y_t were drawn from the behaviour policy pi_behav: the sampler's
distribution, with its own numerics, its temperature, top-k and top-p, and possibly
params some updates old. The trainer's losses are written for pi_old, the trainer's own
log-probs of the same tokens at the params the update starts from. Importance sampling
reweights each token by

  rho_t = pi_old(y_t) / pi_behav(y_t)

and the decoupled objective (Hilton et al., 2021, arXiv:2110.00641; Fu et al., AReaL,
2025, arXiv:2505.24298) is the usual clipped loss in pi / pi_old, times a weight w_t
built from rho: L_t = w_t * loss_t(pi / pi_old). Every correction here has the signature

  correction_fn(old_logp_BxT, behav_logp_BxT, mask_BxT, *, axis_name=None, **hparams)
      -> (weights_BxT, metrics)

`weights_BxT` carry no gradient and are 0 on padding; masked-out tokens and sequences get
weight 0 but stay in the aggregation's denominator, so a loss's normaliser never depends on
the correction (and stays split-invariant). `metrics` are global over `axis_name`:

  mismatch_k3      k3 estimate of KL(pi_behav || pi_old) = E_behav[rho - 1 - log rho]
  is_weight_mean   mean weight over tokens;  is_weight_max  its max
  is_masked_frac   fraction of tokens whose weight a mask set to 0

The truncation caps and masking bands are those of the papers: C = 2 for token TIS (Yao
et al., 2025, "Your efficient RL framework secretly brings you off-policy RL training"),
[0.5, 5] for IcePop (Ling Team, 2025, arXiv:2510.18855).
"""

import inspect

import jax
import jax.numpy as jnp

from jaxrl_llm.common.registry import lookup, register
from jaxrl_llm.core.kl import LOG_RATIO_CLAMP, kl_k3
from jaxrl_llm.core.policy_loss import POLICY_LOSSES
from jaxrl_llm.core.stats import masked_max, masked_mean

SEQUENCE_REDUCTIONS = ("product", "geometric")

CORRECTIONS: dict = {}  # name -> fn(old_logp, behav_logp, mask, **hparams) -> (weights, metrics)


def _log_rho(old_logp_BxT, behav_logp_BxT, mask_BxT):
  """log(pi_old / pi_behav) per token, clamped to +-20, 0 on padding."""
  d = old_logp_BxT.astype(jnp.float32) - behav_logp_BxT.astype(jnp.float32)
  return jnp.where(mask_BxT, jnp.clip(d, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP), 0.0)


def _sequence_log_rho(log_rho_BxT, mask_BxT, reduce):
  """log of the sequence's ratio, [B, 1]: the sum of token log-ratios (the product of the
  ratios, the exact sequence IS weight) or their mean (the geometric mean, length-free)."""
  _check_reduce(reduce)
  total_Bx1 = jnp.sum(log_rho_BxT, -1, keepdims=True)
  if reduce == "geometric":
    total_Bx1 = total_Bx1 / jnp.maximum(mask_BxT.sum(-1, keepdims=True), 1)
  return jnp.clip(total_Bx1, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def _check_reduce(reduce) -> None:
  if reduce not in SEQUENCE_REDUCTIONS:
    raise ValueError(f"reduce must be one of {SEQUENCE_REDUCTIONS}, got {reduce!r}.")


def _band(cap, low, high):
  """[low, high], each defaulting to the symmetric band [1/cap, cap]."""
  if cap <= 1.0:
    raise ValueError(f"cap must be > 1, got {cap}.")
  low = 1.0 / cap if low is None else low
  high = cap if high is None else high
  if not 0.0 <= low < 1.0 < high:
    raise ValueError(f"the band must hold 1: need 0 <= low < 1 < high, got [{low}, {high}].")
  return low, high


def check_hparams(fn, **hparams) -> None:
  """Raises ValueError for knobs that correction `fn` would refuse, in plain Python (no
  device work), so a config can be checked before the devices start."""
  defaults = {
    k: p.default
    for k, p in inspect.signature(fn).parameters.items()
    if p.default is not inspect.Parameter.empty
  }
  given = defaults | hparams
  if "reduce" in given:
    _check_reduce(given["reduce"])
  if "low" in given:  # a masking band
    _band(given.get("cap", given["high"]), given["low"], given["high"])
  elif "cap" in given and not given["cap"] > 0:
    raise ValueError(f"cap must be > 0, got {given['cap']}.")


def _finish(weights_BxT, old_logp_BxT, behav_logp_BxT, mask_BxT, axis_name):
  """Zeroes padding, stops the gradient and adds the metrics every correction reports."""
  weights_BxT = jax.lax.stop_gradient(jnp.where(mask_BxT, weights_BxT, 0.0))
  old = jax.lax.stop_gradient(old_logp_BxT)
  metrics = {
    "mismatch_k3": masked_mean(kl_k3(behav_logp_BxT, old), mask_BxT, axis_name),
    "is_weight_mean": masked_mean(weights_BxT, mask_BxT, axis_name),
    "is_weight_max": masked_max(weights_BxT, mask_BxT, axis_name),
    "is_masked_frac": masked_mean((weights_BxT == 0).astype(jnp.float32), mask_BxT, axis_name),
  }
  return weights_BxT, metrics


@register(CORRECTIONS, "none")
def no_correction(old_logp_BxT, behav_logp_BxT, mask_BxT, *, axis_name=None):
  """w_t = 1: the loss trusts pi_old as the sampling distribution (the metrics still show
  how far the sampler was from it)."""
  mask_BxT = mask_BxT > 0
  ones_BxT = jnp.ones(mask_BxT.shape, jnp.float32)
  return _finish(ones_BxT, old_logp_BxT, behav_logp_BxT, mask_BxT, axis_name)


@register(CORRECTIONS, "token_tis")
def token_tis(old_logp_BxT, behav_logp_BxT, mask_BxT, *, cap=2.0, axis_name=None):
  """Token-level truncated IS (Yao et al., 2025; Espeholt et al.'s V-trace truncation):

  w_t = min(rho_t, C)
  """
  mask_BxT = mask_BxT > 0
  rho_BxT = jnp.exp(_log_rho(old_logp_BxT, behav_logp_BxT, mask_BxT))
  return _finish(jnp.minimum(rho_BxT, cap), old_logp_BxT, behav_logp_BxT, mask_BxT, axis_name)


@register(CORRECTIONS, "sequence_tis")
def sequence_tis(
  old_logp_BxT, behav_logp_BxT, mask_BxT, *, cap=2.0, reduce="product", axis_name=None
):
  """Sequence-level truncated IS: every token of sequence i gets

    w_i = min(prod_t rho_it, C)                     (reduce='product')
    w_i = min(exp(mean_t log rho_it), C)            (reduce='geometric')

  The product is the exact sequence weight, whose variance grows with length; the geometric
  mean (GSPO's normalisation, Zheng et al., 2025, arXiv:2507.18071) is length-free.
  """
  mask_BxT = mask_BxT > 0
  log_rho_BxT = _log_rho(old_logp_BxT, behav_logp_BxT, mask_BxT)
  rho_Bx1 = jnp.exp(_sequence_log_rho(log_rho_BxT, mask_BxT, reduce))
  weights_BxT = jnp.broadcast_to(jnp.minimum(rho_Bx1, cap), mask_BxT.shape)
  return _finish(weights_BxT, old_logp_BxT, behav_logp_BxT, mask_BxT, axis_name)


@register(CORRECTIONS, "token_mis")
def token_mis(
  old_logp_BxT, behav_logp_BxT, mask_BxT, *, cap=2.0, low=None, high=None, axis_name=None
):
  """Token-level masked IS: a token whose ratio leaves the band is dropped, the others keep
  their importance weight (Liu, Li et al., 2025, "When speed kills stability"):

    w_t = rho_t * 1[low <= rho_t <= high],    [low, high] = [1/C, C] unless given
  """
  low, high = _band(cap, low, high)
  mask_BxT = mask_BxT > 0
  rho_BxT = jnp.exp(_log_rho(old_logp_BxT, behav_logp_BxT, mask_BxT))
  weights_BxT = jnp.where((rho_BxT >= low) & (rho_BxT <= high), rho_BxT, 0.0)
  return _finish(weights_BxT, old_logp_BxT, behav_logp_BxT, mask_BxT, axis_name)


@register(CORRECTIONS, "sequence_mis")
def sequence_mis(
  old_logp_BxT,
  behav_logp_BxT,
  mask_BxT,
  *,
  cap=2.0,
  low=None,
  high=None,
  reduce="geometric",
  axis_name=None,
):
  """Sequence-level masked IS: a whole sequence is dropped when its ratio (the product or
  the geometric mean of its token ratios) leaves the band; kept sequences carry it:

    w_i = rho_i * 1[low <= rho_i <= high]
  """
  low, high = _band(cap, low, high)
  mask_BxT = mask_BxT > 0
  log_rho_BxT = _log_rho(old_logp_BxT, behav_logp_BxT, mask_BxT)
  rho_Bx1 = jnp.exp(_sequence_log_rho(log_rho_BxT, mask_BxT, reduce))
  weights_Bx1 = jnp.where((rho_Bx1 >= low) & (rho_Bx1 <= high), rho_Bx1, 0.0)
  weights_BxT = jnp.broadcast_to(weights_Bx1, mask_BxT.shape)
  return _finish(weights_BxT, old_logp_BxT, behav_logp_BxT, mask_BxT, axis_name)


@register(CORRECTIONS, "icepop")
def icepop(old_logp_BxT, behav_logp_BxT, mask_BxT, *, low=0.5, high=5.0, axis_name=None):
  """IcePop's two-sided token masking (Ling Team, 2025, arXiv:2510.18855):

    w_t = rho_t * 1[low <= rho_t <= high]

  token MIS with IcePop's asymmetric band: a token the trainer finds far less likely than
  the sampler did (rho < 1/2) or far more (rho > 5) carries no gradient.
  """
  return token_mis(
    old_logp_BxT, behav_logp_BxT, mask_BxT, cap=high, low=low, high=high, axis_name=axis_name
  )


def staleness_metrics(versions_B, current_version, mask_B=None, axis_name=None):
  """How many updates old each row's sampling params were: mean and max over rows."""
  mask_B = jnp.ones(versions_B.shape, bool) if mask_B is None else mask_B > 0
  age_B = (current_version - versions_B).astype(jnp.float32)
  return {
    "staleness_mean": masked_mean(age_B, mask_B, axis_name),
    "staleness_max": masked_max(age_B, mask_B, axis_name),
  }


def corrected_policy_loss(
  policy_loss,
  logp_BxT,
  old_logp_BxT,
  behav_logp_BxT,
  advantages,
  mask_BxT,
  *,
  correction="none",
  correction_kwargs=None,
  axis_name=None,
  **hparams,
):
  """A policy loss in pi / pi_old, each token weighted by a mismatch correction of
  pi_old / pi_behav (the decoupled objective): `policy_loss` and `correction` are names in
  `POLICY_LOSSES` and `CORRECTIONS` or functions. Returns (weighted loss_BxT, the loss's
  metrics and the correction's)."""
  loss_fn = policy_loss
  if isinstance(policy_loss, str):
    loss_fn = lookup(POLICY_LOSSES, policy_loss, "policy loss")
  weigh = correction
  if isinstance(correction, str):
    weigh = lookup(CORRECTIONS, correction, "mismatch correction")
  loss_BxT, metrics = loss_fn(
    logp_BxT, old_logp_BxT, advantages, mask_BxT, axis_name=axis_name, **hparams
  )
  weights_BxT, weight_metrics = weigh(
    old_logp_BxT, behav_logp_BxT, mask_BxT, axis_name=axis_name, **(correction_kwargs or {})
  )
  return weights_BxT * loss_BxT, metrics | weight_metrics
