"""The shared base of the `off_policy` suite: the embedded default run
(experiments/configs/default.py, GRPO with no KL term, 1500 steps), minus its warm start,
which the runner does once and hands every method as `model.path`. Held-out greedy accuracy
on 512 problems every 100 steps.
"""

from experiments.configs import default


def get_config():
  c = default.get_config()
  c.warmstart.update(steps=0)
  c.run.update(eval_every=100, loggers="jsonl")
  c.checkpoint.update(every=500)
  return c
