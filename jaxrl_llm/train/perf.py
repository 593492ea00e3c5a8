"""Throughput accounting: FLOPs of an iteration, peak FLOP/s for MFU, token counts."""

import dataclasses
import functools
import logging
import time

import jax
import jax.numpy as jnp

from jaxrl_llm.train.config import TrainConfig

log = logging.getLogger(__name__)

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
def measured_cpu_flops(repeats: int = 7) -> float:
  """The CPU's practical peak: the fastest of `repeats` timed 2048^3 float32 matmuls.

  The best run, not the mean, since a slow run measures interference rather than the
  machine. Measure before anything else runs (the trainer does so before it loads a model
  or starts a checkpoint write).
  """
  n = 2048
  a = jnp.ones((n, n), jnp.float32)
  f = jax.jit(jnp.matmul)
  f(a, a).block_until_ready()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    f(a, a).block_until_ready()
    times.append(time.perf_counter() - start)
  return 2 * n**3 / min(times)


@dataclasses.dataclass
class Peak:
  """The mesh's peak FLOP/s, the reference of MFU.

  `measured`: timed on this host by `measured_cpu_flops`, not read from a data sheet or the
  config. A measured peak can come out low (another process shared the cores while it was
  timed); a step that then runs faster raises it to that step's rate, with a warning, rather
  than stopping the run over a metric. A data-sheet or configured peak that a step beats is
  wrong, and MFU refuses it.
  """

  flops: float
  measured: bool

  def mfu(self, flops: float, seconds: float) -> float:
    """Model FLOPs utilisation of a step that ran `flops` in `seconds`."""
    rate = flops / seconds
    if rate > self.flops:
      if not self.measured:
        raise RuntimeError(
          f"MFU came out at {100 * rate / self.flops:.0f}%: the peak of "
          f"{self.flops / 1e9:.1f} GFLOP/s it is measured against is below the "
          f"{rate / 1e9:.1f} GFLOP/s this step ran at. Set config.run.peak_flops_per_device "
          "to the device's real peak."
        )
      log.warning(
        "a step ran at %.1f GFLOP/s, above the %.1f GFLOP/s this host's matmuls were timed "
        "at (the cores were shared then): MFU is measured against the faster rate from now "
        "on; set config.run.peak_flops_per_device to fix the peak",
        rate / 1e9,
        self.flops / 1e9,
      )
      self.flops = rate
    return rate / self.flops


def peak_flops(cfg: TrainConfig, n_devices: int) -> Peak:
  """Peak FLOP/s of `n_devices` devices (the mesh's, and the sampler's in async mode)."""
  per_device, measured = cfg.run.peak_flops_per_device, False
  if not per_device:
    kind = jax.devices()[0].device_kind
    per_device = next((v for k, v in PEAK_FLOPS.items() if kind.startswith(k)), None)
  if not per_device:
    per_device, measured = measured_cpu_flops() / len(jax.local_devices()), True
  return Peak(per_device * n_devices, measured)


def matmul_params(learner) -> int:
  """Parameters each token multiplies by: all of them but an untied input embedding, which is
  a lookup (a tied one is also the output projection, a matmul)."""
  params = learner.state.policy if learner.state is not None else learner.policy
  total = sum(x.size for x in jax.tree.leaves(params))
  if not learner.model_cfg.tie_word_embeddings:
    total -= learner.model_cfg.vocab_size * learner.model_cfg.hidden_size
  return total


def tokens_per_step(cfg: TrainConfig, prompt_length: int) -> int:
  """Prompt and completion tokens of the trained batch, at the width it was padded to."""
  return cfg.batch_size * (prompt_length + cfg.completion_tokens)


def iteration_flops(n: int, cfg: TrainConfig, prompt_length: int, rollouts) -> float:
  """2 n per token for each forward, 6 n per token for each training pass, n the parameters
  each token multiplies by (attention's own FLOPs are left out, so MFU errs low). With LoRA
  the policy's training pass is 4 n: a frozen weight needs its forward and the gradient of
  its input, not its own (the adapters' few FLOPs are left out too).

  `rollouts`: `(prompt_length, decode_steps)` of each sampling round this iteration ran
  (more than one with dynamic sampling); a round prefills each prompt once and decodes every
  row for `decode_steps` steps. The trained batch, padded to `prompt_length`, then runs the
  forwards (old log-probs unless `single_update`, reference, values) and the training passes
  (policy and critic); a prompt shared by its group counts once where it runs once.
  """
  B, G, N = cfg.batch_size, cfg.rollout.group_size, cfg.completion_tokens
  sampled = sum(B // G * p + B * steps for p, steps in rollouts)
  scored = (B // G if cfg.share_prompts else B) * prompt_length + B * N
  forwards = (not cfg.single_update) + cfg.uses_reference + cfg.uses_critic
  policy_pass = 4 if cfg.lora.rank else 6
  passes = cfg.algo.ppo_epochs * (policy_pass + 6 * cfg.uses_critic)
  return 2 * n * (sampled + scored * forwards) + n * scored * passes
