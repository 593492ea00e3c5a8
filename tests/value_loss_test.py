import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.core import clipped_value_loss


def test_clipped_value_loss_by_hand():
  old = jnp.array([[0.0, 0.0, 0.0]])
  v = jnp.array([[0.5, 0.1, -0.5]])
  ret = jnp.array([[1.0, 1.0, 1.0]])
  mask = jnp.ones((1, 3))
  loss, m = clipped_value_loss(v, old, ret, mask, cliprange_value=0.2)
  # token 0: unclipped (0.5 - 1)^2 = 0.25, clipped (0.2 - 1)^2 = 0.64 -> max 0.64
  # token 1: inside the range, both 0.81
  # token 2: unclipped 2.25, clipped (-0.2 - 1)^2 = 1.44 -> 2.25
  np.testing.assert_allclose(loss, 0.5 * np.array([[0.64, 0.81, 2.25]]), rtol=1e-6)
  np.testing.assert_allclose(m["vf_clipfrac"], 1 / 3, rtol=1e-6)
  g = jax.grad(lambda x: clipped_value_loss(x, old, ret, mask, cliprange_value=0.2)[0].sum())(v)
  np.testing.assert_allclose(g, [[0.0, 0.1 - 1.0, -1.5]], rtol=1e-6)


def test_unclipped_value_loss():
  v, ret = jnp.array([[2.0]]), jnp.array([[0.0]])
  loss, m = clipped_value_loss(v, jnp.zeros((1, 1)), ret, jnp.ones((1, 1)), cliprange_value=None)
  np.testing.assert_allclose(loss, [[2.0]])
  np.testing.assert_allclose(m["vf_clipfrac"], 0.0)


def test_the_value_clip_fraction_counts_only_clipped_tokens():
  """V_old + clip(V - V_old, +-eps) can round away from V on unclipped tokens; the clip
  fraction must equal the exact count (float64) of tokens whose clipped term is larger, and
  an unclipped token's loss is exactly its plain squared error."""
  rng = np.random.default_rng(0)
  shape, eps = (64, 128), 0.2
  old = rng.normal(size=shape) * 0.1  # values near 0, where V - V_old rounds
  v = (old + rng.uniform(-0.3, 0.3, size=shape)).astype(np.float32)
  old, ret = old.astype(np.float32), (rng.normal(size=shape) * 3.0).astype(np.float32)
  loss, m = clipped_value_loss(v, old, ret, np.ones(shape), cliprange_value=eps)
  v64, old64, ret64 = (x.astype(np.float64) for x in (v, old, ret))
  v_clip64 = np.clip(v64, old64 - eps, old64 + eps)
  exact = np.mean((v_clip64 - ret64) ** 2 > (v64 - ret64) ** 2)
  assert float(m["vf_clipfrac"]) == np.float32(exact), (float(m["vf_clipfrac"]), exact)
  inside = np.abs(v64 - old64) <= eps
  plain = 0.5 * np.square(v - ret)
  np.testing.assert_array_equal(np.asarray(loss)[inside], plain[inside])
