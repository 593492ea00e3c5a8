import math

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.core import chunked_token_logprobs, entropy, token_logprobs


def _random_logits(B=3, T=5, V=11, seed=0, scale=3.0):
  k1, k2 = jax.random.split(jax.random.key(seed))
  logits = scale * jax.random.normal(k1, (B, T, V))
  tokens = jax.random.randint(k2, (B, T), 0, V)
  return logits, tokens


def test_token_logprobs_by_hand():
  logits = jnp.array([[[0.0, math.log(3.0)], [2.0, 2.0]]])  # [1, 2, 2]
  tokens = jnp.array([[1, 0]])
  np.testing.assert_allclose(
    token_logprobs(logits, tokens), [[math.log(0.75), math.log(0.5)]], rtol=1e-6
  )
  # temperature 2 on logits (0, ln 3): softmax of (0, ln 3 / 2) = (1, sqrt 3) / (1 + sqrt 3).
  expected = math.log(math.sqrt(3) / (1 + math.sqrt(3)))
  np.testing.assert_allclose(
    token_logprobs(logits, tokens, temperature=2.0)[0, 0], expected, rtol=1e-6
  )


def test_entropy_by_hand():
  logits = jnp.array([[[0.0, 0.0, 0.0, 0.0], [0.0, -1e9, -1e9, -1e9]]])
  np.testing.assert_allclose(entropy(logits), [[math.log(4.0), 0.0]], atol=1e-6)


def test_bf16_logits_give_fp32_results():
  logits, tokens = _random_logits()
  logits_bf16 = logits.astype(jnp.bfloat16)
  logp = token_logprobs(logits_bf16, tokens)
  chex.assert_type(logp, jnp.float32)
  chex.assert_type(entropy(logits_bf16), jnp.float32)
  # Equal to the fp32 computation on the (exactly representable) upcast logits.
  np.testing.assert_allclose(
    logp, token_logprobs(logits_bf16.astype(jnp.float32), tokens), rtol=0, atol=0
  )


def test_logprobs_match_numpy():
  logits, tokens = _random_logits()
  x = np.asarray(logits, np.float64) / 0.7
  logp_np = x - np.log(np.exp(x).sum(-1, keepdims=True))
  expected = np.take_along_axis(logp_np, np.asarray(tokens)[..., None], -1)[..., 0]
  np.testing.assert_allclose(token_logprobs(logits, tokens, 0.7), expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    entropy(logits, 0.7), -(np.exp(logp_np) * logp_np).sum(-1), rtol=1e-5, atol=1e-6
  )


@pytest.mark.parametrize("chunk_size", [1, 4, 15, 64])
def test_chunked_equals_unchunked_values_and_grads(chunk_size):
  logits, tokens = _random_logits(B=3, T=5, V=11)
  logp, ent = chunked_token_logprobs(logits, tokens, 0.9, chunk_size=chunk_size, with_entropy=True)
  np.testing.assert_allclose(logp, token_logprobs(logits, tokens, 0.9), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(ent, entropy(logits, 0.9), rtol=1e-6, atol=1e-6)

  def objective(fn):
    return lambda z: jnp.sum(fn(z) * jnp.arange(15.0).reshape(3, 5))

  g_chunked = jax.grad(
    objective(lambda z: chunked_token_logprobs(z, tokens, chunk_size=chunk_size))
  )(logits)
  g_plain = jax.grad(objective(lambda z: token_logprobs(z, tokens)))(logits)
  np.testing.assert_allclose(g_chunked, g_plain, rtol=1e-5, atol=1e-6)


def _f32_arrays_of_shape(jaxpr, shape):
  """All float32 values of `shape` anywhere in a closed jaxpr, sub-jaxprs included."""
  found = []

  def visit(jp):
    for eqn in jp.eqns:
      for var in eqn.outvars:
        aval = var.aval
        if getattr(aval, "shape", None) == shape and aval.dtype == jnp.float32:
          found.append(eqn.primitive.name)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jaxpr.jaxpr)
  return found


def test_chunked_never_holds_fp32_BxTxV():
  B, T, V = 2, 64, 50
  logits = jnp.zeros((B, T, V), jnp.bfloat16)
  tokens = jnp.zeros((B, T), jnp.int32)

  def loss(z):
    return jnp.sum(chunked_token_logprobs(z, tokens, chunk_size=16, with_entropy=True)[0])

  for fn in (loss, jax.grad(loss)):
    jaxpr = jax.make_jaxpr(fn)(logits)
    for shape in [(B, T, V), (B * T, V)]:
      assert not _f32_arrays_of_shape(jaxpr, shape), shape
  # The check itself can fail: the unchunked function does hold one.
  plain = jax.make_jaxpr(lambda z: jnp.sum(token_logprobs(z, tokens)))(logits)
  assert _f32_arrays_of_shape(plain, (B, T, V))


def test_bad_inputs_raise():
  logits, tokens = _random_logits()
  with pytest.raises(ValueError, match="temperature"):
    token_logprobs(logits, tokens, temperature=0.0)
  with pytest.raises(ValueError, match="vocab axis"):
    token_logprobs(logits, tokens[:, :-1])
