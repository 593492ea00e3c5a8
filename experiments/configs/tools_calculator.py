"""Tool use: 4-digit multiplication with a calculator tool (env.name=calculator).

  python -m jaxrl_llm.train --config experiments/configs/tools_calculator.py
  python -m jaxrl_llm.train --config experiments/configs/tools_calculator.py \
      --config.env.kwargs='{"use_tools": false}'          # the no-tool baseline

The prompt is "1234*5678="; the model may call
<tool_call>{"name":"calc","arguments":{"x":"1234*5678"}}</tool_call>, reads
<tool_response>7006652</tool_response>, and answers; an exact final answer scores 1. The
tiny model (a character vocabulary, the tool tags as single tokens) is warm-started on
demonstrations of which half call the tool and half answer straight away, so RL has to
learn to call it: `tool_call_rate` is logged every step, held-out success every 25.
"""

import ml_collections

from jaxrl_llm.train.config import default_config_dict


def get_config() -> ml_collections.ConfigDict:
  c = default_config_dict()
  c.model.update(hidden_size=64, intermediate_size=176, num_layers=2, num_heads=4, num_kv_heads=2)
  c.task.update(name="arithmetic", digits=4, ops="*", train_examples=4096, prompt_length=10)
  c.env.update(name="calculator", max_turns=3, max_tokens=72, kwargs='{"demo_tool_rate": 0.5}')
  c.rollout.update(prompts_per_step=16, group_size=4, max_new_tokens=48, temperature=1.0)
  c.algo.update(
    estimator="grpo",
    policy_loss="ppo_clip",
    aggregation="seq-mean-token-mean",
    kl_coef=0.0,
    num_minibatches=1,
  )
  c.optim.update(learning_rate=5e-4, grad_clip=1.0)
  c.warmstart.update(steps=1000, examples=2048, batch_size=64, learning_rate=3e-3)
  c.run.update(steps=200, seed=0, workdir="runs/tools_calculator", eval_examples=256)
  c.run.update(eval_batch_size=128, eval_every=25, loggers="jsonl")
  c.checkpoint.update(every=50)
  return c
