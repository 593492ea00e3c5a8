"""A learned reward model (`models.RewardModel`) used as a reward function."""

import jax
import numpy as np
from flax import nnx

from jaxrl_llm.common.padding import left_pad


def reward_model_fn(model, tokenizer, *, max_length: int, batch_size: int = 64):
  """A reward function scoring `prompt + completion` with `model` (its scalar at the last
  real token). Texts longer than `max_length` tokens keep their last `max_length`."""
  graphdef, params = nnx.split(model)

  @jax.jit
  def scores(params, tokens_BxL, mask_BxL):
    return nnx.merge(graphdef, params)(tokens_BxL, mask_BxL=mask_BxL)

  def learned_reward(completions, examples):
    ids = [
      tokenizer.encode(e["prompt"] + c)[-max_length:] or [tokenizer.pad_id]
      for c, e in zip(completions, examples, strict=True)
    ]
    out = []
    for start in range(0, len(ids), batch_size):
      chunk = ids[start : start + batch_size]
      chunk = chunk + [chunk[-1]] * (batch_size - len(chunk))  # one compiled shape
      batch = left_pad(chunk, max_length, tokenizer.pad_id)
      out.append(np.asarray(scores(params, batch.tokens_BxP, batch.mask_BxP)))
    return np.concatenate(out)[: len(ids)]

  return learned_reward
