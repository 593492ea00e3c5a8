"""A multi-turn game with feedback: find a secret number in 1..30 (env.name=guess).

  python -m jaxrl_llm.train --config experiments/configs/tools_guess.py
  python -m jaxrl_llm.train --config experiments/configs/tools_guess.py \
      --config.env.kwargs='{"feedback": false}'           # the baseline without feedback

Each model turn is a guess; the environment replies "higher" or "lower" (or "?" for a
guess out of range). Finding the secret scores 1, every miss costs 0.1, and an episode
has 5 guesses at most, which bisection always needs at most. The tiny model is
warm-started on demonstrations that guess uniformly among the numbers the replies so far
leave possible, which find the secret within 5 guesses less often than bisection does:
RL has a better strategy to find. `turns_per_episode` is logged every step, held-out
success every 25.
"""

import ml_collections

from jaxrl_llm.train.config import default_config_dict


def get_config() -> ml_collections.ConfigDict:
  c = default_config_dict()
  c.model.update(hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2)
  c.task.update(train_examples=4096, prompt_length=12)
  c.env.update(name="guess", max_turns=5, max_tokens=48, kwargs='{"high": 30, "turn_cost": 0.1}')
  c.rollout.update(prompts_per_step=16, group_size=8, max_new_tokens=3, temperature=1.0)
  c.algo.update(
    estimator="grpo",
    policy_loss="ppo_clip",
    aggregation="seq-mean-token-mean",
    kl_coef=0.0,
    num_minibatches=1,
  )
  c.optim.update(learning_rate=5e-4, grad_clip=1.0)
  c.warmstart.update(steps=600, examples=2048, batch_size=64, learning_rate=3e-3)
  c.run.update(steps=500, seed=0, workdir="runs/tools_guess", eval_examples=256)
  c.run.update(eval_batch_size=128, eval_every=25, loggers="jsonl")
  c.checkpoint.update(every=100)
  return c
