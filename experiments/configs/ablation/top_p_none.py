"""The default run sampling with top-p 0.9 and no correction: the ratio's denominator is the
trainer's full-softmax log-prob, not the nucleus distribution the tokens came from."""

from experiments.configs.ablation import default_base


def get_config():
  c = default_base.get_config()
  c.rollout.update(top_p=0.9)
  return c
