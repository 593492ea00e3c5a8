"""PPO (Schulman et al., 2017; as in RLHF): a critic with GAE, KL to the reference in the
reward (k1, per token)."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(
    estimator="gae", gamma=1.0, lam=0.95, critic_lr=1e-3, cliprange_value=0.2,
    kl_placement="reward", kl_estimator="k1", kl_coef=0.01,
  )  # fmt: skip
  return c
