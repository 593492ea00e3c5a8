"""RLOO (Ahmadian et al., 2024): each sample's baseline is the mean reward of the other
samples of its prompt."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(estimator="rloo")
  return c
