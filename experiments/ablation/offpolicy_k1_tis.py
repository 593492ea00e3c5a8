"""GRPO one step off-policy (`rollout.off_policy_steps=1`, on the same devices) with token
TIS: each rollout is sampled before the update ahead of it, from params one update old."""

from experiments.ablation import grpo


def get_config():
  c = grpo.get_config()
  c.rollout.update(off_policy_steps=1)
  c.algo.update(correction="token_tis")
  return c
