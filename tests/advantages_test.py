import itertools
import math

import chex
import hypothesis.extra.numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxrl_llm.core import (
  GROUP_ESTIMATORS,
  gae,
  group_advantages,
  masked_whiten,
  pass_at_k_advantages,
  reinforce_plus_plus,
  scores_to_token_rewards,
)


def gae_loop(rewards, values, mask, gamma, lam):
  """Plain Python reference: walk each row backwards over its response tokens only."""
  B, T = rewards.shape
  adv = np.zeros((B, T))
  for b in range(B):
    next_value, next_adv = 0.0, 0.0
    for t in reversed(range(T)):
      if not mask[b, t]:
        continue
      delta = rewards[b, t] + gamma * next_value - values[b, t]
      next_adv = delta + gamma * lam * next_adv
      next_value = values[b, t]
      adv[b, t] = next_adv
  return adv, np.where(mask, adv + values, 0.0)


def test_gae_by_hand():
  # One row, T=3, all response tokens: r = (0, 0, 1), V = (0.5, 0.6, 0.7), gamma=0.9, lam=0.5.
  r = jnp.array([[0.0, 0.0, 1.0]])
  v = jnp.array([[0.5, 0.6, 0.7]])
  m = jnp.ones((1, 3))
  adv, ret = gae(r, v, m, gamma=0.9, lam=0.5)
  d2 = 1.0 - 0.7  # nothing bootstraps after the last token
  d1 = 0.0 + 0.9 * 0.7 - 0.6
  d0 = 0.0 + 0.9 * 0.6 - 0.5
  a2 = d2
  a1 = d1 + 0.45 * a2
  a0 = d0 + 0.45 * a1
  np.testing.assert_allclose(adv, [[a0, a1, a2]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[a0 + 0.5, a1 + 0.6, a2 + 0.7]], rtol=1e-6)


def test_gae_bootstraps_a_cut_off_row():
  # Row 0 was cut off by the token budget: its return continues from V(s_T) = 2.0. Row 1 ended
  # (bootstrap 0) and has a hole after its last token, which the bootstrap passes through.
  r = jnp.array([[0.0, 1.0], [1.0, 0.0]])
  v = jnp.array([[0.5, 0.6], [0.3, 9.0]])
  m = jnp.array([[1, 1], [1, 0]])
  adv, ret = gae(r, v, m, gamma=0.9, lam=0.5, bootstrap_value_B=jnp.array([2.0, 0.0]))
  a1 = 1.0 + 0.9 * 2.0 - 0.6
  a0 = 0.0 + 0.9 * 0.6 - 0.5 + 0.45 * a1
  b0 = 1.0 - 0.3
  np.testing.assert_allclose(adv, [[a0, a1], [b0, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[a0 + 0.5, a1 + 0.6], [b0 + 0.3, 0.0]], rtol=1e-6)
  terminal, _ = gae(r, v, m, gamma=0.9, lam=0.5)
  np.testing.assert_allclose(terminal[1], adv[1])  # only the cut-off row changes
  assert not np.allclose(terminal[0], adv[0])


def test_gae_hole_is_not_an_episode_end():
  # Token 1 is an observation: its reward and value are skipped; token 0 bootstraps from token 2.
  r = jnp.array([[0.0, 5.0, 1.0, 0.0]])
  v = jnp.array([[0.2, 9.0, 0.4, 9.0]])
  m = jnp.array([[1, 0, 1, 0]])
  adv, ret = gae(r, v, m, gamma=0.5, lam=1.0)
  a2 = 1.0 - 0.4
  a0 = 0.0 + 0.5 * 0.4 - 0.2 + 0.5 * a2
  np.testing.assert_allclose(adv, [[a0, 0.0, a2, 0.0]], rtol=1e-6)
  np.testing.assert_allclose(ret, [[a0 + 0.2, 0.0, a2 + 0.4, 0.0]], rtol=1e-6)


@settings(max_examples=30, deadline=None)
@given(
  data=st.data(),
  B=st.integers(1, 4),
  T=st.integers(1, 12),
  gamma_lam=st.sampled_from([(1.0, 1.0), (0.99, 0.95), (0.5, 0.0), (0.0, 0.7)]),
)
def test_gae_equals_python_loop(data, B, T, gamma_lam):
  floats = st.floats(-3, 3, allow_nan=False, width=32)
  r = data.draw(hnp.arrays(np.float32, (B, T), elements=floats))
  v = data.draw(hnp.arrays(np.float32, (B, T), elements=floats))
  m = data.draw(hnp.arrays(np.bool_, (B, T)))
  gamma, lam = gamma_lam
  adv, ret = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=gamma, lam=lam)
  adv_ref, ret_ref = gae_loop(r.astype(np.float64), v.astype(np.float64), m, gamma, lam)
  np.testing.assert_allclose(adv, adv_ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(ret, ret_ref, rtol=1e-4, atol=1e-4)


def test_gae_long_sequence_with_holes_gamma_lam_one():
  rng = np.random.default_rng(0)
  r = rng.normal(size=(4, 300)).astype(np.float32)
  v = rng.normal(size=(4, 300)).astype(np.float32)
  m = rng.random((4, 300)) > 0.3
  adv, _ = gae(jnp.asarray(r), jnp.asarray(v), jnp.asarray(m), gamma=1.0, lam=1.0)
  adv_ref, _ = gae_loop(r.astype(np.float64), v.astype(np.float64), m, 1.0, 1.0)
  np.testing.assert_allclose(adv, adv_ref, rtol=1e-4, atol=1e-3)
  # With gamma = lam = 1 the advantage is the reward-to-go minus the value.
  togo = np.cumsum(np.where(m, r, 0)[:, ::-1], axis=1)[:, ::-1]
  np.testing.assert_allclose(adv, np.where(m, togo - v, 0), rtol=1e-4, atol=1e-3)


def test_gae_shape_error():
  with pytest.raises(ValueError, match="one \\[B, T\\] shape"):
    gae(jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.ones((2, 3)), gamma=1.0, lam=1.0)


# Group estimators against their numpy formulas.

SCORES = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 3.0, -1.0, 2.0, 0.0], np.float32)
LENGTHS = np.array([4, 2, 6, 8, 1, 1, 1, 1, 3, 5, 7, 9])


