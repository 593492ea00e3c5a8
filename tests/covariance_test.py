import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.core import clip_cov, kl_cov, token_covariance

# Two rows of two tokens. Mean log pi = -1.375 and mean A = 0, so
# Cov = (log pi + 1.375) A = [[0.875, 0.375], [0.125, 1.125]].
LOGP = jnp.array([[-0.5, -1.0], [-1.5, -2.5]])
LOG_R = jnp.array([[0.2, -0.1], [0.3, -0.4]])
OLD = LOGP - LOG_R
ADV = jnp.array([1.0, -1.0])
MASK = jnp.ones((2, 2))
COV = np.array([[0.875, 0.375], [0.125, 1.125]])


def test_token_covariance_by_hand():
  adv_BxT = jnp.broadcast_to(ADV[:, None], (2, 2))
  np.testing.assert_allclose(token_covariance(LOGP, adv_BxT, MASK), COV, rtol=1e-6)
  # Masked tokens leave the means: with (1, 1) out, mean log pi = -1 and mean A = 1/3.
  mask = jnp.array([[1, 1], [1, 0]])
  expected = (np.asarray(LOGP) + 1.0) * (np.array([[1.0], [-1.0]]) - 1 / 3)
  np.testing.assert_allclose(token_covariance(LOGP, adv_BxT, mask)[mask > 0], expected[mask > 0])


def test_kl_cov_by_hand():
  fn = lambda lp: kl_cov(lp, OLD, ADV, MASK, kl_cov_ratio=0.5, kl_cov_coef=1.0)
  loss, m = fn(LOGP)
  r = np.exp(np.asarray(LOG_R))
  # k = 4 * 0.5 = 2 largest covariances: (1, 1) and (0, 0) get + |log r|.
  expected = [[-r[0, 0] + 0.2, -r[0, 1]], [r[1, 0], r[1, 1] + 0.4]]
  np.testing.assert_allclose(loss, expected, rtol=1e-6)
  g = jax.grad(lambda lp: fn(lp)[0].sum())(LOGP)
  np.testing.assert_allclose(g, [[-r[0, 0] + 1, -r[0, 1]], [r[1, 0], r[1, 1] - 1]], rtol=1e-6)
  np.testing.assert_allclose(m["klcov_frac"], 0.5)
  np.testing.assert_allclose(m["kl_abs"], 0.25, rtol=1e-6)
  np.testing.assert_allclose(m["cov_mean"], COV.mean(), rtol=1e-6)
  # The default ratio 2e-3 still penalises one token (at least one), the largest.
  loss, m = kl_cov(LOGP, OLD, ADV, MASK)
  np.testing.assert_allclose(loss, [[-r[0, 0], -r[0, 1]], [r[1, 0], r[1, 1] + 0.4]], rtol=1e-6)


def test_clip_cov_by_hand():
  kwargs = {"clip_cov_lb": 0.3, "clip_cov_ub": 1.0, "clip_cov_ratio": 0.5}
  fn = lambda lp, **kw: clip_cov(lp, OLD, ADV, MASK, **(kwargs | kw))
  r = np.exp(np.asarray(LOG_R))
  # Cov in (0.3, 1.0): (0, 0) and (0, 1); k = 2 detaches both. PPO's clip at 1 binds nowhere.
  loss, m = fn(LOGP)
  np.testing.assert_allclose(loss, [[0.0, 0.0], [r[1, 0], r[1, 1]]], rtol=1e-6)
  g = jax.grad(lambda lp: fn(lp)[0].sum())(LOGP)
  np.testing.assert_allclose(g, [[0.0, 0.0], [r[1, 0], r[1, 1]]], rtol=1e-6)
  np.testing.assert_allclose(m["covclip_frac"], 0.5)
  # With PPO's clip at 0.1, (0, 0) (A > 0, r = 1.22) is clipped by PPO already, so only
  # (0, 1) is detached; (1, 1) (A < 0, r = 0.67) is PPO-clipped to 0.9.
  loss, m = fn(LOGP, clip_low=0.1, clip_high=0.1)
  np.testing.assert_allclose(loss, [[-1.1, 0.0], [r[1, 0], 0.9]], rtol=1e-6)
  np.testing.assert_allclose(m["covclip_frac"], 0.25)
  np.testing.assert_allclose(m["clipfrac_high"], 0.25)
  np.testing.assert_allclose(m["clipfrac_low"], 0.25)
  # k = max(1, floor(0.25 * 4)) = 1: one of the two eligible tokens.
  loss, m = fn(LOGP, clip_cov_ratio=0.25)
  assert int(np.sum(np.asarray(loss)[0] == 0.0)) == 1 and np.all(np.asarray(loss)[1] != 0)
  np.testing.assert_allclose(m["covclip_frac"], 0.25)


def _random_batch(seed, B=8, T=16):
  rng = np.random.default_rng(seed)
  logp = -np.abs(2 * rng.normal(size=(B, T))).astype(np.float32)
  old = (logp + 0.3 * rng.normal(size=(B, T))).astype(np.float32)
  adv = (2 * rng.normal(size=(B,))).astype(np.float32)
  mask = rng.random((B, T)) < 0.8
  mask[:, 0] = True
  return logp, old, adv, mask


def _covariance(logp, adv_BxT, mask):
  return (logp - logp[mask].mean()) * (adv_BxT - adv_BxT[mask].mean())


