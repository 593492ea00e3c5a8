"""DAPO without dynamic sampling: the control that isolates what dynamic sampling adds
at an equal number of sampled completions."""

from experiments.configs.ablation import dapo


def get_config(suite=None):
  c = dapo.get_config(suite)
  c.rollout.update(dynamic_sampling=False)
  return c
