import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core import AGGREGATION_MODES, aggregate, aggregate_denominator

MODES = sorted(AGGREGATION_MODES)
LOSS = jnp.array([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]])
MASK = jnp.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]])


@pytest.mark.parametrize(
  "mode,expected",
  [
    ("token-mean", (1 + 2 + 5 + 6 + 7 + 8) / 6),
    ("seq-mean-token-mean", ((1 + 2) / 2 + (5 + 6 + 7 + 8) / 4) / 2),
    ("seq-mean-token-sum", ((1 + 2) + (5 + 6 + 7 + 8)) / 2),
    ("seq-mean-token-sum-norm", ((1 + 2) + (5 + 6 + 7 + 8)) / 2 / 4),
  ],
)
def test_aggregate_by_hand(mode, expected):
  np.testing.assert_allclose(aggregate(LOSS, MASK, mode), expected, rtol=1e-6)


def test_dr_grpo_constant_normaliser():
  np.testing.assert_allclose(
    aggregate(LOSS, MASK, "seq-mean-token-sum-norm", max_len=10), 29 / 2 / 10, rtol=1e-6
  )


def test_masked_nan_is_ignored():
  loss = LOSS.at[2, :].set(jnp.nan).at[0, 3].set(jnp.inf)
  for mode in MODES:
    assert np.isfinite(aggregate(loss, MASK, mode)), mode
    g = jax.grad(aggregate)(loss, MASK, mode)
    assert np.all(np.isfinite(g)), mode


def test_errors():
  with pytest.raises(ValueError, match="Unknown aggregation mode 'mean'.*token-mean"):
    aggregate(LOSS, MASK, "mean")
  with pytest.raises(ValueError, match="one shape"):
    aggregate(LOSS, MASK[:, :2], "token-mean")


# Invariance: one global batch, whole vs micro-batches vs devices.

B, T, F, NUM_DEVICES, NUM_MICRO = 32, 10, 3, 8, 4


def _problem(seed=0):
  k1, k2, k3, k4 = jax.random.split(jax.random.key(seed), 4)
  features = jax.random.normal(k1, (B, T, F))
  theta = jax.random.normal(k2, (F,))
  mask = jax.random.bernoulli(k3, 0.6, (B, T))
  # Uneven padding: the first rows are long, the last ones short, two are empty.
  lengths = jnp.linspace(T, 0, B).astype(jnp.int32)
  mask = mask & (jnp.arange(T)[None, :] < lengths[:, None])
  adv = jax.random.normal(k4, (B,))
  return theta, features, mask, adv


def _per_token_loss(theta, features_BxTxF, adv_B):
  """A policy-gradient-shaped loss that depends on theta through every token."""
  logits_BxT = jnp.tanh(features_BxTxF @ theta)
  return -adv_B[:, None] * jax.nn.log_sigmoid(logits_BxT) + 0.1 * logits_BxT**2


def _loss(theta, features, mask, adv, mode, **kwargs):
  return aggregate(_per_token_loss(theta, features, adv), mask, mode, **kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_equal_whole_batch(mode):
  theta, features, mask, adv = _problem()
  loss, grad = jax.value_and_grad(_loss)(theta, features, mask, adv, mode)
  denominator = aggregate_denominator(mask, mode)
  split = lambda x: jnp.split(x, NUM_MICRO)
  acc_loss, acc_grad = 0.0, jnp.zeros_like(theta)
  for f_k, m_k, a_k in zip(split(features), split(mask), split(adv), strict=True):
    l_k, g_k = jax.value_and_grad(_loss)(theta, f_k, m_k, a_k, mode, global_denominator=denominator)
    acc_loss, acc_grad = acc_loss + l_k, acc_grad + g_k
  np.testing.assert_allclose(acc_loss, loss, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(acc_grad, grad, rtol=1e-6, atol=1e-6)
  # The naive mean of per-micro-batch means differs (that is the bug this prevents).
  naive = (
    sum(
      _loss(theta, f, m, a, mode)
      for f, m, a in zip(split(features), split(mask), split(adv), strict=True)
    )
    / NUM_MICRO
  )
  assert abs(float(naive) - float(loss)) > 1e-4


@pytest.mark.parametrize("mode", MODES)
def test_shard_map_over_8_devices_equals_whole_batch(mode, data_mesh):
  theta, features, mask, adv = _problem(seed=1)
  loss, grad = jax.value_and_grad(_loss)(theta, features, mask, adv, mode)
  mesh = data_mesh.mesh

  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")), out_specs=(P(), P())
  )
  def sharded_value_and_grad(theta, f, m, a):
    share, g = jax.value_and_grad(_loss)(theta, f, m, a, mode, axis_name="data")
    return jax.lax.psum(share, "data"), g

  s_loss, s_grad = jax.jit(sharded_value_and_grad)(
    data_mesh.replicate(theta), *data_mesh.shard((features, mask, adv))
  )
  np.testing.assert_allclose(s_loss, loss, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(s_grad, grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_global_view_grad_through_shard_map_equals_whole_batch(mode, data_mesh):
  theta, features, mask, adv = _problem(seed=2)
  loss, grad = jax.value_and_grad(_loss)(theta, features, mask, adv, mode)
  mesh = data_mesh.mesh

  @functools.partial(
    jax.shard_map, mesh=mesh, in_specs=(P(), P("data"), P("data"), P("data")), out_specs=P()
  )
  def sharded_loss(theta, f, m, a):
    return jax.lax.psum(_loss(theta, f, m, a, mode, axis_name="data"), "data")

  s_loss, s_grad = jax.jit(jax.value_and_grad(sharded_loss))(
    data_mesh.replicate(theta), *data_mesh.shard((features, mask, adv))
  )
  np.testing.assert_allclose(s_loss, loss, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(s_grad, grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_pmap_over_8_devices_equals_whole_batch(mode):
  theta, features, mask, adv = _problem(seed=3)
  loss, grad = jax.value_and_grad(_loss)(theta, features, mask, adv, mode)
  shard = lambda x: x.reshape(NUM_DEVICES, -1, *x.shape[1:])

  def per_device(theta, f, m, a):
    share, g = jax.value_and_grad(_loss)(theta, f, m, a, mode, axis_name="data")
    return jax.lax.psum(share, "data"), jax.lax.psum(g, "data")

  p_loss, p_grad = jax.pmap(per_device, axis_name="data", in_axes=(None, 0, 0, 0))(
    theta, shard(features), shard(mask), shard(adv)
  )
  np.testing.assert_allclose(p_loss[0], loss, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(p_grad[0], grad, rtol=1e-6, atol=1e-6)
