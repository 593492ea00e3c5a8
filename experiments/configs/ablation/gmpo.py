"""GMPO (Zhao et al., 2025): the geometric mean of the token ratios, clipped per token in
log space to (-0.4, 0.4), with GRPO's group advantages; one value per sequence."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(estimator="grpo", policy_loss="gmpo", aggregation="seq-mean-token-mean")
  return c
