"""Advantage estimators: GAE over tokens, and group baselines over sampled completions.

Per-token arrays are `[B, T]` (B sequences, T response tokens); `mask_BxT` is 1
on response tokens and may have holes (e.g. tool or user turns in a multi-turn
episode). Group estimators take one scalar score per sequence, with rows
`[i*G, (i+1)*G)` holding the G completions of prompt i.
"""

import functools
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.common.registry import lookup, register
from jaxrl_llm.core.stats import masked_whiten, psum_if

__all__ = [
  "GROUP_ESTIMATORS",
  "TOKEN_ESTIMATORS",
  "TokenEstimator",
  "dr_grpo_advantages",
  "estimator_function",
  "gae",
  "group_advantages",
  "grpo_advantages",
  "masked_whiten",
  "opo_advantages",
  "pass_at_k_advantages",
  "reinforce_plus_plus",
  "reinforce_plus_plus_baseline_advantages",
  "rloo_advantages",
  "register_token_estimator",
  "scores_to_token_rewards",
]

# name -> fn(scores_NxG, *, eps, lengths_NxG, axis_name, **kwargs) -> advantages_NxG
GROUP_ESTIMATORS: dict = {}


class TokenEstimator(NamedTuple):
  """A per-token advantage estimator as registered: the function, and whether it reads the
  critic's values (the trainer then trains a value head beside the policy).

  `fn(rewards_BxT, values_BxT, mask_BxT, *, bootstrap_value_B, axis_name, **kwargs)
  -> (advantages_BxT, returns_BxT)`; `returns_BxT` is the critic's regression target
  (zeros when `critic` is False).
  """

  fn: Callable
  critic: bool


TOKEN_ESTIMATORS: dict = {}  # name -> TokenEstimator


def register_token_estimator(name: str, *, critic: bool = False):
  """Decorator: adds a per-token estimator to `TOKEN_ESTIMATORS` under `name`.
  `critic=True`: it reads `values_BxT`, so configs that choose it train a critic."""

  def decorator(fn):
    register(TOKEN_ESTIMATORS, name)(TokenEstimator(fn, critic))
    return fn

  return decorator


def estimator_function(name: str) -> Callable:
  """The function of the estimator `name`, token-level or group."""
  token = TOKEN_ESTIMATORS.get(name)
  return token.fn if token else lookup(GROUP_ESTIMATORS, name, "advantage estimator")


class GaeCarry(NamedTuple):
  """What the reverse GAE scan carries from step t+1 back to step t."""

  v_tp1: jax.Array  # [B] value of the next response token (0 past the last one)
  adv_tp1: jax.Array  # [B] advantage of the next response token


def _gae_step(carry: GaeCarry, xs, *, gamma, lam):
  """One backward step of GAE; masked steps pass the carry through and output 0."""
  r_t, v_t, m_t = xs
  delta_t = r_t + gamma * carry.v_tp1 - v_t
  adv_t = delta_t + gamma * lam * carry.adv_tp1
  new_carry = GaeCarry(
    v_tp1=jnp.where(m_t, v_t, carry.v_tp1), adv_tp1=jnp.where(m_t, adv_t, carry.adv_tp1)
  )
  return new_carry, jnp.where(m_t, adv_t, 0.0)