@pytest.mark.parametrize("seed", range(3))
def test_clip_cov_matches_authors_on_random_inputs(seed):
  """PRIME-RL/Entropy-Mechanism-of-RL@8850579 compute_policy_loss_clip_cov, restated: PPO's
  loss; eligible tokens are unclipped by PPO with lb < Cov < ub; min(n, max(1,
  int(ratio * N))) of them, drawn at random, get loss 0. Our draw differs (a hash, not
  randperm), so check that it is such a draw and that the loss given it is theirs."""
  lb, ub, ratio, eps = 0.5, 5.0, 0.05, 0.2
  logp, old, adv, mask = _random_batch(seed)
  adv_BxT = np.broadcast_to(adv[:, None], logp.shape)
  r = np.exp(logp - old)
  unclipped = -adv_BxT * r
  clipped = -adv_BxT * np.clip(r, 1 - eps, 1 + eps)
  by_ppo = (clipped > unclipped) & mask
  cov = _covariance(logp, adv_BxT, mask)
  eligible = (cov > lb) & (cov < ub) & mask & ~by_ppo
  clip_num = max(int(ratio * mask.sum()), 1)
  assert eligible.sum() > clip_num  # the draw has a choice to make

  kwargs = {"clip_cov_ratio": ratio, "clip_cov_lb": lb, "clip_cov_ub": ub}
  fn = lambda lp: clip_cov(lp, old, adv, mask, clip_low=eps, clip_high=eps, **kwargs)[0]
  loss = np.asarray(fn(jnp.asarray(logp)))
  detached = (loss == 0.0) & mask
  assert not np.any(detached & ~eligible) and detached.sum() == min(clip_num, eligible.sum())
  theirs = np.maximum(unclipped, clipped) * ~detached
  np.testing.assert_allclose(loss[mask], theirs[mask], rtol=1e-5, atol=1e-6)
  g = jax.grad(lambda lp: jnp.sum(jnp.where(mask, fn(lp), 0.0)))(jnp.asarray(logp))
  theirs_grad = np.where(mask & ~detached & ~by_ppo, -adv_BxT * r, 0.0)
  np.testing.assert_allclose(g, theirs_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_kl_cov_matches_authors_on_random_inputs(seed):
  """PRIME-RL/Entropy-Mechanism-of-RL@8850579 (and verl@b178a3cd) compute_policy_loss_kl_cov,
  restated: -A r, plus coef |log r| on the top max(1, int(N * ratio)) tokens by Cov."""
  ratio, coef = 0.1, 0.7
  logp, old, adv, mask = _random_batch(seed)
  adv_BxT = np.broadcast_to(adv[:, None], logp.shape)
  log_r = logp - old
  cov = _covariance(logp, adv_BxT, mask)
  n_top = max(1, int(mask.sum() * ratio))
  flat = np.flatnonzero(mask)
  top = np.zeros(logp.size, bool)
  top[flat[np.argsort(-cov.ravel()[flat])[:n_top]]] = True
  top = top.reshape(logp.shape)
  theirs = -adv_BxT * np.exp(log_r) + coef * np.abs(log_r) * top
  theirs_grad = -adv_BxT * np.exp(log_r) + coef * np.sign(log_r) * top

  fn = lambda lp: kl_cov(lp, old, adv, mask, kl_cov_ratio=ratio, kl_cov_coef=coef)[0]
  np.testing.assert_allclose(np.asarray(fn(jnp.asarray(logp)))[mask], theirs[mask], rtol=1e-5)
  g = jax.grad(lambda lp: jnp.sum(jnp.where(mask, fn(lp), 0.0)))(jnp.asarray(logp))
  np.testing.assert_allclose(np.asarray(g)[mask], theirs_grad[mask], rtol=1e-5, atol=1e-6)


def test_clip_cov_draw_is_deterministic_and_uniform():
  logp, old, adv, mask = _random_batch(0)
  kwargs = {"clip_cov_ratio": 0.02, "clip_cov_lb": 0.5, "clip_cov_ub": 5.0}
  draw = lambda key=None: clip_cov(logp, old, adv, mask, key=key, **kwargs)[0] == 0
  np.testing.assert_array_equal(draw(), draw())
  eligible = np.asarray(clip_cov(logp, old, adv, mask, **(kwargs | {"clip_cov_ratio": 1.0}))[0])
  eligible = (eligible == 0) & mask  # ratio 1: every eligible token is detached
  n = max(int(0.02 * mask.sum()), 1)
  draws = np.asarray(jax.jit(jax.vmap(draw))(jax.random.split(jax.random.key(0), 4000))) & mask
  assert np.all(draws.sum(axis=(1, 2)) == n) and not np.any(draws & ~eligible)
  # Each of the ~30 eligible tokens is drawn with frequency n / |eligible| (within 4 sigma).
  expected = 4000 * n / eligible.sum()
  np.testing.assert_allclose(draws.sum(0)[eligible], expected, rtol=0.35)


def test_masked_tokens_are_never_selected():
  mask = jnp.array([[1, 1], [1, 0]])  # (1, 1), the largest covariance, is padding
  _, m = kl_cov(LOGP, OLD, ADV, mask, kl_cov_ratio=1.0)
  np.testing.assert_allclose(m["klcov_frac"], 1.0)  # every real token, and no more
  loss, _ = kl_cov(LOGP, OLD, ADV, mask)
  np.testing.assert_allclose(loss[1, 1], np.exp(-0.4), rtol=1e-6)  # no penalty on padding
