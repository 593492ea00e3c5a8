"""REINFORCE++ (Hu, 2025): per-token returns with the KL penalty in the reward (k1),
advantages whitened over the whole batch, no critic."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(
    estimator="reinforce_plus_plus", kl_placement="reward", kl_estimator="k1", kl_coef=0.01
  )
  return c
