"""The reward model's Bradley-Terry loss and the running normaliser of its scores."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxrl_llm.core import bradley_terry_loss, running_moments_init, running_moments_update


def _reference(c, r, m, mask, center):
  """float64 numpy: the loss and its gradient in the chosen and rejected scores."""
  c, r, m = (np.asarray(x, np.float64) for x in (c, r, m))
  n = mask.sum()
  z = c - r - m
  loss = np.sum(np.logaddexp(0.0, -z) * mask) / n + center * np.sum((c + r) ** 2 * mask) / n
  sig = 1.0 / (1.0 + np.exp(z))  # d/dz of -log sigmoid(z) is -sigmoid(-z)
  grad_c = (-sig + 2 * center * (c + r)) * mask / n
  grad_r = (sig + 2 * center * (c + r)) * mask / n
  return loss, grad_c, grad_r


def test_bradley_terry_loss_and_gradient_equal_a_numpy_reference():
  rng = np.random.default_rng(0)
  c, r = rng.normal(size=(2, 32)).astype(np.float32) * 3
  m = rng.uniform(0, 1, 32).astype(np.float32)
  mask = rng.uniform(size=32) < 0.8
  for center in (0.0, 0.01):
    fn = lambda c, r, center=center: bradley_terry_loss(
      c, r, margin_B=m, center_coef=center, mask_B=mask
    )[0]
    loss, (gc, gr) = jax.value_and_grad(fn, argnums=(0, 1))(jnp.asarray(c), jnp.asarray(r))
    want, want_c, want_r = _reference(c, r, m, mask, center)
    np.testing.assert_allclose(loss, want, rtol=1e-6)
    np.testing.assert_allclose(gc, want_c, rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(gr, want_r, rtol=1e-5, atol=1e-8)


def test_bradley_terry_metrics_by_hand():
  c, r = jnp.array([2.0, 0.0, 1.0, 5.0]), jnp.array([1.0, 3.0, 1.0, 0.0])
  loss, metrics = bradley_terry_loss(c, r, mask_B=jnp.array([1, 1, 1, 0]))
  np.testing.assert_allclose(metrics["accuracy"], (1 + 0 + 0.5) / 3)  # a tie counts half
  np.testing.assert_allclose(metrics["margin"], (1 - 3 + 0) / 3, rtol=1e-6)
  np.testing.assert_allclose(metrics["chosen"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(loss, np.mean(np.logaddexp(0, -np.array([1.0, -3.0, 0.0]))), 1e-6)


def test_bradley_terry_loss_is_the_same_on_a_split_batch(data_mesh):
  """Under shard_map over 8 devices with axis_name, the loss is the unsplit batch's."""
  rng = np.random.default_rng(1)
  c, r = rng.normal(size=(2, 16)).astype(np.float32)
  mask = np.arange(16) < 13  # padding pairs spread unevenly over the shards
  whole = bradley_terry_loss(c, r, center_coef=0.1, mask_B=mask)[0]
  spec = P("data")

  @functools.partial(jax.shard_map, mesh=data_mesh.mesh, in_specs=(spec, spec, spec), out_specs=P())
  def split(c, r, mask):
    return bradley_terry_loss(c, r, center_coef=0.1, mask_B=mask, axis_name="data")[0]

  got = jax.jit(split)(*data_mesh.shard((c, r, mask)))
  np.testing.assert_allclose(got, whole, rtol=1e-6)


def test_running_moments_equal_numpy_over_uneven_batches():
  rng = np.random.default_rng(2)
  batches = [rng.normal(3.0, 2.0, size=n).astype(np.float32) for n in (1, 7, 16, 5)]
  state = running_moments_init()
  seen = []
  for x in batches:
    state, normalised = running_moments_update(state, jnp.asarray(x))
    seen.extend(x.tolist())
    mean, std = np.mean(seen), np.std(seen, ddof=1) if len(seen) > 1 else 1.0
    np.testing.assert_allclose(state.count, len(seen))
    np.testing.assert_allclose(state.mean, mean, rtol=1e-5)
    np.testing.assert_allclose(normalised, (x - mean) / std, rtol=1e-4, atol=1e-5)


def test_running_moments_skip_masked_entries_and_jit():
  x, mask = jnp.array([1.0, 100.0, 3.0]), jnp.array([True, False, True])
  state, normalised = jax.jit(running_moments_update)(running_moments_init(), x, mask)
  np.testing.assert_allclose([state.count, state.mean], [2.0, 2.0])
  np.testing.assert_allclose(normalised, [-1 / np.sqrt(2), 0.0, 1 / np.sqrt(2)], rtol=1e-6)
