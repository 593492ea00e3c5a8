"""The default run asynchronous (`rollout.mode=async`): the sampler on half the devices with
its own params copy, one step off-policy, token TIS against the sampler's log-probs."""

from experiments.configs.ablation import default_base


def get_config():
  c = default_base.get_config()
  c.rollout.update(mode="async", off_policy_steps=1)
  c.algo.update(correction="token_tis")
  return c
