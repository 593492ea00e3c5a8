"""The decoder's KV cache: keys and values of every layer in preallocated slots, and the
shared prompt of a group of samples (one copy of a prompt's keys and values that its G rows
all attend to).

Keys are stored transposed (`[B, K, H, S]`, slots last) and values `[B, K, S, H]`, so a
decode step's two contractions read the cache as it lies in memory. A model with scanned
layers stacks every layer's arrays on a leading layer axis.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxrl_llm.models.config import ModelConfig


class LayerCache(NamedTuple):
  """One layer's keys and values, kv-head-major. Keys are stored transposed (slots last), so
  that a decode step's scores q @ k are a plain matmul over the cache as it lies in memory.

  With a shared prompt (`share_prompt`), `prompt_k`/`prompt_v` hold one copy of each prompt's
  keys and values, `[B/G, K, H, P]` and `[B/G, K, P, H]`, which its G rows all attend to;
  the slots `k_BxKxHxS`/`v_BxKxSxH` then hold the rows' own tokens only."""

  k_BxKxHxS: jax.Array
  v_BxKxSxH: jax.Array
  prompt_k: jax.Array | None = None
  prompt_v: jax.Array | None = None
  # With a layer index, `k_BxKxHxS`/`v_BxKxSxH` are every layer's, stacked, and this layer
  # writes its new slots into them in place (a scanned model's decode step).
  layer: jax.Array | None = None


class KVCache(NamedTuple):
  """Keys and values of every layer for S slots, which slots hold real tokens, and
  the next slot to write. A pytree of static shape.

  `layers` is a tuple of one `LayerCache` per layer, or, for a model with scanned layers,
  one `LayerCache` whose arrays are stacked on a leading layer axis.
  """

  layers: tuple[LayerCache, ...] | LayerCache
  mask_BxS: jax.Array
  index: jax.Array
  prompt_mask_BxP: jax.Array | None = None  # with a shared prompt: its real tokens, [B/G, P]

  def map_rows(self, fn):
    """The cache with `fn` (an op on a batch-major array) applied to every array's rows."""
    per_layer = jax.vmap(fn) if isinstance(self.layers, LayerCache) else fn
    return self._replace(layers=jax.tree.map(per_layer, self.layers), mask_BxS=fn(self.mask_BxS))


def with_prompt_of(layers, shared):
  """`layers` with the prompt parts of `shared` (same structure) attached."""
  attach = lambda c, s: c._replace(prompt_k=s.prompt_k, prompt_v=s.prompt_v)
  if isinstance(layers, LayerCache):
    return attach(layers, shared)
  return tuple(attach(c, s) for c, s in zip(layers, shared, strict=True))


def share_prompt(prompt_cache: KVCache, group_size: int, max_new_tokens: int) -> KVCache:
  """A cache for `group_size` rows per row of `prompt_cache` (a prefilled prompt, one row per
  prompt), in which the G rows of a prompt attend to its one copy of the prompt's keys and
  values plus `max_new_tokens` slots of their own. Equal, up to float rounding, to repeating
  the prompt's rows G times, at (G - 1)/G less of the prompt's KV memory."""
  rows = prompt_cache.mask_BxS.shape[0] * group_size
  stacked = isinstance(prompt_cache.layers, LayerCache)

  def own(c):  # the completion slots of one layer's (or the stacked layers') cache
    lead = c.k_BxKxHxS.shape[:-4] if stacked else ()
    K, H = c.k_BxKxHxS.shape[-3], c.k_BxKxHxS.shape[-2]
    dtype = c.k_BxKxHxS.dtype
    return LayerCache(
      jnp.zeros((*lead, rows, K, H, max_new_tokens), dtype),
      jnp.zeros((*lead, rows, K, max_new_tokens, H), dtype),
      prompt_k=c.k_BxKxHxS,
      prompt_v=c.v_BxKxSxH,
    )

  layers = own(prompt_cache.layers) if stacked else tuple(map(own, prompt_cache.layers))
  return KVCache(
    layers,
    jnp.zeros((rows, max_new_tokens), bool),
    jnp.zeros((), jnp.int32),
    prompt_mask_BxP=prompt_cache.mask_BxS,
  )


def init_cache(cfg: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
  """An empty cache for `batch_size` rows and `max_len` slots (prompt + new tokens)."""
  stack = (cfg.num_layers,) if cfg.scan_layers else ()
  k_shape = (*stack, batch_size, cfg.num_kv_heads, cfg.head_dim, max_len)
  v_shape = (*stack, batch_size, cfg.num_kv_heads, max_len, cfg.head_dim)
  dtype = cfg.dtype if dtype is None else dtype
  make = lambda: LayerCache(jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype))
  layers = make() if cfg.scan_layers else tuple(make() for _ in range(cfg.num_layers))
  return KVCache(layers, jnp.zeros((batch_size, max_len), bool), jnp.zeros((), jnp.int32))


def with_new_slots(cache, k_BxLxKxH, v_BxKxLxH, index, dt):
  """The keys and values a pass attends to, with its tokens written at slots `index ..` of
  `cache` (when there is one), the updated cache, and the score contraction for their
  layout: (keys, values, new cache, einsum equation)."""
  if cache is None:
    keys, v_BxKxSxH, new_cache = k_BxLxKxH.transpose(0, 2, 1, 3), v_BxKxLxH, None
    scores_eq = "bkglh,bksh->bkgls"
  elif cache.layer is not None:  # write into the stacked cache, then read this layer's
    i = cache.layer
    k_all = jax.lax.dynamic_update_slice(
      cache.k_BxKxHxS, k_BxLxKxH.transpose(0, 2, 3, 1)[None].astype(dt), (i, 0, 0, 0, index)
    )
    v_all = jax.lax.dynamic_update_slice(
      cache.v_BxKxSxH, v_BxKxLxH[None].astype(dt), (i, 0, 0, index, 0)
    )
    keys = jax.lax.dynamic_index_in_dim(k_all, i, keepdims=False)
    v_BxKxSxH = jax.lax.dynamic_index_in_dim(v_all, i, keepdims=False)
    new_cache = LayerCache(k_all, v_all)
    scores_eq = "bkglh,bkhs->bkgls"
  else:
    keys = jax.lax.dynamic_update_slice(
      cache.k_BxKxHxS, k_BxLxKxH.transpose(0, 2, 3, 1).astype(dt), (0, 0, 0, index)
    )
    v_BxKxSxH = jax.lax.dynamic_update_slice(
      cache.v_BxKxSxH, v_BxKxLxH.astype(dt), (0, 0, index, 0)
    )
    new_cache = LayerCache(keys, v_BxKxSxH)
    scores_eq = "bkglh,bkhs->bkgls"
  return keys, v_BxKxSxH, new_cache, scores_eq
