"""Rotary position embeddings (Su et al. 2021) in the "rotate half" layout of Hugging Face
checkpoints, with Llama 3.1's frequency scaling."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm.models.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
  """Inverse frequencies theta^(-2i/d), with Llama 3.1's scaling when configured.

  Llama 3.1 ("rope_type": "llama3") divides low frequencies (wavelength above
  original_max_position / low_freq_factor) by `factor`, keeps high ones
  (wavelength below original_max_position / high_freq_factor), and
  interpolates linearly in 1/wavelength between them.
  """
  d = cfg.head_dim
  inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float32) / d))
  s = cfg.rope_scaling
  if s is None:
    return inv_freq.astype(np.float32)
  wavelen = 2 * np.pi / inv_freq
  low_freq_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_freq_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
  smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
    s.high_freq_factor - s.low_freq_factor
  )
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(medium, smoothed, scaled).astype(np.float32)


class Rope(NamedTuple):
  """cos and sin of each token's rotary angles, computed once per forward pass."""

  cos_BxLxF: jax.Array
  sin_BxLxF: jax.Array


def rope_tables(positions_BxL, inv_freq_F) -> Rope:
  angles_BxLxF = positions_BxL[..., None].astype(jnp.float32) * inv_freq_F
  return Rope(jnp.cos(angles_BxLxF), jnp.sin(angles_BxLxF))


def apply_rope(x_BxLxNxH, rope: Rope):
  """Rotates each (x_i, x_{i + H/2}) pair by angle position * inv_freq_i (the
  "rotate half" layout that Hugging Face checkpoints use)."""
  cos, sin = rope.cos_BxLxF[:, :, None, :], rope.sin_BxLxF[:, :, None, :]
  x1, x2 = jnp.split(x_BxLxNxH.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxLxNxH.dtype)
