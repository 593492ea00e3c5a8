"""GSPO (Zheng et al., 2025): sequence-level importance ratios (length-normalised) clipped
per sequence, with GRPO's group advantages."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(estimator="grpo", policy_loss="gspo", aggregation="seq-mean-token-mean")
  return c
