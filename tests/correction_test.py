"""Mismatch corrections by hand: token and sequence TIS, MIS, IcePop and their metrics."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import core
from jaxrl_llm.core import correction


def _logs(rho, behav=0.5):
  """(old, behav) log-probs whose ratio pi_old / pi_behav is `rho`, with pi_behav = 0.5."""
  rho = jnp.asarray(rho, jnp.float32)
  behav_logp = jnp.full(rho.shape, math.log(behav))
  return behav_logp + jnp.log(rho), behav_logp


def test_token_tis_truncates_at_the_cap():
  old, behav = _logs([[3.0, 1.0, 0.5, 1.5]])
  w, m = core.token_tis(old, behav, jnp.ones((1, 4)), cap=2.0)
  np.testing.assert_allclose(w, [[2.0, 1.0, 0.5, 1.5]], rtol=1e-6)
  np.testing.assert_allclose(m["is_weight_mean"], 5.0 / 4, rtol=1e-6)
  np.testing.assert_allclose(m["is_weight_max"], 2.0, rtol=1e-6)
  np.testing.assert_allclose(m["is_masked_frac"], 0.0)
  k3 = np.mean([r - 1 - math.log(r) for r in (3.0, 1.0, 0.5, 1.5)])
  np.testing.assert_allclose(m["mismatch_k3"], k3, rtol=1e-5)


def test_sequence_tis_product_and_geometric_mean():
  # row 0: ratios 2 and 1.5 (product 3), row 1: 0.5 and 0.5 then padding
  old, behav = _logs([[2.0, 1.5, 1.0], [0.5, 0.5, 9.0]])
  mask = jnp.array([[1, 1, 1], [1, 1, 0]])
  w, _ = core.sequence_tis(old, behav, mask, cap=2.5, reduce="product")
  np.testing.assert_allclose(w, [[2.5, 2.5, 2.5], [0.25, 0.25, 0.0]], rtol=1e-6)
  w, _ = core.sequence_tis(old, behav, mask, cap=2.5, reduce="geometric")
  np.testing.assert_allclose(w, [[3 ** (1 / 3)] * 3, [0.5, 0.5, 0.0]], rtol=1e-6)


def test_token_mis_drops_tokens_outside_the_band_and_keeps_the_weight_inside():
  old, behav = _logs([[3.0, 1.0, 0.4, 1.5]])
  w, m = core.token_mis(old, behav, jnp.ones((1, 4)), cap=2.0)
  np.testing.assert_allclose(w, [[0.0, 1.0, 0.0, 1.5]], rtol=1e-6)
  np.testing.assert_allclose(m["is_masked_frac"], 0.5)


def test_sequence_mis_drops_whole_sequences():
  old, behav = _logs([[1.2, 1.1], [4.0, 2.0], [0.3, 1.0]])
  w, m = core.sequence_mis(old, behav, jnp.ones((3, 2)), cap=2.0, reduce="product")
  # products 1.32 (kept), 8 (dropped), 0.3 (dropped, below 1/2)
  np.testing.assert_allclose(w, [[1.32, 1.32], [0.0, 0.0], [0.0, 0.0]], rtol=1e-5)
  np.testing.assert_allclose(m["is_masked_frac"], 4 / 6, rtol=1e-6)
  # geometric means: sqrt(1.32) and sqrt(0.3) = 0.55 are kept, sqrt(8) = 2.83 is not
  w, _ = core.sequence_mis(old, behav, jnp.ones((3, 2)), cap=2.0)
  np.testing.assert_allclose(w[:, 0], [math.sqrt(1.32), 0.0, math.sqrt(0.3)], rtol=1e-5)


def test_icepop_band_is_half_to_five():
  old, behav = _logs([[6.0, 0.4, 0.6, 4.0, 5.0, 0.5]])
  w, m = core.icepop(old, behav, jnp.ones((1, 6)))
  np.testing.assert_allclose(w, [[0.0, 0.0, 0.6, 4.0, 5.0, 0.5]], rtol=1e-5)
  np.testing.assert_allclose(m["is_masked_frac"], 2 / 6, rtol=1e-6)


def test_none_weighs_one_but_still_measures_the_mismatch():
  old, behav = _logs([[2.0, 1.0]])
  w, m = core.CORRECTIONS["none"](old, behav, jnp.ones((1, 2)))
  np.testing.assert_allclose(w, 1.0)
  np.testing.assert_allclose(m["mismatch_k3"], (1 - math.log(2)) / 2, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(correction.CORRECTIONS))
def test_padding_gets_zero_weight_and_no_say_in_the_metrics(name):
  old, behav = _logs([[1.5, 1.0, 1.0]])
  padded_old = old.at[0, 2].set(jnp.nan)  # whatever padding holds never leaks
  padded_behav = behav.at[0, 2].set(-1e9)
  mask = jnp.array([[1, 1, 0]])
  w, m = correction.CORRECTIONS[name](padded_old, padded_behav, mask)
  w_short, m_short = correction.CORRECTIONS[name](old[:, :2], behav[:, :2], mask[:, :2])
  np.testing.assert_array_equal(w[0, 2], 0.0)
  np.testing.assert_allclose(w[:, :2], w_short, rtol=1e-6)
  for key in m_short:
    np.testing.assert_allclose(m[key], m_short[key], rtol=1e-6, err_msg=f"{name}: {key}")


@pytest.mark.parametrize("name", sorted(correction.CORRECTIONS))
def test_on_policy_every_correction_is_the_identity(name):
  logp = -jnp.abs(jax.random.normal(jax.random.key(0), (4, 5)))
  w, m = correction.CORRECTIONS[name](logp, logp, jnp.ones((4, 5)))
  np.testing.assert_allclose(w, 1.0, rtol=1e-6)
  np.testing.assert_allclose(m["mismatch_k3"], 0.0, atol=1e-7)
  np.testing.assert_allclose(m["is_masked_frac"], 0.0)


def test_weights_carry_no_gradient():
  old, behav = _logs([[1.5, 0.8]])
  grad = jax.grad(lambda o: jnp.sum(core.token_tis(o, behav, jnp.ones((1, 2)))[0]))(old)
  np.testing.assert_array_equal(grad, 0.0)


def test_staleness_metrics():
  m = core.staleness_metrics(jnp.array([3, 4, 5, 5]), 5, mask_B=jnp.array([1, 1, 1, 0]))
  np.testing.assert_allclose(m["staleness_mean"], 1.0)
  np.testing.assert_allclose(m["staleness_max"], 2.0)


def test_bad_bands_and_reductions_are_refused():
  old, behav = _logs([[1.0]])
  with pytest.raises(ValueError, match="cap must be > 1"):
    core.token_mis(old, behav, jnp.ones((1, 1)), cap=0.5)
  with pytest.raises(ValueError, match="the band must hold 1"):
    core.icepop(old, behav, jnp.ones((1, 1)), low=1.5, high=5.0)
  with pytest.raises(ValueError, match="reduce must be one of"):
    core.sequence_tis(old, behav, jnp.ones((1, 1)), reduce="mean")
  with pytest.raises(ValueError, match="Unknown mismatch correction 'tis'"):
    core.lookup(core.CORRECTIONS, "tis", "mismatch correction")


def _nucleus_bandit():
  """Two contexts of a one-token bandit, each with its own logits. Top-p 0.6 keeps the tokens
  before 60% of the mass: two in the first context (Z = 0.75 of the mass), one in the
  second (Z = 0.65). The rewards are 0 on the dropped tokens, so the sampled ones carry the
  whole gradient of E_pi[R]."""
  from jaxrl_llm.rollout.sampler import process_logits

  theta = jnp.log(jnp.array([[0.45, 0.3, 0.2, 0.05], [0.65, 0.2, 0.1, 0.05]]))
  rewards = jnp.array([[0.5, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
  behav = process_logits(theta, 1.0, top_p=0.6)  # -inf outside the nucleus
  return theta, rewards, behav


def _expected_gradient(theta, rewards, behav, correction_name):
  """E_{y ~ pi_behav}[grad of the corrected PPO loss], exactly: every (context, token) pair
  is a row, weighted by its sampling probability. The trainer's pi_old is pi itself."""
  q = jnp.exp(behav).reshape(-1, 1)
  behav_logp = jnp.where(q > 0, behav.reshape(-1, 1), 0.0)  # unsampled rows weigh 0 below

  def loss(theta):
    logp = jax.nn.log_softmax(theta, -1).reshape(-1, 1)
    old, ones = jax.lax.stop_gradient(logp), jnp.ones_like(logp)
    per_token, _ = core.ppo_clip(logp, old, rewards.reshape(-1, 1), ones)
    w, _ = core.CORRECTIONS[correction_name](old, behav_logp, ones)
    return jnp.sum(q * w * per_token)

  return jax.grad(loss)(theta)


