"""Attention's contractions in float32, with a faster form for one query on CPU."""

import functools

import jax
import jax.numpy as jnp

MASKED = -1e30  # a masked score: finite, so a query row with no visible key gives no NaN


def contract(equation, a, b):
  """`einsum(equation, a, b)` in float32. With one query slot (a decode step) on CPU it is
  `product_sum`: XLA's CPU backend ran the batched matmul over `B x K` tiny matrices several
  times slower. Other backends keep the matmul, which reads the bfloat16 cache as it lies
  (with the product-sum the TPU compiler wrote a float32 copy of every layer's cache on
  every step)."""
  einsum = lambda a, b: jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)
  if a.shape[-2] != 1:
    return einsum(a, b)
  on_cpu = functools.partial(product_sum, equation)
  return jax.lax.platform_dependent(a, b, cpu=on_cpu, default=einsum)


def product_sum(equation, a, b):
  """`contract`'s three one-query contractions as a product and a sum in float32, which XLA
  fuses into one loop."""
  a32, b32 = a.astype(jnp.float32), b.astype(jnp.float32)
  if equation == "bkglh,bkhs->bkgls":  # b is the cache's [B, K, H, S] keys
    return jnp.sum(a32[..., :, :, None] * b32[:, :, None, None], axis=-2)
  if equation == "bkglh,bksh->bkgls":
    return jnp.sum(a32[..., :, None, :] * b32[:, :, None, None], axis=-1)
  if equation == "bkgls,bksh->bkglh":  # probabilities times values
    return jnp.sum(a32[..., :, :, None] * b32[:, :, None, None], axis=-2)
  raise ValueError(f"no product-sum for {equation!r}")
