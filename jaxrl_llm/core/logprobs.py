"""Per-token log-probabilities and entropies of categorical policies.

All results are float32, even from bfloat16 logits: the log-ratio
`log pi - log pi_old` of two nearly equal policies is a small difference of
large numbers, and bf16's 8 mantissa bits would swamp it.
"""

import jax
import jax.numpy as jnp


def _check_temperature(temperature) -> None:
  if isinstance(temperature, int | float) and temperature <= 0:
    raise ValueError(
      f"temperature must be > 0 for log-probs, got {temperature}. Greedy decoding "
      "(temperature 0) is a point mass; score it with temperature=1.0."
    )


def _check_shapes(logits, tokens) -> None:
  if logits.shape[:-1] != tokens.shape:
    raise ValueError(f"logits {logits.shape} must be tokens {tokens.shape} plus a vocab axis.")


def token_logprobs(logits_BxTxV, tokens_BxT, temperature=1.0):
  """Log-probability of each token under softmax(logits / temperature).

    log pi(y_t) = z_t[y_t] - logsumexp_v z_t[v],   z_t = logits_t / temperature

  Args:
    logits_BxTxV: logits at the positions that predict `tokens_BxT` (i.e. already
      shifted by one against the input sequence). Any float dtype.
    tokens_BxT: integer token ids.
    temperature: sampling temperature (> 0). Scoring with the temperature used at
      sampling time makes the trainer's log-probs match the sampler's.

  Returns:
    float32 `[B, T]` log-probs.
  """
  _check_shapes(logits_BxTxV, tokens_BxT)
  _check_temperature(temperature)
  z_BxTxV = logits_BxTxV.astype(jnp.float32) / temperature
  z_BxT = jnp.take_along_axis(z_BxTxV, tokens_BxT[..., None], axis=-1)[..., 0]
  return z_BxT - jax.nn.logsumexp(z_BxTxV, axis=-1)


def entropy(logits_BxTxV, temperature=1.0):
  """Entropy of softmax(logits / temperature) at each position, in nats.

    H_t = -sum_v p_t(v) log p_t(v) = logsumexp(z_t) - sum_v p_t(v) z_t(v)

  Returns float32 with the logits' shape minus the vocab axis.
  """
  _check_temperature(temperature)
  z = logits_BxTxV.astype(jnp.float32) / temperature
  logp = jax.nn.log_softmax(z, axis=-1)
  return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


def chunked_token_logprobs(
  logits_BxTxV, tokens_BxT, temperature=1.0, *, chunk_size=128, with_entropy=False
):
  """`token_logprobs` (and optionally `entropy`) computed `chunk_size` positions at a time.

  Gives the same values and gradients as the unchunked functions, and never makes a
  float32 `[B, T, V]` array of bfloat16 logits: each scan step upcasts only a
  `[chunk_size, V]` slice of the flattened `[B*T, V]` logits, and the step is
  rematerialised (`jax.checkpoint`) so the backward pass does not stack the per-chunk
  float32 softmax either. It does not lower peak memory, though: the logits themselves
  are `[B, T, V]`, and the backward stacks their gradient and a padded copy of them in
  the logits' dtype (`experiments/benchmarks/bench_core.py` measures it). Log-probs
  that never see `[B, T, V]` at all have to start from the hidden states.

  Returns:
    `logp_BxT`, or `(logp_BxT, entropy_BxT)` when `with_entropy`.
  """
  _check_shapes(logits_BxTxV, tokens_BxT)
  _check_temperature(temperature)
  batch_shape, vocab = tokens_BxT.shape, logits_BxTxV.shape[-1]
  n = tokens_BxT.size
  num_chunks = -(-n // chunk_size)
  pad = num_chunks * chunk_size - n
  logits_CxKxV = jnp.pad(logits_BxTxV.reshape(n, vocab), ((0, pad), (0, 0))).reshape(
    num_chunks, chunk_size, vocab
  )
  tokens_CxK = jnp.pad(tokens_BxT.reshape(n), (0, pad)).reshape(num_chunks, chunk_size)

  @jax.checkpoint
  def chunk(xs):
    z_KxV, tokens_K = xs
    logp_K = token_logprobs(z_KxV, tokens_K, temperature)
    return (logp_K, entropy(z_KxV, temperature)) if with_entropy else logp_K

  out = jax.lax.map(chunk, (logits_CxKxV, tokens_CxK))
  unchunk = lambda x_CxK: x_CxK.reshape(-1)[:n].reshape(batch_shape)
  return jax.tree.map(unchunk, out)