def test_top_p_biases_the_uncorrected_gradient_and_token_tis_removes_it():
  theta, rewards, behav = _nucleus_bandit()
  np.testing.assert_array_equal(jnp.isfinite(behav), [[1, 1, 0, 0], [1, 0, 0, 0]])
  true = jax.grad(lambda t: -jnp.sum(jax.nn.softmax(t, -1) * rewards))(theta)  # -grad E_pi[R]
  corrected = _expected_gradient(theta, rewards, behav, "token_tis")
  uncorrected = _expected_gradient(theta, rewards, behav, "none")
  np.testing.assert_allclose(corrected, true, rtol=1e-5, atol=1e-7)
  # Without it each context's gradient is scaled by 1 / Z, its own nucleus mass: the
  # contexts are weighed wrongly against each other.
  np.testing.assert_allclose(uncorrected[0], true[0] / 0.75, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(uncorrected[1], true[1] / 0.65, rtol=1e-5, atol=1e-7)


def test_truncated_sampling_without_a_correction_is_advised_against(tmp_path):
  from helpers import small_config

  from jaxrl_llm.train.validate import advice

  note = " ".join(advice(small_config(tmp_path, **{"rollout.top_p": 0.9})))
  assert "config.rollout.top_p=0.9 samples from a truncated distribution" in note
  assert "config.algo.correction='token_tis'" in note
  fixed = small_config(tmp_path, **{"rollout.top_p": 0.9, "algo.correction": "token_tis"})
  assert not any("truncated" in n for n in advice(fixed))


def _last_metrics(summary):
  import json

  return json.loads(open(summary["metrics"]).read().splitlines()[-1])


def test_the_trainer_weighs_tokens_by_the_samplers_log_probs(tmp_path):
  """On-policy without truncation the sampler's log-probs are the trainer's (no mismatch);
  with top-p they are the nucleus's renormalised ones, so pi_old / pi_behav < 1."""
  from helpers import small_config

  from jaxrl_llm.train import train

  plain = _last_metrics(train(small_config(tmp_path / "plain", **{"algo.correction": "token_tis"})))
  assert plain["train/mismatch_k3"] < 1e-6
  np.testing.assert_allclose(plain["train/is_weight_mean"], 1.0, atol=1e-4)
  nucleus = small_config(
    tmp_path / "nucleus", **{"rollout.top_p": 0.7, "algo.correction": "token_tis"}
  )
  m = _last_metrics(train(nucleus))
  assert m["train/mismatch_k3"] > 1e-3
  assert m["train/is_weight_mean"] < 0.99
  assert m["train/is_weight_max"] <= 1.0 + 1e-5  # a nucleus never makes a token less likely


def test_corrected_policy_loss_weighs_the_registered_loss():
  logp = jnp.log(jnp.array([[0.5, 0.4, 0.3]]))
  behav = jnp.log(jnp.array([[0.25, 0.4, 0.6]]))  # rho = 2, 1, 0.5
  adv, mask = jnp.array([1.0]), jnp.ones((1, 3))
  loss, m = core.corrected_policy_loss(
    "ppo_clip", logp, logp, behav, adv, mask, correction="token_tis", correction_kwargs={"cap": 1.5}
  )
  np.testing.assert_allclose(loss, [[-1.5, -1.0, -0.5]], rtol=1e-6)  # -A r w at r = 1
  assert {"clipfrac_low", "ratio_mean", "mismatch_k3", "is_weight_max"} <= set(m)
  plain, _ = core.ppo_clip(logp, logp, adv, mask)
  same, _ = core.corrected_policy_loss(core.ppo_clip, logp, logp, logp, adv, mask)
  np.testing.assert_array_equal(same, plain)  # on-policy, no correction: the loss itself