def gae(rewards_BxT, values_BxT, mask_BxT, *, gamma, lam, bootstrap_value_B=None, unroll=1):
  """Generalised advantage estimation (Schulman et al., 2016, arXiv:1506.02438).

    delta_t = r_t + gamma * V(s_{t'}) - V(s_t)
    A_t     = delta_t + gamma * lam * A_{t'}
    R_t     = A_t + V(s_t)

  where t' is the next position with mask 1 after t. Masked positions are
  skipped: the recursion carries through them untouched and they get A = R = 0,
  so a hole in the mask is not an episode end, and its rewards are ignored
  (put a turn's reward on a response token). Past the last response token,
  V(s_{t'}) is `bootstrap_value_B` (default 0: the episode ended there). Pass the
  critic's value of the state after the last token for rows that were cut off by the
  token budget rather than ended, and 0 for the rest.

  Computed with a reverse `jax.lax.scan` over time; `unroll` trades compile
  time for fewer loop iterations.

  Returns:
    `(advantages_BxT, returns_BxT)`, float32, zero where `mask_BxT` is 0.
  """
  if not rewards_BxT.shape == values_BxT.shape == mask_BxT.shape:
    raise ValueError(
      f"gae needs rewards {rewards_BxT.shape}, values {values_BxT.shape} and "
      f"mask {mask_BxT.shape} of one [B, T] shape."
    )
  r_TxB = rewards_BxT.astype(jnp.float32).T
  v_TxB = values_BxT.astype(jnp.float32).T
  m_TxB = mask_BxT.T > 0
  # zeros_like keeps the inputs' varying mesh axes, as shard_map's scan carry must.
  zeros_B = jnp.zeros_like(r_TxB[0] + v_TxB[0])
  v_end_B = zeros_B if bootstrap_value_B is None else zeros_B + bootstrap_value_B
  step = functools.partial(_gae_step, gamma=gamma, lam=lam)
  _, adv_TxB = jax.lax.scan(
    step, GaeCarry(v_end_B, zeros_B), (r_TxB, v_TxB, m_TxB), reverse=True, unroll=unroll
  )
  adv_BxT = adv_TxB.T
  returns_BxT = jnp.where(mask_BxT > 0, adv_BxT + values_BxT.astype(jnp.float32), 0.0)
  return adv_BxT, returns_BxT


def scores_to_token_rewards(scores_B, mask_BxT):
  """Puts each sequence's scalar score on its last response token; zeros elsewhere.

  Rows with an empty mask get no reward.
  """
  mask_BxT = mask_BxT > 0
  T = mask_BxT.shape[-1]
  last_B = T - 1 - jnp.argmax(mask_BxT[:, ::-1], axis=-1)
  at_last_BxT = (jnp.arange(T)[None, :] == last_B[:, None]) & mask_BxT
  return jnp.where(at_last_BxT, scores_B[:, None].astype(jnp.float32), 0.0)


def reinforce_plus_plus(rewards_BxT, mask_BxT, *, gamma=1.0, eps=1e-8, axis_name=None):
  """REINFORCE++ advantages (Hu, 2025, arXiv:2501.03262).

    G_t = r_t + gamma * G_{t'}          (t' the next response token; as in `gae`)
    A_t = (G_t - mean(G)) / sqrt(var(G) + eps)   over all response tokens of the batch

  `rewards_BxT` usually holds the score on the last token minus a per-token KL
  penalty. The discounted return is GAE with V = 0 and lam = 1. Mean and var are
  global over `axis_name` when given.
  """
  zeros_BxT = jnp.zeros(rewards_BxT.shape, jnp.float32)
  returns_BxT, _ = gae(rewards_BxT, zeros_BxT, mask_BxT, gamma=gamma, lam=1.0)
  return masked_whiten(returns_BxT, mask_BxT > 0, eps=eps, axis_name=axis_name)


@register_token_estimator("gae", critic=True)
def gae_advantages(
  rewards_BxT,
  values_BxT,
  mask_BxT,
  *,
  gamma=1.0,
  lam=0.95,
  whiten=True,
  bootstrap_value_B=None,
  axis_name=None,
):
  """PPO's advantages: `gae`, then whitened over the batch's response tokens (global over
  `axis_name`); returns `(advantages_BxT, returns_BxT)`, the returns un-whitened."""
  adv_BxT, returns_BxT = gae(
    rewards_BxT, values_BxT, mask_BxT, gamma=gamma, lam=lam, bootstrap_value_B=bootstrap_value_B
  )
  if whiten:
    adv_BxT = masked_whiten(adv_BxT, mask_BxT > 0, axis_name=axis_name)
  return adv_BxT, returns_BxT