def _np_grpo(s, G, eps):
  g = s.reshape(-1, G)
  return ((g - g.mean(1, keepdims=True)) / (g.std(1, ddof=1, keepdims=True) + eps)).ravel()


def _np_rloo(s, G):
  g = s.reshape(-1, G)
  out = np.empty_like(g)
  for i in range(g.shape[0]):
    for j in range(G):
      out[i, j] = g[i, j] - np.delete(g[i], j).mean()
  return out.ravel()


def _np_rpp_baseline(s, G, eps, lengths):
  """verl's form: the group-centred score on every response token, whitened over them all."""
  g = s.reshape(-1, G)
  x = (g - g.mean(1, keepdims=True)).ravel()
  tokens = np.repeat(x, lengths)
  return (x - tokens.mean()) / np.sqrt(tokens.var(ddof=1) + eps) * (lengths > 0)


def _np_opo(s, lengths, G):
  g, lg = s.reshape(-1, G), lengths.reshape(-1, G).astype(np.float64)
  return (g - (g * lg).sum(1, keepdims=True) / lg.sum(1, keepdims=True)).ravel()


@pytest.mark.parametrize(
  "name,expected",
  [
    ("grpo", _np_grpo(SCORES, 4, 1e-6)),
    ("dr_grpo", (SCORES.reshape(3, 4) - SCORES.reshape(3, 4).mean(1, keepdims=True)).ravel()),
    ("rloo", _np_rloo(SCORES, 4)),
    ("reinforce_plus_plus_baseline", _np_rpp_baseline(SCORES, 4, 1e-6, LENGTHS)),
    ("opo", _np_opo(SCORES, LENGTHS, 4)),
  ],
)
def test_group_estimators_match_numpy(name, expected):
  adv = group_advantages(
    jnp.asarray(SCORES), group_size=4, estimator=name, lengths=jnp.asarray(LENGTHS)
  )
  chex.assert_shape(adv, (12,))
  np.testing.assert_allclose(adv, expected, rtol=1e-5, atol=1e-5)


def test_reinforce_pp_baseline_whitens_over_the_trained_tokens_only():
  """Rows with no loss token (length 0: a group dynamic sampling could not replace, a row
  masked for truncation) leave the statistics of the trained rows' advantages alone."""
  lengths = LENGTHS.copy()
  lengths[[1, 9]] = 0
  adv = np.asarray(
    group_advantages(
      jnp.asarray(SCORES), group_size=4, estimator="reinforce_plus_plus_baseline",
      lengths=jnp.asarray(lengths),
    )
  )  # fmt: skip
  np.testing.assert_allclose(adv, _np_rpp_baseline(SCORES, 4, 1e-6, lengths), rtol=1e-5, atol=1e-6)
  assert adv[1] == adv[9] == 0.0
  tokens = np.repeat(adv, lengths)  # the trained tokens' advantages: mean 0, unbiased var 1
  np.testing.assert_allclose([tokens.mean(), tokens.var(ddof=1)], [0.0, 1.0], atol=1e-5)


