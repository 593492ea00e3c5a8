"""Scalar heads on the transformer backbone: the PPO critic and a learned reward model."""

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.models.transformer import CausalLM, Decoder


class ScalarHeadModel(nnx.Module):
  """A `Decoder` whose final hidden state at each position is mapped to one float32 scalar."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
    self.cfg = cfg
    self.decoder = Decoder(cfg, rngs=rngs)
    D = cfg.hidden_size
    std = (D + 1) ** -0.5
    self.head_D = nnx.Param(
      jax.random.normal(rngs.params(), (D,), jnp.float32) * std, logical_axes=("embed",)
    )
    self.head_bias = nnx.Param(jnp.zeros((), jnp.float32), logical_axes=())

  def head(self, hidden_BxLxD):
    """float32 `[B, L]`: the head applied to final hidden states."""
    return hidden_BxLxD.astype(jnp.float32) @ self.head_D[...] + self.head_bias[...]

  def per_token(self, tokens_BxL, positions_BxL=None, mask_BxL=None):
    """float32 `[B, L]`: the head applied to every position."""
    return self.head(self.decoder(tokens_BxL, positions_BxL, mask_BxL)[0])

  @classmethod
  def from_policy(cls, policy: CausalLM, *, rngs: nnx.Rngs):
    """A new model whose backbone is a copy of `policy`'s and whose head is freshly initialised,
    without materialising a random backbone first."""
    abstract = nnx.eval_shape(lambda: cls(policy.cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    pure["decoder"] = nnx.to_pure_dict(nnx.state(policy.decoder, nnx.Param))
    D = policy.cfg.hidden_size
    pure["head_D"] = jax.random.normal(rngs.params(), (D,), jnp.float32) * (D + 1) ** -0.5
    pure["head_bias"] = jnp.zeros((), jnp.float32)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


class ValueModel(ScalarHeadModel):
  """PPO critic: V(s_t) at every position, float32 `[B, L]`."""

  def __call__(self, tokens_BxL, positions_BxL=None, mask_BxL=None):
    return self.per_token(tokens_BxL, positions_BxL, mask_BxL)


class RewardModel(ScalarHeadModel):
  """Learned reward: the head's output at each row's last real token, float32 `[B]`."""

  def __call__(self, tokens_BxL, positions_BxL=None, mask_BxL=None):
    values_BxL = self.per_token(tokens_BxL, positions_BxL, mask_BxL)
    mask_BxL = jnp.ones(tokens_BxL.shape, bool) if mask_BxL is None else mask_BxL.astype(bool)
    L = mask_BxL.shape[-1]
    last_B = L - 1 - jnp.argmax(mask_BxL[:, ::-1], axis=-1)
    return jnp.take_along_axis(values_BxL, last_B[:, None], axis=-1)[:, 0]
