"""The planning table's workload: GRPO with a reference model at the scale users run.

  python -m jaxrl_llm.plan --config experiments/configs/plan_grpo.py \
      --config.model.path=experiments/configs/plan_models/qwen2.5-0.5b --config.mesh.fsdp=8 \
      --target v5e-8

16 prompts x 16 completions, 512-token prompts and 2048-token completions; k3 KL to the
reference in the loss (coef 0.04), one PPO epoch on one minibatch, AdamW. bf16 compute
over float32 master weights, scanned layers, chunked log-probs and attention;
--config.mesh.fsdp=<chips> shards everything over every chip. `experiments/configs/plan_models/`
holds the config.json of each model shape (no weights: the planner reads nothing else).
`python -m experiments.plan_table` searches the micro-batches and remat per row and writes
the README's table.
"""

import ml_collections

from jaxrl_llm.train.config import default_config_dict


def get_config() -> ml_collections.ConfigDict:
  c = default_config_dict()
  c.model.update(
    path="experiments/configs/plan_models/qwen2.5-0.5b",
    dtype="bfloat16",
    param_dtype="float32",
    scan_layers=True,
    logprob_chunk_tokens=2048,
    attention_chunk=512,
    remat="none",
  )
  c.task.update(prompt_length=512)
  c.rollout.update(prompts_per_step=16, group_size=16, max_new_tokens=2048, temperature=1.0)
  c.algo.update(
    estimator="grpo",
    kl_placement="loss",
    kl_estimator="k3",
    kl_coef=0.04,
    ppo_epochs=1,
    num_minibatches=1,
    micro_batches=16,  # one group (16 rows) per micro-batch
  )
  c.optim.update(learning_rate=1e-6)
  c.mesh.update(data=-1, fsdp=1, tensor=1)  # set mesh.fsdp to the chips for FSDP over all
  return c
