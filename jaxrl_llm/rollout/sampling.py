"""Drawing tokens: the distribution a sampler draws from (temperature, top-k, top-p), one draw
per row by inverting its CDF, and what a sampler returns."""

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SampleOutput(NamedTuple):
  """What `generate` returns; rows are group-major (row i*G + g is sample g of prompt i).

  tokens_BxN: sampled ids; `pad_id` after a row's first EOS.
  mask_BxN: True up to and including the first EOS.
  logprobs_BxN: float32 log-prob of each sampled token under the distribution it was
    drawn from (0 where the mask is False); see `process_logits`.
  lengths_B: number of completion tokens (the EOS included).
  truncated_B: True where the row hit `max_new_tokens` without an EOS.
  """

  tokens_BxN: jax.Array
  mask_BxN: jax.Array
  logprobs_BxN: jax.Array
  lengths_B: jax.Array
  truncated_B: jax.Array


def process_logits(logits_BxV, temperature, top_k=None, top_p=None):
  """The log-probabilities that sampling draws from, float32 `[B, V]`.

    z = logits / temperature;  keep the top_k largest, then the smallest set of
    most likely tokens whose probability reaches top_p;  log_softmax over the kept set

  So with top-k or top-p, a sampled token's log-prob is under the truncated and
  renormalised distribution, which is what the behaviour policy really was, and
  differs from `core.token_logprobs(logits, temperature)` (the full softmax) that
  a trainer recomputes; without them the two agree. Temperature 0 means greedy:
  the argmax is taken, and its log-prob is reported at temperature 1.
  """
  z = logits_BxV.astype(jnp.float32) / (1.0 if temperature == 0 else temperature)
  if top_k is not None:
    kth_B1 = jax.lax.top_k(z, top_k)[0][:, -1:]
    z = jnp.where(z < kth_B1, -jnp.inf, z)
  if top_p is not None:
    sorted_BxV = jnp.sort(z, axis=-1)[:, ::-1]
    probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_BxV = mass_before_BxV < top_p  # the most likely token always stays
    threshold_B1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
    z = jnp.where(z < threshold_B1, -jnp.inf, z)
  return jax.nn.log_softmax(z, axis=-1)


def _invert_cdf(cdf_BxV, target_Bx1, probs_BxV):
  """Index of the first entry whose cumulative sum exceeds `target`, never one of
  probability 0 (rounding can leave the target at or above the last sum)."""
  V = cdf_BxV.shape[-1]
  index_B = jnp.sum(cdf_BxV <= target_Bx1, axis=-1)
  last_positive_B = V - 1 - jnp.argmax(probs_BxV[:, ::-1] > 0, axis=-1)
  return jnp.minimum(index_B, last_positive_B)


def sample_from_logprobs(key, logp_BxV, block: int = 128, *, row_offset=0, rows_total=None):
  """One draw per row from exp(logp), by inverting the CDF with a single uniform per row.

  Exact like `jax.random.categorical`, but it draws B random numbers instead of the
  B x V Gumbel variates, which dominate a decode step's sampling cost on CPU. A large
  vocabulary (over 8 blocks) is inverted in two levels: over the summed probabilities of
  blocks of `block` tokens, then within the chosen block, so each row takes V/block + block
  running sums instead of V. Tokens of probability 0 (cut by top-k/top-p) are never drawn.
  The B rows may be rows `row_offset ..` of a batch of `rows_total` (a wave of it): the
  uniforms are then that batch's, so a row draws the same number in any wave.
  """
  B = logp_BxV.shape[0]
  u_Bx1 = jax.random.uniform(key, (rows_total or B, 1))
  if rows_total is not None:  # threefry is partitionable: row r's number is the same at any size
    u_Bx1 = jax.lax.dynamic_slice_in_dim(u_Bx1, row_offset, B)
  return invert_cdf(u_Bx1, logp_BxV, block)


def invert_cdf(u_Bx1, logp_BxV, block: int = 128):
  """The token whose cumulative probability first exceeds `u` (uniform in [0, 1)) of each
  row's total: a draw from exp(logp) (see `sample_from_logprobs`)."""
  probs_BxV = jnp.exp(logp_BxV)
  B, V = probs_BxV.shape
  if V <= 8 * block:
    cdf_BxV = jnp.cumsum(probs_BxV, axis=-1)
    return _invert_cdf(cdf_BxV, u_Bx1 * cdf_BxV[:, -1:], probs_BxV)
  blocks_BxKxC = jnp.pad(probs_BxV, ((0, 0), (0, -V % block))).reshape(B, -1, block)
  mass_BxK = blocks_BxKxC.sum(-1)
  cdf_BxK = jnp.cumsum(mass_BxK, axis=-1)
  target_Bx1 = u_Bx1 * cdf_BxK[:, -1:]
  k_B = _invert_cdf(cdf_BxK, target_Bx1, mass_BxK)
  before_Bx1 = jnp.take_along_axis(cdf_BxK - mass_BxK, k_B[:, None], axis=-1)
  chosen_BxC = jnp.take_along_axis(blocks_BxKxC, k_B[:, None, None], axis=1)[:, 0]
  cdf_BxC = before_Bx1 + jnp.cumsum(chosen_BxC, axis=-1)
  return k_B * block + _invert_cdf(cdf_BxC, target_Bx1, chosen_BxC)