def test_group_estimators_by_hand():
  s = jnp.array([1.0, 0.0, 0.0, 1.0])  # mean 0.5, unbiased std sqrt(1/3)
  np.testing.assert_allclose(
    group_advantages(s, group_size=4, estimator="grpo", eps=0.0),
    np.array([1, -1, -1, 1]) * 0.5 * np.sqrt(3),
    rtol=1e-6,
  )
  # RLOO: 1 - 1/3 = 2/3 and 0 - 2/3 = -2/3.
  np.testing.assert_allclose(
    group_advantages(s, group_size=4, estimator="rloo"), [2 / 3, -2 / 3, -2 / 3, 2 / 3], rtol=1e-6
  )
  # OPO with lengths (1, 1, 1, 3): baseline (1 + 3) / 6 = 2/3.
  np.testing.assert_allclose(
    group_advantages(s, group_size=4, estimator="opo", lengths=jnp.array([1, 1, 1, 3])),
    [1 / 3, -2 / 3, -2 / 3, 1 / 3],
    rtol=1e-6,
  )


def test_all_equal_group_gives_zero_advantage():
  s = jnp.full((8,), 0.7)
  for name in GROUP_ESTIMATORS:
    adv = group_advantages(s, group_size=4, estimator=name, lengths=jnp.arange(1, 9))
    np.testing.assert_allclose(adv, 0.0, atol=1e-5, err_msg=name)


def test_group_errors():
  with pytest.raises(ValueError, match="Unknown advantage estimator 'gpro'.*grpo"):
    group_advantages(jnp.zeros(4), group_size=2, estimator="gpro")
  with pytest.raises(ValueError, match="multiple of group_size=3"):
    group_advantages(jnp.zeros(4), group_size=3, estimator="grpo")
  with pytest.raises(ValueError, match="group_size >= 2"):
    group_advantages(jnp.zeros(4), group_size=1, estimator="grpo")
  with pytest.raises(ValueError, match="needs lengths"):
    group_advantages(jnp.zeros(4), group_size=2, estimator="opo")


