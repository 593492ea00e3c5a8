"""SAPO (Qwen, 2025): a smooth sigmoid gate on the ratio instead of the hard clip, with a
faster decay for negative advantages (tau 1.0 / 1.05), GRPO's group advantages."""

from experiments.configs.ablation import base


def get_config(suite=None):
  c = base.get_config(suite)
  c.algo.update(
    estimator="grpo",
    policy_loss="sapo",
    policy_loss_kwargs='{"tau_pos": 1.0, "tau_neg": 1.05}',
    aggregation="seq-mean-token-mean",
  )
  return c
