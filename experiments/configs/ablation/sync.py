"""The default run as it is: on-policy GRPO at temperature 1, no mismatch correction."""

from experiments.configs.ablation import default_base


def get_config():
  return default_base.get_config()