def test_masked_whiten():
  x = jnp.array([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
  m = jnp.array([[1, 1, 0], [1, 1, 0]], bool)
  vals = np.array([1.0, 2.0, 3.0, 4.0])
  expected = (vals - 2.5) / np.sqrt(vals.var(ddof=1) + 1e-8)
  out = masked_whiten(x, m)
  np.testing.assert_allclose(out[m], expected, rtol=1e-6)
  np.testing.assert_allclose(out[~m], 0.0)
  np.testing.assert_allclose(masked_whiten(x, m, shift_mean=False)[m], expected + 2.5, rtol=1e-6)


def test_reinforce_plus_plus():
  r = np.array([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]], np.float32)
  m = np.array([[1, 1, 1, 0], [1, 1, 0, 0]], bool)
  gamma = 0.5
  returns = np.array([[0.25, 0.5, 1.0, 0.0], [1.0, 2.0, 0.0, 0.0]])
  vals = returns[m]
  expected = (vals - vals.mean()) / np.sqrt(vals.var(ddof=1) + 1e-8)
  out = reinforce_plus_plus(jnp.asarray(r), jnp.asarray(m), gamma=gamma)
  np.testing.assert_allclose(np.asarray(out)[m], expected, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(out)[~m], 0.0)


def test_scores_to_token_rewards():
  m = jnp.array([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])
  out = scores_to_token_rewards(jnp.array([2.0, 3.0, 4.0]), m)
  np.testing.assert_array_equal(out, [[0, 2, 0, 0], [0, 0, 3, 0], [0, 0, 0, 0]])


def test_gae_under_jit_keeps_float32():
  adv, ret = jax.jit(gae, static_argnames=("unroll",))(
    jnp.ones((2, 5), jnp.bfloat16),
    jnp.ones((2, 5), jnp.bfloat16),
    jnp.ones((2, 5)),
    gamma=0.9,
    lam=0.9,
  )
  chex.assert_type([adv, ret], jnp.float32)


def test_pass_at_k_by_hand():
  # G = 4, k = 2: C(4, 2) = 6 pairs. c = 1: R = 1 - C(3, 2) / 6 = 1/2, sigma = 1/2,
  # A_pos = 1, A_neg = (1/2 - C(2, 1) / C(3, 1)) / (1/2) = -1/3. c = 2: R = 5/6,
  # sigma = sqrt(5) / 6, A = +-(1/6) / sigma = +-1/sqrt(5). c = 3, 4: every pair has a
  # correct sample, sigma = 0; c = 0: none has, sigma = 0.
  s = jnp.array([[0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 1], [1, 1, 0, 1], [1, 1, 1, 1]], jnp.float32)
  five = 1 / np.sqrt(5)
  expected = [
    [0, 0, 0, 0],
    [-1 / 3, 1, -1 / 3, -1 / 3],
    [five, -five, -five, five],
    [0, 0, 0, 0],
    [0, 0, 0, 0],
  ]
  np.testing.assert_allclose(pass_at_k_advantages(s, k=2, eps=0.0), expected, rtol=1e-6)
  flat = group_advantages(s.reshape(-1), group_size=4, estimator="pass_at_k", k=2, eps=0.0)
  np.testing.assert_allclose(flat.reshape(5, 4), expected, rtol=1e-6)


def _pass_at_k_by_enumeration(scores, k):
  """Every k-subset's reward is its best sample's; a sample's advantage is the mean of
  (reward - mean) / std over the subsets that contain it."""
  subsets = list(itertools.combinations(range(len(scores)), k))
  rewards = np.array([max(scores[i] for i in sub) for sub in subsets], float)
  mean, std = rewards.mean(), rewards.std()
  if std < 1e-9:
    return np.zeros(len(scores))
  adv = (rewards - mean) / std
  return np.array(
    [
      np.mean([a for a, sub in zip(adv, subsets, strict=True) if i in sub])
      for i in range(len(scores))
    ]
  )


def test_pass_at_k_equals_enumerating_every_subset():
  rng = np.random.default_rng(0)
  groups = []
  for G in range(2, 7):
    groups += [rng.permutation([1.0] * c + [0.0] * (G - c)) for c in range(G + 1)]  # binary
    groups.append(rng.normal(size=G))  # any reward
    groups.append(rng.integers(0, 3, size=G) / 2)  # ties
  for scores in groups:
    for k in range(1, len(scores) + 1):
      got = pass_at_k_advantages(jnp.asarray(scores[None], jnp.float32), k=k, eps=0.0)
      np.testing.assert_allclose(
        got[0], _pass_at_k_by_enumeration(scores, k), rtol=1e-5, atol=1e-5, err_msg=(scores, k)
      )


def test_pass_at_k_matches_authors_on_random_groups():
  """RUCAIBox/Passk_Training@c3ba575 code/passk_adv.py calc_adv, restated with math.comb
  (scipy's comb, as they use it, is 0 for a negative n)."""
  comb = lambda n, r: math.comb(n, r) if n >= 0 else 0

  def theirs(val, k):
    n, c = len(val), int(np.sum(val == 1))
    rho = 1 - comb(n - c, k) / comb(n, k)
    sigma = np.sqrt(rho * (1 - rho))
    adv_p = (1 - rho) / (sigma + 1e-6)
    adv_n = (1 - rho - comb(n - c - 1, k - 1) / comb(n - 1, k - 1)) / (sigma + 1e-6)
    return np.where(val == 1, adv_p, adv_n)

  rng = np.random.default_rng(1)
  scores = (rng.random((64, 16)) < rng.random((64, 1))).astype(np.float32)
  for k in (1, 2, 4, 8, 16):
    expected = np.stack([theirs(row, k) for row in scores])
    got = jax.jit(pass_at_k_advantages, static_argnames="k")(jnp.asarray(scores), k=k)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5, err_msg=k)


def test_pass_at_1_is_grpo_with_the_population_std():
  s = jnp.array([[1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0]])
  expected = (s - s.mean()) / s.std()
  np.testing.assert_allclose(pass_at_k_advantages(s, k=1, eps=0.0), expected, rtol=1e-6)


def test_pass_at_k_errors():
  with pytest.raises(ValueError, match="1 <= k <= group_size=4; got k=5"):
    group_advantages(jnp.zeros(8), group_size=4, estimator="pass_at_k", k=5)
  with pytest.raises(ValueError, match="got k=0"):
    pass_at_k_advantages(jnp.zeros((2, 4)), k=0)