@register_token_estimator("reinforce_plus_plus")
def reinforce_plus_plus_advantages(
  rewards_BxT, values_BxT, mask_BxT, *, gamma=1.0, eps=1e-8, bootstrap_value_B=None, axis_name=None
):
  """`reinforce_plus_plus` in the token-estimator signature (no critic: values unused)."""
  del bootstrap_value_B
  adv_BxT = reinforce_plus_plus(rewards_BxT, mask_BxT, gamma=gamma, eps=eps, axis_name=axis_name)
  return adv_BxT, jnp.zeros_like(values_BxT, jnp.float32)


# Group estimators. Each maps scores `[N, G]` (N prompts x G samples) to
# advantages `[N, G]`; `group_advantages` handles the flat `[B]` layout.


def _need_group(scores_NxG, name):
  if scores_NxG.shape[-1] < 2:
    raise ValueError(
      f"estimator {name!r} needs group_size >= 2 (got {scores_NxG.shape[-1]}): it "
      "compares each sample with the others of its prompt. Sample more completions "
      "per prompt, or use an estimator that works alone such as 'reinforce_plus_plus'."
    )


@register(GROUP_ESTIMATORS, "grpo")
def grpo_advantages(scores_NxG, *, eps=1e-6, lengths_NxG=None, axis_name=None):
  """GRPO (Shao et al., 2024, DeepSeekMath, arXiv:2402.03300).

  A_i = (r_i - mean_j r_j) / (std_j r_j + eps)   with the unbiased std of the group.
  """
  del lengths_NxG, axis_name
  _need_group(scores_NxG, "grpo")
  mean_Nx1 = scores_NxG.mean(-1, keepdims=True)
  std_Nx1 = scores_NxG.std(-1, keepdims=True, ddof=1)
  return (scores_NxG - mean_Nx1) / (std_Nx1 + eps)


@register(GROUP_ESTIMATORS, "dr_grpo")
def dr_grpo_advantages(scores_NxG, *, eps=1e-6, lengths_NxG=None, axis_name=None):
  """Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    A_i = r_i - mean_j r_j

  GRPO without the std division, which up-weights too-easy and too-hard prompts.
  """
  del eps, lengths_NxG, axis_name
  return scores_NxG - scores_NxG.mean(-1, keepdims=True)


@register(GROUP_ESTIMATORS, "rloo")
def rloo_advantages(scores_NxG, *, eps=1e-6, lengths_NxG=None, axis_name=None):
  """RLOO (Ahmadian et al., 2024, arXiv:2402.14740; Kool et al., 2019).

  A_i = r_i - (1 / (G - 1)) * sum_{j != i} r_j  =  G / (G - 1) * (r_i - mean_j r_j)
  """
  del eps, lengths_NxG, axis_name
  _need_group(scores_NxG, "rloo")
  G = scores_NxG.shape[-1]
  loo_mean_NxG = (scores_NxG.sum(-1, keepdims=True) - scores_NxG) / (G - 1)
  return scores_NxG - loo_mean_NxG


@register(GROUP_ESTIMATORS, "reinforce_plus_plus_baseline")
def reinforce_plus_plus_baseline_advantages(
  scores_NxG, *, eps=1e-6, lengths_NxG=None, axis_name=None
):
  """REINFORCE++-baseline (Hu, 2025, arXiv:2501.03262).

    x_i = r_i - mean_{j in group} r_j,   A_i = (x_i - mean(x)) / sqrt(var(x) + eps)

  The group mean removes the prompt's difficulty; whitening over the batch (global over
  `axis_name`) sets the scale without GRPO's per-group std. As in verl, mean and unbiased
  var are over the trained response tokens: with `lengths_NxG` (each row's count of loss
  tokens) row i weighs l_i, and rows of length 0, which the loss leaves out, neither enter
  the statistics nor get an advantage. Without lengths every row weighs 1.
  """
  centred_NxG = scores_NxG - scores_NxG.mean(-1, keepdims=True)
  if lengths_NxG is None:
    lengths_NxG = jnp.ones(centred_NxG.shape, jnp.float32)
  w_NxG = lengths_NxG.astype(jnp.float32)
  n = psum_if(jnp.sum(w_NxG), axis_name)
  mean = psum_if(jnp.sum(w_NxG * centred_NxG), axis_name) / jnp.maximum(n, 1.0)
  sq = psum_if(jnp.sum(w_NxG * jnp.square(centred_NxG - mean)), axis_name)
  var = sq / jnp.maximum(n - 1.0, 1.0)  # unbiased, over the tokens
  return jnp.where(w_NxG > 0, (centred_NxG - mean) * jax.lax.rsqrt(var + eps), 0.0)


