"""GRPO as in DeepSeekMath (Shao et al., 2024): std-normalised group advantages, k3 KL in
the loss at beta=0.04, each sequence's token mean, then the mean over sequences."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(
    estimator="grpo", kl_placement="loss", kl_estimator="k3", kl_coef=0.04,
    aggregation="seq-mean-token-mean",
  )  # fmt: skip
  return c
