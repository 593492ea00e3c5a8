"""GRPO on a real pretrained chat model: SmolLM2-135M-Instruct on two-digit addition.

  python -m jaxrl_llm.models.gguf --out runs/smollm2-135m-instruct   # once: the model
  python -m jaxrl_llm.train --config experiments/configs/smollm2_arithmetic.py

(`python -m experiments.smollm2` does both, records the run and draws its curve.)

The settings are those of a pretrained policy, not of the toy default run:
- a learning rate of 1e-5 with a short warm-up (the toy run's 5e-4 moves this model tens of
  nats per token from its reference in one update);
- a small k3 KL term to the initial model, so the chat behaviour it already has is kept;
- sampling at temperature 0.7 (at 1.0 this 4-bit-derived model rambles in most samples);
- the model's chat template with its own system prompt, and the end-of-turn id from
  `generation_config.json` ending each completion;
- an instruction asking for `Answer: <number>`, read by the reward's marker rule, with the
  final-statement rule for replies that answer without the marker (`rewards.math`);
- 24 new tokens: enough for "47 + 15 = 62. Answer: 62"; a reply that rambles past them
  states no answer.
"""

import ml_collections

from jaxrl_llm.train.config import default_config_dict

MODEL_DIR = "runs/smollm2-135m-instruct"


def get_config() -> ml_collections.ConfigDict:
  c = default_config_dict()
  c.model.update(path=MODEL_DIR, scan_layers=True)
  c.task.update(
    name="arithmetic",
    digits=2,
    ops="+",
    train_examples=4096,
    template="chat",
    instruction="What is {question}? End your reply with 'Answer: <number>'.",
    prompt_length=64,
  )
  c.rollout.update(prompts_per_step=8, group_size=8, max_new_tokens=24, temperature=0.7)
  c.algo.update(
    estimator="grpo",
    policy_loss="ppo_clip",
    aggregation="seq-mean-token-mean",
    kl_placement="loss",
    kl_estimator="k3",
    kl_coef=0.02,
    ppo_epochs=1,
    num_minibatches=1,
    micro_batches=2,
  )
  c.optim.update(learning_rate=1e-5, warmup_steps=5, grad_clip=1.0)
  c.run.update(
    steps=40, seed=0, workdir="runs/smollm2_arithmetic", eval_examples=256, eval_every=10
  )
  c.checkpoint.update(every=c.run.steps)  # step 0 and the end: for jaxrl_llm.export
  return c
