"""GRPO on-policy (the grpo method) with token TIS against the sampler's log-probs: the
off-policy suite's reference, whose weights stay within float rounding of 1."""

from experiments.ablation import grpo


def get_config():
  c = grpo.get_config()
  c.algo.update(correction="token_tis")
  return c
