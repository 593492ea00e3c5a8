"""GRPO-vs-PPO ablation configs: one shared base, one small file per method."""
