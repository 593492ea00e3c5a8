"""The default run sampling with top-p 0.9 and token TIS against the sampler's (nucleus)
log-probs."""

from experiments.configs.ablation import default_base


def get_config():
  c = default_base.get_config()
  c.rollout.update(top_p=0.9)
  c.algo.update(correction="token_tis")
  return c
