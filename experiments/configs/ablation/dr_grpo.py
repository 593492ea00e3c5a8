"""Dr. GRPO (Liu et al., 2025): group advantages centred but not divided by the std, token
sums divided by a constant (no 1/|o|), no KL."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(estimator="dr_grpo", aggregation="seq-mean-token-sum-norm", kl_coef=0.0)
  return c
