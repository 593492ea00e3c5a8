"""Per-token log-probabilities and entropies of categorical policies.

All results are float32, even from bfloat16 logits: the log-ratio
`log pi - log pi_old` of two nearly equal policies is a small difference of
large numbers, and bf16's 8 mantissa bits would swamp it.
"""

import functools

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


def hidden_token_logprobs(
  hidden_BxTxD, unembedding_DxV, tokens_BxT, temperature=1.0, *, chunk_size=64, with_entropy=False
):
  """`token_logprobs` (and optionally `entropy`) of `logits = hidden @ unembedding`, without
  ever making the `[B, T, V]` logits.

  The sequence is cut into chunks of `chunk_size` positions; a scan runs over them, and
  each step forms only the `[B, chunk_size, V]` float32 logits of its chunk:

    z = h_c W / temperature,  log p = z - logsumexp(z),  log pi(y) = log p[y],
    H = -sum_v p(v) log p(v).

  The backward pass (a `jax.custom_vjp`) is chunked the same way. It keeps `lse` and `H`
  from the forward pass and recomputes each chunk's logits once, then uses

    d log pi(y) / dz = onehot(y) - p,    dH / dz = -p (z - E_p[z]) = -p (log p + H),

  so its peak is also one chunk's `[B, chunk_size, V]`. The weight's gradient is summed
  over chunks in float32 whatever the compute dtype, as one full matmul would. Chunks run
  along the sequence, so rows sharded over devices stay where they are.

  Args:
    hidden_BxTxD: final hidden states at the positions that predict `tokens_BxT`.
    unembedding_DxV: the output projection (the transposed embedding when tied).
    tokens_BxT: integer token ids.
    temperature: a Python float > 0 (see `token_logprobs`).
    chunk_size: positions per chunk; `T` is padded up to a multiple of it.
    with_entropy: also return the entropy at each position.

  Returns:
    float32 `logp_BxT`, or `(logp_BxT, entropy_BxT)` when `with_entropy`.
  """
  if hidden_BxTxD.shape[:-1] != tokens_BxT.shape or hidden_BxTxD.ndim != 3:
    raise ValueError(
      f"hidden {hidden_BxTxD.shape} must be tokens {tokens_BxT.shape} plus a hidden axis."
    )
  if unembedding_DxV.shape[0] != hidden_BxTxD.shape[-1]:
    raise ValueError(
      f"unembedding {unembedding_DxV.shape} must be [D, V] with D = {hidden_BxTxD.shape[-1]}."
    )
  if chunk_size <= 0:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
  _check_temperature(temperature)
  T = tokens_BxT.shape[1]
  chunk = min(chunk_size, T)
  pad = -T % chunk
  hidden = jnp.pad(hidden_BxTxD, ((0, 0), (0, pad), (0, 0)))
  tokens = jnp.pad(tokens_BxT, ((0, 0), (0, pad)))
  logp, ent = _chunked_logprobs(hidden, unembedding_DxV, tokens, float(temperature), chunk)
  logp, ent = logp[:, :T], ent[:, :T]
  return (logp, ent) if with_entropy else logp


def _chunk_logits(hidden_BxCxD, w_DxV, temperature):
  z = jnp.einsum("bcd,dv->bcv", hidden_BxCxD, w_DxV, preferred_element_type=jnp.float32)
  return z / temperature


def _chunks(x_BxTx, chunk):
  """`[B, T, ...]` to `[T / chunk, B, chunk, ...]`, the scan's leading axis."""
  B, T = x_BxTx.shape[:2]
  return jnp.moveaxis(x_BxTx.reshape(B, T // chunk, chunk, *x_BxTx.shape[2:]), 1, 0)


def _unchunk(x_CxBxKx):
  x = jnp.moveaxis(x_CxBxKx, 0, 1)
  return x.reshape(x.shape[0], -1, *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _chunked_logprobs(hidden_BxTxD, w_DxV, tokens_BxT, temperature, chunk):
  return _chunked_forward(hidden_BxTxD, w_DxV, tokens_BxT, temperature, chunk)[:2]


def _chunked_forward(hidden_BxTxD, w_DxV, tokens_BxT, temperature, chunk):
  def step(_, xs):
    h_BxCxD, y_BxC = xs
    z = _chunk_logits(h_BxCxD, w_DxV, temperature)
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = jnp.take_along_axis(z, y_BxC[..., None], axis=-1)[..., 0] - lse
    logp_BxCxV = z - lse[..., None]
    ent = -jnp.sum(jnp.exp(logp_BxCxV) * logp_BxCxV, axis=-1)
    return None, (logp, ent, lse)

  xs = (_chunks(hidden_BxTxD, chunk), _chunks(tokens_BxT, chunk))
  _, out = jax.lax.scan(step, None, xs)
  return tuple(_unchunk(x) for x in out)


def _chunked_fwd(hidden_BxTxD, w_DxV, tokens_BxT, temperature, chunk):
  logp, ent, lse = _chunked_forward(hidden_BxTxD, w_DxV, tokens_BxT, temperature, chunk)
  return (logp, ent), (hidden_BxTxD, w_DxV, tokens_BxT, lse, ent)


def _chunked_bwd(temperature, chunk, res, cotangents):
  hidden_BxTxD, w_DxV, tokens_BxT, lse_BxT, ent_BxT = res
  g_logp_BxT, g_ent_BxT = cotangents
  dt = hidden_BxTxD.dtype

  def step(dw_DxV, xs):
    h_BxCxD, y_BxC, lse_BxC, ent_BxC, g_logp, g_ent = xs
    z = _chunk_logits(h_BxCxD, w_DxV, temperature)
    logp_BxCxV = z - lse_BxC[..., None]
    p = jnp.exp(logp_BxCxV)
    onehot = jax.nn.one_hot(y_BxC, z.shape[-1], dtype=jnp.float32)
    # z - E_p[z] = log p + H
    dz = g_logp[..., None] * (onehot - p) - g_ent[..., None] * p * (logp_BxCxV + ent_BxC[..., None])
    dz = (dz / temperature).astype(dt)
    dh = jnp.einsum("bcv,dv->bcd", dz, w_DxV, preferred_element_type=jnp.float32).astype(dt)
    dw = dw_DxV + jnp.einsum("bcd,bcv->dv", h_BxCxD, dz, preferred_element_type=jnp.float32)
    return dw, dh

  xs = tuple(
    _chunks(x, chunk) for x in (hidden_BxTxD, tokens_BxT, lse_BxT, ent_BxT, g_logp_BxT, g_ent_BxT)
  )
  dw, dh = jax.lax.scan(step, jnp.zeros(w_DxV.shape, jnp.float32), xs)
  return _unchunk(dh), dw.astype(w_DxV.dtype), None


_chunked_logprobs.defvjp(_chunked_fwd, _chunked_bwd)
