"""GRPO sampling with top-p 0.9 and no correction: the loss treats the nucleus's tokens
as if drawn from the full softmax."""

from experiments.ablation import grpo


def get_config():
  c = grpo.get_config()
  c.rollout.update(top_p=0.9)
  c.algo.update(correction="none")
  return c
