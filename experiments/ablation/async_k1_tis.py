"""GRPO asynchronous (`rollout.mode=async`): the sampler on half the devices with its own
params copy, one step off-policy, token TIS."""

from experiments.ablation import grpo


def get_config():
  c = grpo.get_config()
  c.rollout.update(mode="async", off_policy_steps=1)
  c.algo.update(correction="token_tis")
  return c
