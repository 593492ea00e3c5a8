import math

import chex
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm.core import entropy, hidden_token_logprobs, token_logprobs


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


def _hidden_case(B=3, T=13, D=8, V=50, seed=0, dtype=jnp.float32):
  ks = jax.random.split(jax.random.key(seed), 5)
  hidden = jax.random.normal(ks[0], (B, T, D)).astype(dtype)
  w = jax.random.normal(ks[1], (D, V)).astype(dtype)
  tokens = jax.random.randint(ks[2], (B, T), 0, V)
  weights = jax.random.normal(ks[3], (2, B, T))  # a cotangent for log-probs and entropies
  return hidden, w, tokens, weights


def _full_logit_path(hidden, w, tokens, temperature):
  logits = jnp.einsum("btd,dv->btv", hidden, w, preferred_element_type=jnp.float32)
  return token_logprobs(logits, tokens, temperature), entropy(logits, temperature)


@pytest.mark.parametrize("chunk_size", [1, 4, 13, 64])
def test_hidden_logprobs_equal_the_full_logit_path(chunk_size):
  hidden, w, tokens, weights = _hidden_case()

  def objective(fn):
    return lambda h, w: sum(jnp.sum(x * c) for x, c in zip(fn(h, w), weights, strict=True))

  full = lambda h, w: _full_logit_path(h, w, tokens, 0.7)
  chunked = lambda h, w: hidden_token_logprobs(
    h, w, tokens, 0.7, chunk_size=chunk_size, with_entropy=True
  )
  for got, want in zip(jax.jit(chunked)(hidden, w), full(hidden, w), strict=True):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  got = jax.jit(jax.grad(objective(chunked), argnums=(0, 1)))(hidden, w)
  want = jax.grad(objective(full), argnums=(0, 1))(hidden, w)
  for g, e in zip(got, want, strict=True):
    np.testing.assert_allclose(g, e, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(e))))
  # Log-probs alone (no entropy term in the backward pass).
  only = lambda h: jnp.sum(hidden_token_logprobs(h, w, tokens, chunk_size=chunk_size) * weights[0])
  only_full = lambda h: jnp.sum(_full_logit_path(h, w, tokens, 1.0)[0] * weights[0])
  np.testing.assert_allclose(jax.grad(only)(hidden), jax.grad(only_full)(hidden), atol=1e-5)


def test_hidden_logprobs_in_bf16_match_the_full_path_and_stay_fp32():
  hidden, w, tokens, weights = _hidden_case(dtype=jnp.bfloat16)
  logp, ent = hidden_token_logprobs(hidden, w, tokens, chunk_size=4, with_entropy=True)
  chex.assert_type([logp, ent], jnp.float32)
  want = _full_logit_path(hidden, w, tokens, 1.0)
  np.testing.assert_allclose(logp, want[0], rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(ent, want[1], rtol=1e-5, atol=1e-4)
  loss = lambda fn: lambda h, w: jnp.sum(fn(h, w)[0] * weights[0])
  got = jax.grad(
    loss(lambda h, w: hidden_token_logprobs(h, w, tokens, chunk_size=4, with_entropy=True)),
    argnums=(0, 1),
  )(hidden, w)
  want = jax.grad(loss(lambda h, w: _full_logit_path(h, w, tokens, 1.0)), argnums=(0, 1))(hidden, w)
  for g, e in zip(got, want, strict=True):
    assert g.dtype == jnp.bfloat16
    scale = float(jnp.max(jnp.abs(e.astype(jnp.float32))))
    np.testing.assert_allclose(g.astype(jnp.float32), e.astype(jnp.float32), atol=2e-2 * scale)


def _arrays_of_shape(jaxpr, shape):
  """The primitives that make a value of `shape` (any dtype) in a closed jaxpr, sub-jaxprs
  included."""
  found = []

  def visit(jp):
    for eqn in jp.eqns:
      for var in eqn.outvars:
        aval = var.aval
        if getattr(aval, "shape", None) == shape:
          found.append(eqn.primitive.name)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jaxpr.jaxpr)
  return found


def test_hidden_logprobs_never_hold_BxTxV():
  B, T, D, V = 2, 64, 8, 50
  hidden = jnp.zeros((B, T, D), jnp.bfloat16)
  w = jnp.zeros((D, V), jnp.bfloat16)
  tokens = jnp.zeros((B, T), jnp.int32)

  def loss(h, w):
    logp, ent = hidden_token_logprobs(h, w, tokens, chunk_size=16, with_entropy=True)
    return jnp.sum(logp) + jnp.sum(ent)

  for fn in (loss, jax.grad(loss, argnums=(0, 1))):
    jaxpr = jax.make_jaxpr(fn)(hidden, w)
    for shape in [(B, T, V), (B * T, V), (T // 16, B, 16, V)]:
      assert not _arrays_of_shape(jaxpr, shape), shape
    assert _arrays_of_shape(jaxpr, (B, 16, V))  # one chunk at a time
  # The check itself can fail: the full-logit path does hold one.
  plain = jax.make_jaxpr(lambda h, w: jnp.sum(_full_logit_path(h, w, tokens, 1.0)[0]))(hidden, w)
  assert _arrays_of_shape(plain, (B, T, V))


def test_bad_inputs_raise():
  logits, tokens = _random_logits()
  with pytest.raises(ValueError, match="temperature"):
    token_logprobs(logits, tokens, temperature=0.0)
  with pytest.raises(ValueError, match="vocab axis"):
    token_logprobs(logits, tokens[:, :-1])
  hidden, w, tokens, _ = _hidden_case()
  with pytest.raises(ValueError, match="hidden axis"):
    hidden_token_logprobs(hidden, w, tokens[:, :-1])
  with pytest.raises(ValueError, match=r"\[D, V\]"):
    hidden_token_logprobs(hidden, w.T, tokens)
  with pytest.raises(ValueError, match="chunk_size"):
    hidden_token_logprobs(hidden, w, tokens, chunk_size=0)
