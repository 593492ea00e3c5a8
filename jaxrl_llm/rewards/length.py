"""Length-based shaping, counted in tokens.

These read `completion_tokens` and `truncated`, which the trainer adds to every
example dict it passes to reward functions.
"""


def overlong_penalty(max_tokens: int, cache_tokens: int):
  """DAPO's soft overlong punishment (Yu et al., 2025, arXiv:2503.14476, eq. 13):

  0                               if L <= max_tokens - cache_tokens
  ((max_tokens - cache_tokens) - L) / cache_tokens   up to max_tokens
  -1                              beyond
  """
  if not 0 < cache_tokens <= max_tokens:
    raise ValueError(f"need 0 < cache_tokens <= max_tokens, got {cache_tokens}, {max_tokens}.")
  free = max_tokens - cache_tokens

  def overlong(completions, examples):
    del completions
    out = []
    for example in examples:
      length = example["completion_tokens"]
      out.append(
        0.0 if length <= free else -1.0 if length > max_tokens else (free - length) / cache_tokens
      )
    return out

  return overlong


def missing_eos_penalty(penalty: float = -1.0):
  """`penalty` where the completion hit the token budget without an EOS, else 0."""

  def missing_eos(completions, examples):
    del completions
    return [penalty if example["truncated"] else 0.0 for example in examples]

  return missing_eos
