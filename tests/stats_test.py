import jax.numpy as jnp
import numpy as np

from jaxrl_llm.core import masked_max, masked_mean, masked_min, masked_sum, masked_var

X = jnp.array([[1.0, 2.0, jnp.nan], [3.0, 6.0, 100.0]])
M = jnp.array([[1, 1, 0], [1, 1, 0]], bool)


def test_masked_stats_by_hand():
  np.testing.assert_allclose(masked_sum(X, M), 12.0)
  np.testing.assert_allclose(masked_mean(X, M), 3.0)
  np.testing.assert_allclose(masked_var(X, M, unbiased=False), (4 + 1 + 0 + 9) / 4)
  np.testing.assert_allclose(masked_var(X, M), (4 + 1 + 0 + 9) / 3)
  np.testing.assert_allclose(masked_max(X, M), 6.0)
  np.testing.assert_allclose(masked_min(X, M), 1.0)


def test_empty_mask_mean_is_zero():
  np.testing.assert_allclose(masked_mean(X, jnp.zeros_like(M)), 0.0)
