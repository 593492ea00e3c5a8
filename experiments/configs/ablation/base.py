"""The shared base of the GRPO-vs-PPO ablation: everything a method file does not name.

  python -m jaxrl_llm.train --config experiments/configs/ablation/grpo.py   # one method, alone

Every method starts from the same warm-started policy (`model.path`, set by the
runner, `python -m experiments.ablate`), samples 32 prompts x 8 completions per
step at temperature 1, takes 2 optimizer steps per rollout (so the ratio and the
clip matter in the second), and logs KL to the starting policy even when the method
has no KL term (`algo.track_kl`). Held-out greedy accuracy is logged every 50 steps.
"""

import ml_collections

from jaxrl_llm.train.config import default_config_dict


def get_config(suite: str | None = None) -> ml_collections.ConfigDict:
  """The `grpo_vs_ppo` base, or with `suite="v2"` (`--config <method>.py:v2`) the `v2` one,
  or with `suite="smollm2"` v2's real-model slice."""
  if suite in ("v2", "smollm2"):
    from experiments.configs.ablation import v2_base

    return v2_base.get_config() if suite == "v2" else v2_base.smollm2_config()
  c = default_config_dict()
  c.model.update(hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2)
  c.task.update(name="arithmetic", digits=2, ops="+", train_examples=4096, prompt_length=8)
  c.rollout.update(prompts_per_step=32, group_size=8, max_new_tokens=8, temperature=1.0)
  c.algo.update(
    estimator="grpo",
    policy_loss="ppo_clip",
    aggregation="token-mean",
    kl_placement="none",
    kl_coef=0.0,
    ppo_epochs=1,
    num_minibatches=2,
    track_kl=True,
  )
  c.optim.update(learning_rate=5e-4, grad_clip=1.0)
  c.warmstart.update(steps=0)  # the runner warm-starts once per task and sets model.path
  c.run.update(steps=600, seed=0, eval_examples=256, eval_every=50, loggers="jsonl")
  c.checkpoint.update(every=200)
  return c
