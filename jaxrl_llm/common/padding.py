"""Left-padded prompt batches for the sampler."""

from typing import NamedTuple

import numpy as np


class PromptBatch(NamedTuple):
  tokens_BxP: np.ndarray  # int32, left-padded
  mask_BxP: np.ndarray  # bool, True on real tokens


def left_pad(token_lists: list[list[int]], length: int, pad_id: int) -> PromptBatch:
  """Right-aligns each token list in a `[B, length]` array."""
  tokens = np.full((len(token_lists), length), pad_id, np.int32)
  mask = np.zeros((len(token_lists), length), bool)
  for i, ids in enumerate(token_lists):
    if not 0 < len(ids) <= length:
      raise ValueError(
        f"prompt {i} has {len(ids)} tokens; prompts need 1..{length} "
        "(raise the prompt length or shorten the prompt)."
      )
    tokens[i, length - len(ids) :] = ids
    mask[i, length - len(ids) :] = True
  return PromptBatch(tokens, mask)


def pad_left_to(x_BxP: np.ndarray, length: int, value) -> np.ndarray:
  """Widens an already left-padded `[B, P]` array to `[B, length]` with `value` on the left."""
  pad = length - x_BxP.shape[1]
  return np.pad(x_BxP, ((0, 0), (pad, 0)), constant_values=value) if pad else x_BxP


def bucket_length(token_lists: list[list[int]], buckets, max_length: int) -> int:
  """The smallest of `buckets` (or `max_length`) that fits the longest list, so that
  padded shapes, and so compilations, stay few."""
  longest = max(len(ids) for ids in token_lists)
  return min([b for b in sorted(buckets) if b >= longest] + [max_length])