@register(GROUP_ESTIMATORS, "opo")
def opo_advantages(scores_NxG, *, eps=1e-6, lengths_NxG=None, axis_name=None):
  """OPO's length-weighted baseline (Hao et al., 2025, "On-Policy RL with Optimal
  reward baseline", arXiv:2505.23585).

    b = sum_j l_j r_j / sum_j l_j,   A_i = r_i - b

  with l_j the number of response tokens of sample j: the variance-optimal
  baseline for a sequence-level reward when the gradient norm grows with length.
  """
  del eps, axis_name
  if lengths_NxG is None:
    raise ValueError("estimator 'opo' needs lengths=: the response token count of each row.")
  lengths_NxG = lengths_NxG.astype(jnp.float32)
  total_Nx1 = jnp.maximum(lengths_NxG.sum(-1, keepdims=True), 1.0)
  baseline_Nx1 = (lengths_NxG * scores_NxG).sum(-1, keepdims=True) / total_Nx1
  return scores_NxG - baseline_Nx1


def _pass_at_k_weights(G, k):
  """Exact constants over sorted positions j = 1..G (ascending), from `math.comb`:

  w_j = C(j-1, k-1) / C(G, k)     share of all k-subsets whose best is the j-th
  v_j = C(j-1, k-1) / C(G-1, k-1) share of the k-subsets holding j whose best is j
  u_j = C(j-2, k-2) / C(G-1, k-1) share of the k-subsets holding a given i < j whose
                                  best is j
  """
  comb = lambda n, r: math.comb(n, r) if n >= 0 and r >= 0 else 0
  total, holding_one = math.comb(G, k), math.comb(G - 1, k - 1)
  positions = range(1, G + 1)
  w = [comb(j - 1, k - 1) / total for j in positions]
  v = [comb(j - 1, k - 1) / holding_one for j in positions]
  u = [comb(j - 2, k - 2) / holding_one for j in positions]
  return (jnp.asarray(x, jnp.float32) for x in (w, v, u))


