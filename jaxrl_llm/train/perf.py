"""Throughput accounting: FLOPs of an iteration, peak FLOP/s for MFU, token counts."""

import functools
import time

import jax
import jax.numpy as jnp

from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.state import learning_rate_schedule

# Dense bf16 peak FLOP/s per chip, from the vendors' data sheets.
PEAK_FLOPS = {
  "TPU v4": 275e12,
  "TPU v5 lite": 197e12,
  "TPU v5e": 197e12,
  "TPU v5p": 459e12,
  "TPU v6 lite": 918e12,
  "NVIDIA H100": 989e12,
  "NVIDIA H200": 989e12,
  "NVIDIA A100": 312e12,
}


@functools.cache
def _measured_cpu_flops() -> float:
  """What a 1024^3 float32 matmul reaches here: the CPU's practical peak."""
  a = jnp.ones((1024, 1024), jnp.float32)
  f = jax.jit(jnp.matmul)
  f(a, a).block_until_ready()
  start = time.perf_counter()
  for _ in range(5):
    f(a, a).block_until_ready()
  return 5 * 2 * 1024**3 / (time.perf_counter() - start)


def peak_flops(cfg: TrainConfig, mesh) -> float:
  """Peak FLOP/s of the whole mesh, for MFU."""
  if cfg.run.peak_flops_per_device:
    per_device = cfg.run.peak_flops_per_device
  else:
    kind = jax.devices()[0].device_kind
    per_device = next((v for k, v in PEAK_FLOPS.items() if kind.startswith(k)), None)
    if per_device is None:
      per_device = _measured_cpu_flops() / len(jax.local_devices())
  return per_device * mesh.size


def tokens_per_step(cfg: TrainConfig) -> int:
  """Prompt and completion tokens processed per iteration (sampled once, trained on)."""
  return cfg.batch_size * (cfg.task.prompt_length + cfg.rollout.max_new_tokens)


def iteration_flops(learner, cfg: TrainConfig) -> float:
  """2 N per token for each forward (rollout, old log-probs unless `single_update`, reference,
  values), 6 N per token for each training pass (policy and critic), N the parameter count.
  A prompt shared by its group counts once where it runs once: always in the rollout, and in
  the trainer's passes with `share_prompts`."""
  n = learner.num_params
  B, G = cfg.batch_size, cfg.rollout.group_size
  P, T = cfg.task.prompt_length, cfg.rollout.max_new_tokens
  rollout = B // G * P + B * T
  scored = (B // G if cfg.share_prompts else B) * P + B * T
  forwards = (not cfg.single_update) + cfg.uses_reference + cfg.uses_critic
  passes = cfg.algo.ppo_epochs * (1 + cfg.uses_critic)
  return 2 * n * (rollout + scored * forwards) + 6 * n * scored * passes


def learning_rate_fn(cfg: TrainConfig):
  """The policy learning rate at an iteration (its first optimizer step)."""
  schedule = learning_rate_schedule(cfg, cfg.optim.learning_rate)
  per_step = cfg.algo.ppo_epochs * cfg.algo.num_minibatches
  return lambda step: float(schedule(step * per_step))
