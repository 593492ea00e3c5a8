"""The base of ablation `v2`: the `grpo_vs_ppo` base (experiments/configs/ablation/base.py) on
chained addition with shown work (`data.ChainTask`: 2 or 3 two-digit terms, every partial
sum written out, `"47+15+23="` -> `"47+15=62,62+23=85"`), so correct answers take 8 to 17
characters and wrong ones can run to the 24-token budget.

  python -m jaxrl_llm.train --config experiments/configs/ablation/grpo.py:v2   # one method, alone

Every run stops at the same number of sampled completions (`run.sample_budget`: 300
steps of 32 prompts x 8 samples), so DAPO's extra dynamic-sampling rounds come out of its
budget. Held-out greedy accuracy every 30 steps.
"""

from experiments.configs import smollm2_arithmetic
from experiments.configs.ablation import base

STEPS = 300
SAMPLES = STEPS * 32 * 8
SMOLLM2_STEPS = 16


def get_config():
  c = base.get_config()
  c.task.update(name="chain", digits=2, kwargs='{"min_terms": 2, "max_terms": 3}', prompt_length=9)
  c.rollout.update(max_new_tokens=24)
  # DAPO's soft overlong zone (only DAPO weighs it): the last 3 of the 24 tokens, past the
  # longest correct solution (`99+99=198,198+99=297` and EOS: 21 tokens), as in the paper,
  # where the zone lies beyond the answers it wants. A quarter of the budget (6) would
  # penalise correct 3-term solutions.
  c.rewards.update(overlong_cache_tokens=3)
  c.run.update(steps=STEPS, sample_budget=SAMPLES, eval_every=30)
  c.checkpoint.update(every=0)  # a run takes about a minute: a killed one starts over
  return c


def smollm2_config():
  """The real-model slice (suite `v2_smollm2`): experiments/configs/smollm2_arithmetic.py, the
  SmolLM2-135M-Instruct recipe (lr 1e-5, temperature 0.7, chat template, 8 prompts x 8
  samples), cut to SMOLLM2_STEPS steps so that 4 methods x 3 seeds fit in a few hours
  on 2 CPU cores (the recipe's held-out accuracy is at 0.61 by step 10 of its 40), with the
  KL to the starting model logged for every method, held-out accuracy on 128 questions
  every 8 steps, and every run stopped at SMOLLM2_STEPS x 64 completions. Each rollout
  gets two optimizer steps (2 minibatches of 32; the recipe takes one, accumulated over 2
  micro-batches), so the second sees a ratio off 1 and the clip knobs (DAPO's clip-higher,
  PPO's clip) act. The method files then set their own algorithm."""
  c = smollm2_arithmetic.get_config()
  c.algo.update(track_kl=True, num_minibatches=2, micro_batches=1)
  c.run.update(
    steps=SMOLLM2_STEPS,
    sample_budget=SMOLLM2_STEPS * c.rollout.prompts_per_step * c.rollout.group_size,
    eval_every=8,
    eval_examples=128,
    loggers="jsonl",
  )
  c.checkpoint.update(every=8, keep=2)  # a run takes ~9 min beside another: a killed one resumes
  return c
