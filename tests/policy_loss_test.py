import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.core import POLICY_LOSSES, aggregate, cispo, gmpo, gspo, ppo_clip, reinforce, sapo

CLIP_VARIANTS = {
  "ppo": (ppo_clip, {}),
  "clip_higher": (ppo_clip, {"clip_low": 0.2, "clip_high": 0.28}),
  "dual_clip": (ppo_clip, {"dual_clip": 3.0}),
  "gspo": (gspo, {}),
  "cispo": (cispo, {}),
  "cispo_two_sided": (cispo, {"clip_low": 0.2, "clip_high": 0.2}),
  "sapo": (sapo, {}),
}


def _batch(B=4, T=6, seed=0):
  k1, k2, k3 = jax.random.split(jax.random.key(seed), 3)
  logp = -jnp.abs(jax.random.normal(k1, (B, T)))
  adv = jax.random.normal(k2, (B, T))
  mask = jax.random.bernoulli(k3, 0.8, (B, T)).at[:, 0].set(True)
  return logp, adv, mask


@pytest.mark.parametrize("variant", sorted(CLIP_VARIANTS))
def test_on_policy_loss_is_minus_advantage(variant):
  fn, kwargs = CLIP_VARIANTS[variant]
  logp, adv, mask = _batch()
  loss, metrics = fn(logp, logp, adv, mask, **kwargs)
  np.testing.assert_allclose(loss, -adv, rtol=1e-6, atol=1e-7)
  for key in ("clipfrac_low", "clipfrac_high", "approx_kl"):
    np.testing.assert_allclose(metrics[key], 0.0, atol=1e-7, err_msg=key)
  for key in ("ratio_mean", "ratio_min", "ratio_max"):
    np.testing.assert_allclose(metrics[key], 1.0, rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("variant", sorted(CLIP_VARIANTS))
def test_on_policy_gradient_is_policy_gradient(variant):
  """At r = 1 every clip variant (GSPO with per-sequence advantages) has gradient -A."""
  fn, kwargs = CLIP_VARIANTS[variant]
  logp, adv, mask = _batch()
  adv_B = adv[:, 0]
  grad = jax.grad(lambda lp: jnp.sum(fn(lp, logp, adv_B, mask, **kwargs)[0]))(logp)
  np.testing.assert_allclose(grad, -jnp.broadcast_to(adv_B[:, None], logp.shape), rtol=1e-6)


def test_ppo_clip_by_hand():
  old = jnp.zeros((1, 4))
  logp = jnp.log(jnp.array([[1.5, 0.5, 1.5, 0.5]]))  # ratios
  adv = jnp.array([[1.0, 1.0, -1.0, -1.0]])
  mask = jnp.ones((1, 4))
  loss, m = ppo_clip(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
  # r=1.5, A=+1 -> clipped to 1.28; r=0.5, A=+1 -> unclipped 0.5 (pessimistic);
  # r=1.5, A=-1 -> unclipped 1.5; r=0.5, A=-1 -> clipped to 0.8.
  np.testing.assert_allclose(loss, [[-1.28, -0.5, 1.5, 0.8]], rtol=1e-6)
  np.testing.assert_allclose(m["clipfrac_high"], 0.25)
  np.testing.assert_allclose(m["clipfrac_low"], 0.25)
  np.testing.assert_allclose(m["ratio_max"], 1.5, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_min"], 0.5, rtol=1e-6)
  np.testing.assert_allclose(m["ratio_mean"], 1.0, rtol=1e-6)
  expected_kl = np.mean([r - 1 - np.log(r) for r in (1.5, 0.5, 1.5, 0.5)])
  np.testing.assert_allclose(m["approx_kl"], expected_kl, rtol=1e-5)
  g = jax.grad(lambda lp: ppo_clip(lp, old, adv, mask, clip_low=0.2, clip_high=0.28)[0].sum())(logp)
  np.testing.assert_allclose(g, [[0.0, -0.5, 1.5, 0.0]], rtol=1e-6)  # -A r where unclipped


def test_dual_clip_bounds_negative_advantages():
  old = jnp.zeros((1, 3))
  logp = jnp.log(jnp.array([[5.0, 2.0, 5.0]]))
  adv = jnp.array([[-1.0, -1.0, 1.0]])
  loss, m = ppo_clip(logp, old, adv, jnp.ones((1, 3)), dual_clip=3.0)
  np.testing.assert_allclose(loss, [[3.0, 2.0, -1.2]], rtol=1e-6)
  np.testing.assert_allclose(m["dualclip_frac"], 1 / 3, rtol=1e-6)
  with pytest.raises(ValueError, match="dual_clip must be > 1"):
    ppo_clip(logp, old, adv, jnp.ones((1, 3)), dual_clip=0.5)


def test_gspo_sequence_ratio_by_hand():
  old = jnp.zeros((2, 3))
  logp = jnp.array([[0.3, -0.1, 9.0], [0.01, 0.02, 0.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 1]])
  adv = jnp.array([1.0, -2.0])
  loss, m = gspo(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
  s0 = np.exp((0.3 - 0.1) / 2)  # masked token ignored: 1.105, inside the clip range
  s1 = np.exp(0.03 / 3)
  np.testing.assert_allclose(loss[0, :2], [-s0, -s0], rtol=1e-6)
  np.testing.assert_allclose(loss[1], [2 * s1] * 3, rtol=1e-6)
  # Gradient of token t is -A_i s_i (the token's own score function times the sequence ratio).
  g = jax.grad(
    lambda lp: jnp.sum(
      jnp.where(mask, gspo(lp, old, adv, mask, clip_low=0.2, clip_high=0.2)[0], 0.0)
    )
  )(logp)
  np.testing.assert_allclose(g, [[-s0, -s0, 0.0], [2 * s1] * 3], rtol=1e-6)
  # With the paper's tiny ranges, sequence 0 is clipped above (A > 0): every token at once.
  _, m = gspo(logp, old, adv, mask)
  np.testing.assert_allclose(m["clipfrac_high"], 2 / 5, rtol=1e-6)


def test_cispo_keeps_gradient_of_clipped_tokens():
  old = jnp.zeros((1, 2))
  logp = jnp.log(jnp.array([[2.0, 0.5]]))
  adv = jnp.array([[1.0, 1.0]])
  mask = jnp.ones((1, 2))
  loss, m = cispo(logp, old, adv, mask, clip_high=0.28)
  np.testing.assert_allclose(loss, [[-1.28, -0.5]], rtol=1e-6)
  g = jax.grad(lambda lp: cispo(lp, old, adv, mask, clip_high=0.28)[0].sum())(logp)
  np.testing.assert_allclose(g, [[-1.28, -0.5]], rtol=1e-6)  # PPO would give 0 for token 0
  np.testing.assert_allclose(m["clipfrac_high"], 0.5)
  np.testing.assert_allclose(m["clipfrac_low"], 0.0)


def test_reinforce_by_hand():
  logp = jnp.array([[-0.5, -2.0]])
  adv = jnp.array([2.0])
  loss, _ = reinforce(logp, logp, adv, jnp.ones((1, 2)))
  np.testing.assert_allclose(loss, [[1.0, 4.0]])
  g = jax.grad(lambda lp: reinforce(lp, lp, adv, jnp.ones((1, 2)))[0].sum())(logp)
  np.testing.assert_allclose(g, [[-2.0, -2.0]])


def test_masked_tokens_do_not_enter_metrics():
  old = jnp.zeros((1, 3))
  logp = jnp.array([[0.0, 0.0, 50.0]])  # the masked token has a huge ratio
  loss, m = ppo_clip(logp, old, jnp.ones((1, 3)), jnp.array([[1, 1, 0]]))
  np.testing.assert_allclose(m["ratio_max"], 1.0)
  np.testing.assert_allclose(m["clipfrac_high"], 0.0)
  assert np.all(np.isfinite(loss))


def test_registry_and_metric_keys():
  logp, adv, mask = _batch()
  for name, fn in POLICY_LOSSES.items():
    loss, metrics = fn(logp, logp - 0.1, adv, mask)
    chex.assert_shape(loss, logp.shape)
    assert {
      "clipfrac_low",
      "clipfrac_high",
      "approx_kl",
      "ratio_mean",
      "ratio_min",
      "ratio_max",
    } <= set(metrics), name


def test_bad_advantage_shape():
  logp, adv, mask = _batch()
  with pytest.raises(ValueError, match="advantages"):
    ppo_clip(logp, logp, adv[:, :2], mask)


def test_cispo_default_bounds_are_scalerls():
  """No lower bound (MiniMax-M1) and the weight capped at 5 (ScaleRL), not DAPO's 1.28."""
  logp = jnp.log(jnp.array([[0.3, 0.8, 0.9, 0.01]]))
  old = jnp.log(jnp.array([[0.1, 0.2, 0.1, 0.5]]))  # ratios 3, 4, 9, 0.02
  adv, mask = jnp.ones((1,)), jnp.ones((1, 4))
  loss, metrics = cispo(logp, old, adv, mask)
  np.testing.assert_allclose(loss, [[-3.0, -4.0, -5.0, -0.02]], rtol=1e-5)
  np.testing.assert_allclose(metrics["clipfrac_high"], 0.25)
  np.testing.assert_allclose(metrics["clipfrac_low"], 0.0)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


def test_sapo_by_hand():
  old = jnp.zeros((1, 4))
  logp = jnp.log(jnp.array([[1.5, 0.5, 1.5, 0.5]]))  # ratios
  adv = jnp.array([[1.0, 1.0, -1.0, -1.0]])
  mask = jnp.ones((1, 4))
  fn = lambda lp: sapo(lp, old, adv, mask, tau_pos=1.0, tau_neg=2.0)
  loss, m = fn(logp)
  # A > 0, tau 1: -(4 sigmoid(r - 1) - 1);  A < 0, tau 2: 2 sigmoid(2 (r - 1)).
  np.testing.assert_allclose(loss, [[-1.4898373, -0.5101627, 1.4621172, 0.5378828]], rtol=1e-6)
  # d/dlog pi: -A 4 s (1 - s) r with s = sigmoid(tau (r - 1)): smooth, never exactly 0.
  g = jax.grad(lambda lp: fn(lp)[0].sum())(logp)
  np.testing.assert_allclose(g, [[-1.4100223, -0.4700074, 1.1796716, 0.3932239]], rtol=1e-6)
  np.testing.assert_allclose(m["gate_weight_mean"], np.mean(np.abs(g)), rtol=1e-6)
  np.testing.assert_allclose(m["clipfrac_high"], 0.0)


def test_sapo_matches_verl_on_random_inputs():
  """verl's compute_policy_loss_sapo (volcengine/verl@b178a3cd, core_algos.py) per token is
  -A (4 / tau) sigmoid(tau (r - 1)), tau by the sign of A; ours adds A (2 / tau - 1)."""
  rng = np.random.default_rng(0)
  logp = -np.abs(rng.normal(size=(3, 7)))
  old = logp + 0.5 * rng.normal(size=(3, 7))
  adv = rng.normal(size=(3, 7))
  tau_pos, tau_neg = 1.0, 1.05

  def theirs(lp):
    tau = np.where(adv > 0, tau_pos, tau_neg)
    return -adv * (4.0 / tau) * _sigmoid(tau * (np.exp(lp - old) - 1.0))

  args = (jnp.asarray(old, jnp.float32), jnp.asarray(adv, jnp.float32), jnp.ones((3, 7)))
  ours = lambda lp: sapo(lp, *args)[0]
  lp32 = jnp.asarray(logp, jnp.float32)
  tau = np.where(adv > 0, tau_pos, tau_neg)
  np.testing.assert_allclose(ours(lp32) - adv * (2 / tau - 1), theirs(logp), rtol=1e-5, atol=1e-6)
  h = 1e-6  # tokens are independent: one central difference per token, all at once
  expected = (theirs(logp + h) - theirs(logp - h)) / (2 * h)
  g = jax.grad(lambda lp: ours(lp).sum())(lp32)
  np.testing.assert_allclose(g, expected, rtol=1e-4, atol=1e-5)


def test_gmpo_by_hand():
  old = jnp.zeros((2, 3))
  logp = jnp.array([[0.1, 0.6, -0.6], [0.5, -0.5, 9.0]])  # log ratios
  mask = jnp.array([[1, 1, 1], [1, 1, 0]])
  adv = jnp.array([1.0, -2.0])
  loss, m = gmpo(logp, old, adv, mask)
  # A > 0 clips log r from above at 0.4 only: (0.1, 0.4, -0.6). A < 0 from below: (0.5, -0.4).
  s0, s1 = np.exp((0.1 + 0.4 - 0.6) / 3), np.exp((0.5 - 0.4) / 2)
  np.testing.assert_allclose(loss, [[-s0] * 3, [2 * s1] * 3], rtol=1e-6)
  np.testing.assert_allclose(m["clipfrac_high"], 1 / 5)
  np.testing.assert_allclose(m["clipfrac_low"], 1 / 5)
  # Seq-mean-token-mean is the mean of -A_i s_i; each unclipped token's gradient is
  # -A_i s_i / |y_i| / N, clipped and masked tokens get none.
  agg = lambda lp: aggregate(gmpo(lp, old, adv, mask)[0], mask, "seq-mean-token-mean")
  np.testing.assert_allclose(agg(logp), (-s0 + 2 * s1) / 2, rtol=1e-6)
  g = jax.grad(agg)(logp)
  np.testing.assert_allclose(g, [[-s0 / 6, 0.0, -s0 / 6], [s1 / 2, 0.0, 0.0]], rtol=1e-6)


def test_gmpo_matches_authors_on_random_inputs():
  """callsys/GMPO@205b2bf train_zero_math_gmpo.py (and verl's geo_mean) per sequence:
  sgn = -1 if A >= 0 else 1; d = log r; c = sgn * max(sgn d, clamp(sgn d, -eps, eps));
  loss = -A exp(mean_t c), averaged over sequences. Values and finite-difference grads."""
  rng = np.random.default_rng(1)
  B, T = 3, 5
  logp = -np.abs(rng.normal(size=(B, T)))
  old = logp + 0.4 * rng.normal(size=(B, T))
  mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], bool)
  adv = np.array([0.7, -1.3, 0.0])

  def theirs(lp):
    losses = []
    for i in range(B):
      sgn = -1.0 if adv[i] >= 0 else 1.0
      d = (lp[i] - old[i])[mask[i]]
      c = sgn * np.maximum(sgn * d, np.clip(sgn * d, -0.4, 0.4))
      losses.append(-adv[i] * np.exp(c.mean()))
    return np.mean(losses)

  old32, mask32 = jnp.asarray(old, jnp.float32), jnp.asarray(mask)
  ours = lambda lp: aggregate(
    gmpo(lp, old32, jnp.asarray(adv, jnp.float32), mask32)[0], mask32, "seq-mean-token-mean"
  )
  lp32 = jnp.asarray(logp, jnp.float32)
  np.testing.assert_allclose(ours(lp32), theirs(logp), rtol=1e-5)
  h, expected = 1e-6, np.zeros((B, T))
  for i, t in np.ndindex(B, T):
    e = np.zeros((B, T))
    e[i, t] = h
    expected[i, t] = (theirs(logp + e) - theirs(logp - e)) / (2 * h)
  np.testing.assert_allclose(jax.grad(ours)(lp32), expected, rtol=1e-4, atol=1e-6)


def test_gspo_token_gradient_by_hand():
  """GSPO-token (Zheng et al., 2025, arXiv:2507.18071): with s_it = sg(s_i) pi_it / sg(pi_it),
  the gradient of J = (1/G) sum_i (1/|y_i|) sum_t s_it A_it, unclipped, is
  (1/G) sum_i s_i (1/|y_i|) sum_t A_it grad log pi_it."""
  old = jnp.zeros((2, 3))
  logp = jnp.array([[0.3, -0.1, 9.0], [0.01, 0.02, 0.0]])
  mask = jnp.array([[1, 1, 0], [1, 1, 1]])
  adv = jnp.array([[1.0, -0.5, 7.0], [-2.0, 0.5, 1.5]])  # per token
  s = np.array([np.exp(0.2 / 2), np.exp(0.03 / 3)])
  lengths = np.array([2.0, 3.0])

  def agg(lp, a, **clip):
    return aggregate(gspo(lp, old, a, mask, **clip)[0], mask, "seq-mean-token-mean")

  wide = {"clip_low": 0.9, "clip_high": 10.0}
  g = jax.grad(agg)(logp, adv, **wide)
  expected = -np.asarray(adv) * (s / lengths / 2)[:, None] * np.asarray(mask)
  np.testing.assert_allclose(g, expected, rtol=1e-6)
  # The paper's ranges: s_0 = 1.105 is clipped for its positive token only (PPO's min),
  # and s_1 = 1.01 for its positive tokens; negative-advantage tokens keep their gradient.
  g = jax.grad(agg)(logp, adv)
  keep = np.asarray(adv) < 0
  np.testing.assert_allclose(g, np.where(keep, expected, 0.0), rtol=1e-6)
  # Advantages equal along each row: GSPO-token is GSPO, in value and gradient.
  adv_B = jnp.array([1.0, -2.0])
  adv_BxT = jnp.broadcast_to(adv_B[:, None], (2, 3))
  np.testing.assert_allclose(agg(logp, adv_BxT, **wide), agg(logp, adv_B, **wide), rtol=1e-6)
  np.testing.assert_allclose(
    jax.grad(agg)(logp, adv_BxT), jax.grad(agg)(logp, adv_B), rtol=1e-6, atol=1e-9
  )