@register(GROUP_ESTIMATORS, "pass_at_k")
def pass_at_k_advantages(scores_NxG, *, eps=1e-6, lengths_NxG=None, axis_name=None, k=4):
  """Pass@k advantages, analytic form (Chen et al., 2025, "Pass@k Training for Adaptively
  Balancing Exploration and Exploitation of Large Reasoning Models", arXiv:2508.10751).

  The reward of a k-subset of the group is its best sample's (pass@k: the expected
  maximum reward of k samples). Over all C(G, k) subsets S, with mean R and
  population std sigma of max_S, each sample's advantage is the mean over the
  subsets that contain it:

    A_i = (E[max_S r | i in S] - R) / (sigma + eps)

  For binary rewards with c of the G samples correct, this is the paper's closed form:

    R     = 1 - C(G-c, k) / C(G, k),   sigma = sqrt(R (1 - R))
    A_pos = (1 - R) / (sigma + eps)
    A_neg = (1 - R - C(G-c-1, k-1) / C(G-1, k-1)) / (sigma + eps)

  Computed for any rewards after sorting each group: the subsets whose best is the
  j-th smallest number C(j-1, k-1) (ties are split by the sort, which leaves every
  max_S and so every A_i unchanged), and the constants come from `math.comb` at
  trace time, so they are exact. Groups with sigma = 0 (all equal, or for binary
  rewards too few wrong samples to fill a k-subset) get 0. k = 1 is GRPO with the
  population std. `k` must be a Python int in [1, G].
  """
  del lengths_NxG, axis_name
  G = scores_NxG.shape[-1]
  if int(k) != k or not 1 <= k <= G:
    raise ValueError(
      f"pass_at_k needs an integer k with 1 <= k <= group_size={G}; got k={k}. "
      "Lower algo.estimator_kwargs' k or sample more completions per prompt."
    )
  w_G, v_G, u_G = _pass_at_k_weights(G, int(k))
  order_NxG = jnp.argsort(scores_NxG, axis=-1)
  x_NxG = jnp.take_along_axis(scores_NxG, order_NxG, axis=-1)
  # The advantages are shift-invariant. Measured from the group's best, the rewards of
  # the subsets that cannot miss it (weight 0) drop out exactly: sigma = 0 comes out 0,
  # and for binary rewards 1 - R is a sum of small weights, not a difference near 1.
  x_NxG = x_NxG - x_NxG[:, -1:]
  mean_Nx1 = jnp.sum(w_G * x_NxG, axis=-1, keepdims=True)
  var_Nx1 = jnp.sum(w_G * jnp.square(x_NxG - mean_Nx1), axis=-1, keepdims=True)
  above_NxG = u_G * x_NxG  # each sample's best when a larger one is in the subset
  above_NxG = jnp.cumsum(above_NxG[:, ::-1], axis=-1)[:, ::-1] - above_NxG
  best_NxG = v_G * x_NxG + above_NxG  # E[max_S | i in S], sorted order
  sigma_Nx1 = jnp.sqrt(jnp.where(var_Nx1 > 0, var_Nx1, 1.0))  # finite gradient at var 0
  adv_sorted_NxG = (best_NxG - mean_Nx1) / (sigma_Nx1 + eps)
  adv_NxG = jnp.take_along_axis(adv_sorted_NxG, jnp.argsort(order_NxG, axis=-1), axis=-1)
  return jnp.where(var_Nx1 > 0, adv_NxG, 0.0)


def group_advantages(
  scores_B, *, group_size, estimator, eps=None, lengths=None, axis_name=None, **kwargs
):
  """One advantage per sequence from a group baseline chosen by name.

  Args:
    scores_B: one scalar reward per sequence, group-major: rows
      `[i*G, (i+1)*G)` are the G samples of prompt i.
    group_size: G. B must be a multiple of it (groups never straddle devices).
    estimator: a key of `GROUP_ESTIMATORS` ('grpo', 'dr_grpo', 'rloo',
      'reinforce_plus_plus_baseline', 'opo', 'pass_at_k', or one you registered), or such
      a function itself (with its settings already bound, say by `functools.partial`).
    eps: stabiliser of the estimator's division, if any (None: the estimator's default).
    lengths: `[B]` response lengths, for 'opo'.
    axis_name: for estimators with batch-wide statistics.
    **kwargs: the estimator's own settings (e.g. pass@k's `k`).

  Returns:
    float32 `[B]` advantages; broadcast over tokens with `adv_B[:, None]`.
  """
  fn = (
    estimator if callable(estimator) else lookup(GROUP_ESTIMATORS, estimator, "advantage estimator")
  )
  if scores_B.ndim != 1 or scores_B.shape[0] % group_size:
    raise ValueError(
      f"scores must be [B] with B a multiple of group_size={group_size}; got "
      f"{scores_B.shape}. Rows i*G..i*G+G-1 must be one prompt's samples."
    )
  to_groups = lambda x: x.reshape(-1, group_size)
  lengths_NxG = None if lengths is None else to_groups(lengths)
  if eps is not None:
    kwargs["eps"] = eps
  adv_NxG = fn(
    to_groups(scores_B.astype(jnp.float32)), lengths_NxG=lengths_NxG, axis_name=axis_name, **kwargs
  )
  return adv_NxG.reshape(-1)
