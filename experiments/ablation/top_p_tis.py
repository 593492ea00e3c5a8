"""GRPO sampling with top-p 0.9 and token TIS against the sampler's (nucleus) log-probs."""

from experiments.ablation import grpo


def get_config():
  c = grpo.get_config()
  c.rollout.update(top_p=0.9)
  c.algo.update(correction="token_tis")
  return c
