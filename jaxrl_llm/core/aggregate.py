"""Reducing a per-token loss to the scalar that is differentiated, invariantly to batch splits.

Each mode is a ratio  sum(numerator terms) / denominator  whose denominator
counts something in the *whole optimizer batch* (its tokens, or its
sequences). A split of that batch, into gradient-accumulation micro-batches or
over devices, then only splits the sum in the numerator:

  whole batch:         aggregate(loss, mask, mode)
  micro-batch k:       aggregate(loss_k, mask_k, mode, global_denominator=D)
                       with D = aggregate_denominator(mask, mode) of the whole batch;
                       the sum over k of the results is the whole-batch loss
  per device:          aggregate(loss_d, mask_d, mode, axis_name="data")
                       the denominator is psum-ed; the psum over devices of the
                       results (and of their gradients) is the whole-batch loss

On gradients per device: under `jax.shard_map` (which checks varying axes by
default), `jax.grad` of a device's share with respect to a replicated
parameter is already summed over the axis by JAX; under `jax.pmap`, psum it
yourself. Both are tested in tests/aggregate_test.py.

So a micro-batch with more padding or fewer tokens is never over- or
under-weighted, the bug of averaging per-micro-batch means that verl, TRL
and OpenRLHF have each had to fix.

Modes (m the mask, l the loss, i over sequences with at least one token, N their count):

  token-mean                Σ_it m l / Σ_it m                    (DAPO's token-level loss)
  seq-mean-token-mean       (1/N) Σ_i (Σ_t m l / Σ_t m)          (GRPO as published)
  seq-mean-token-sum        (1/N) Σ_i Σ_t m l
  seq-mean-token-sum-norm   (1/N) Σ_i Σ_t m l / max_len          (Dr. GRPO, arXiv:2503.20783)

`max_len` is Dr. GRPO's constant: the generation budget, defaulting to T.
verl's `agg_loss` (volcengine/verl b178a3c, January 2026) divides this mode's token sums
by the constant alone (`loss_scale_factor`, default the response length), without the 1/N:
the same objective at a learning rate N times larger.
"""

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.common.registry import lookup
from jaxrl_llm.core.stats import psum_if


class AggregationMode(NamedTuple):
  """numerator(loss_BxT, mask_BxT, max_len) -> scalar; denominator(mask_BxT) -> local count."""

  numerator: Callable[[jax.Array, jax.Array, float], jax.Array]
  denominator: Callable[[jax.Array], jax.Array]


def _masked_token_sum_B(loss_BxT, mask_BxT):
  return jnp.sum(jnp.where(mask_BxT, loss_BxT.astype(jnp.float32), 0.0), axis=-1)


def _num_tokens(mask_BxT):
  return jnp.sum(mask_BxT, dtype=jnp.float32)


def _num_sequences(mask_BxT):
  return jnp.sum(jnp.any(mask_BxT, axis=-1), dtype=jnp.float32)


def _token_sum(loss_BxT, mask_BxT, max_len):
  del max_len
  return jnp.sum(_masked_token_sum_B(loss_BxT, mask_BxT))


def _seq_token_mean_sum(loss_BxT, mask_BxT, max_len):
  del max_len
  length_B = jnp.maximum(jnp.sum(mask_BxT, axis=-1, dtype=jnp.float32), 1.0)
  return jnp.sum(_masked_token_sum_B(loss_BxT, mask_BxT) / length_B)


def _token_sum_norm(loss_BxT, mask_BxT, max_len):
  return _token_sum(loss_BxT, mask_BxT, None) / max_len


AGGREGATION_MODES = {
  "token-mean": AggregationMode(_token_sum, _num_tokens),
  "seq-mean-token-mean": AggregationMode(_seq_token_mean_sum, _num_sequences),
  "seq-mean-token-sum": AggregationMode(_token_sum, _num_sequences),
  "seq-mean-token-sum-norm": AggregationMode(_token_sum_norm, _num_sequences),
}


def aggregate_denominator(mask_BxT, mode, *, axis_name=None):
  """What `mode` divides by, for this batch (summed over `axis_name`): pass it as
  `global_denominator` to each micro-batch's `aggregate`."""
  agg = lookup(AGGREGATION_MODES, mode, "aggregation mode")
  return psum_if(agg.denominator(mask_BxT > 0), axis_name)


def aggregate(loss_BxT, mask_BxT, mode, *, max_len=None, axis_name=None, global_denominator=None):
  """Masked reduction of a per-token loss to a scalar; see the module docstring.

  Args:
    loss_BxT: per-token loss; entries where the mask is 0 are ignored (even NaN).
    mask_BxT: 1 on tokens that count.
    mode: a key of `AGGREGATION_MODES`.
    max_len: the constant of 'seq-mean-token-sum-norm' (default: T).
    axis_name: mesh or pmap axis the batch is split over; the denominator is
      summed over it and the result is this shard's share of the global loss.
    global_denominator: the denominator of the whole optimizer batch, from
      `aggregate_denominator`, for gradient accumulation. Overrides `axis_name`'s
      psum (it is already global).

  Returns:
    A float32 scalar: the loss, or this split's additive share of it.
  """
  if loss_BxT.shape != mask_BxT.shape:
    raise ValueError(f"loss {loss_BxT.shape} and mask {mask_BxT.shape} must have one shape.")
  agg = lookup(AGGREGATION_MODES, mode, "aggregation mode")
  mask_BxT = mask_BxT > 0
  max_len = loss_BxT.shape[-1] if max_len is None else max_len
  if global_denominator is None:
    global_denominator = psum_if(agg.denominator(mask_BxT), axis_name)
  return agg.numerator(loss_BxT, mask_BxT, max_len) / jnp.maximum(global_denominator, 1.0)
