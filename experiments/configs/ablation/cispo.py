"""CISPO (MiniMax-M1, 2025): the importance weight clipped and stopped, never the token's
gradient, with GRPO's group advantages and a token-level mean."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(estimator="grpo", policy_loss="cispo", aggregation="token-mean")
  return c
