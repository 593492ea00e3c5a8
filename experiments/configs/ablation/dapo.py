"""DAPO (Yu et al., 2025): clip-higher (0.2 / 0.28), token-level loss, dynamic sampling,
the soft overlong penalty, no KL."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(
    estimator="grpo", clip_low=0.2, clip_high=0.28, aggregation="token-mean", kl_coef=0.0
  )
  c.rollout.update(dynamic_sampling=True, max_extra_rounds=2)
  c.rewards.update(overlong_weight=1.0)  # the soft zone: rewards.overlong_cache_tokens
  return c
