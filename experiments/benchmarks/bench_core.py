"""Speed of the functional core: GAE, and the full per-token PPO loss with its gradient.

  python -m experiments.benchmarks.bench_core [--repeats N]

Prints median wall times after compilation, and for the loss the memory XLA allocates for
it (`memory_analysis()` of the compiled program: temporaries, and with the inputs and
outputs, the logits' gradient among them). Log-probs that never form `[B, T, V]` start
from the hidden states; `bench_memory` measures them inside the real trainer steps. With
torch installed (the `bench`
extra), it also times, on the same inputs in the same run, the reverse Python loop that
verl uses for GAE and an eager torch version of the loss (float32, as the unchunked jax
line), and prints the ratios. Asserts nothing about time; appends to results/bench_core.jsonl.
"""

import argparse
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np

from experiments.benchmarks.common import machine, time_fn, write_results
from jaxrl_llm import core

GAE_B, GAE_T = 64, 2048
LOSS_B, LOSS_T, LOSS_V = 16, 512, 32000
GAMMA, LAM, KL_COEF = 1.0, 0.95, 0.001


def gae_inputs(seed=0):
  rng = np.random.default_rng(seed)
  rewards = rng.normal(size=(GAE_B, GAE_T)).astype(np.float32)
  values = rng.normal(size=(GAE_B, GAE_T)).astype(np.float32)
  lengths = rng.integers(GAE_T // 2, GAE_T + 1, size=GAE_B)
  mask = (np.arange(GAE_T)[None, :] < lengths[:, None]).astype(np.float32)
  return rewards, values, mask


def loss_inputs(seed=0):
  rng = np.random.default_rng(seed)
  logits = rng.normal(size=(LOSS_B, LOSS_T, LOSS_V)).astype(np.float32)
  tokens = rng.integers(0, LOSS_V, size=(LOSS_B, LOSS_T)).astype(np.int32)
  old_logp = -np.abs(rng.normal(10.4, 0.5, size=(LOSS_B, LOSS_T))).astype(np.float32)
  ref_logp = old_logp + rng.normal(0, 0.05, size=old_logp.shape).astype(np.float32)
  adv = rng.normal(size=(LOSS_B,)).astype(np.float32)
  lengths = rng.integers(LOSS_T // 2, LOSS_T + 1, size=LOSS_B)
  mask = (np.arange(LOSS_T)[None, :] < lengths[:, None]).astype(np.float32)
  return logits, tokens, old_logp, ref_logp, adv, mask


def jax_loss(logits, tokens, old_logp, ref_logp, adv, mask):
  """The per-token objective of one PPO/GRPO minibatch: ppo_clip + k3 KL, token-mean."""
  logp = core.token_logprobs(logits, tokens)
  pg_BxT, _ = core.ppo_clip(logp, old_logp, adv, mask, clip_low=0.2, clip_high=0.28)
  per_token = pg_BxT + KL_COEF * core.kl_penalty(logp, ref_logp, "k3")
  return core.aggregate(per_token, mask, "token-mean")


def torch_gae_loop(rewards, values, mask, gamma, lam):
  """verl's masked GAE (compute_gae_advantage_return): a Python loop over time."""
  import torch

  B, T = rewards.shape
  next_value = torch.zeros(B)
  last_adv = torch.zeros(B)
  reversed_advs = []
  for t in reversed(range(T)):
    delta = rewards[:, t] + gamma * next_value - values[:, t]
    adv_t = delta + gamma * lam * last_adv
    next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
    last_adv = adv_t * mask[:, t] + (1 - mask[:, t]) * last_adv
    reversed_advs.append(last_adv)
  advantages = torch.stack(reversed_advs[::-1], dim=1)
  return advantages, advantages + values


def torch_loss_and_grad(logits, tokens, old_logp, ref_logp, adv, mask):
  """The same objective in eager torch, as verl/TRL write it, with its backward pass."""
  import torch

  logits = logits.detach().requires_grad_(True)
  logp = torch.gather(torch.log_softmax(logits, -1), -1, tokens[..., None].long())[..., 0]
  ratio = torch.exp(logp - old_logp)
  a = adv[:, None]
  pg = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.28))
  d = torch.clamp(ref_logp - logp, -20, 20)
  kl = torch.clamp(torch.exp(d) - d - 1, -10, 10)
  loss = ((pg + KL_COEF * kl) * mask).sum() / mask.sum()
  loss.backward()
  return loss.detach(), logits.grad


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--repeats", type=int, default=10)
  args = parser.parse_args(argv)
  have_torch = importlib.util.find_spec("torch") is not None
  print(f"machine: {machine()}")
  results = {}

  r, v, m = gae_inputs()
  gae_fn = jax.jit(functools.partial(core.gae, gamma=GAMMA, lam=LAM))
  jr, jv, jm = map(jnp.asarray, (r, v, m))
  t_gae = time_fn(gae_fn, jr, jv, jm, repeats=args.repeats * 5)
  results["gae_jax_ms"] = 1e3 * t_gae
  print(f"GAE  B={GAE_B} T={GAE_T}  jax lax.scan: {1e3 * t_gae:9.3f} ms")
  if have_torch:
    import torch

    results["torch"] = f"{torch.__version__}, {torch.get_num_threads()} threads"
    print(f"peer: torch {results['torch']}")
    tr, tv, tm = map(torch.from_numpy, (r, v, m))
    with torch.no_grad():
      t_loop = time_fn(torch_gae_loop, tr, tv, tm, GAMMA, LAM, repeats=args.repeats)
      adv_torch, _ = torch_gae_loop(tr, tv, tm, GAMMA, LAM)
    adv_jax, _ = gae_fn(jr, jv, jm)
    np.testing.assert_allclose(adv_jax, adv_torch.numpy() * m, rtol=1e-3, atol=1e-3)
    results.update(gae_torch_loop_ms=1e3 * t_loop, gae_speedup=t_loop / t_gae)
    print(
      f"GAE  verl torch loop:          {1e3 * t_loop:9.3f} ms   -> jax is "
      f"{t_loop / t_gae:.1f}x faster"
    )

  inputs = loss_inputs()
  j_inputs = tuple(map(jnp.asarray, inputs))
  shape = f"B={LOSS_B} T={LOSS_T} V={LOSS_V}"
  fp32_logits_mb = LOSS_B * LOSS_T * LOSS_V * 4 / 1e6
  print(f"one float32 [B, T, V] array: {fp32_logits_mb:.0f} MB")
  fn = jax.jit(jax.value_and_grad(jax_loss))
  memory = fn.lower(*j_inputs).compile().memory_analysis()
  temp_mb = memory.temp_size_in_bytes / 1e6
  total_mb = (
    memory.argument_size_in_bytes
    + memory.output_size_in_bytes
    + memory.temp_size_in_bytes
    - memory.alias_size_in_bytes
  ) / 1e6
  t = time_fn(fn, *j_inputs, repeats=args.repeats)
  results |= {"loss_grad_jax_ms": 1e3 * t, "loss_grad_jax_temp_mb": temp_mb}
  results["loss_grad_jax_total_mb"] = total_mb
  print(
    f"loss+grad {shape} (jax, fp32 logits): {1e3 * t:9.1f} ms, {temp_mb:5.0f} MB of "
    f"temporaries, {total_mb:5.0f} MB with inputs and outputs"
  )
  if have_torch:
    t_inputs = tuple(map(torch.from_numpy, inputs))
    t_torch = time_fn(torch_loss_and_grad, *t_inputs, repeats=args.repeats)
    j_loss = jax.jit(jax_loss)(*j_inputs)
    np.testing.assert_allclose(j_loss, torch_loss_and_grad(*t_inputs)[0].numpy(), rtol=1e-4)
    speedup = 1e3 * t_torch / results["loss_grad_jax_ms"]
    results.update(loss_grad_torch_ms=1e3 * t_torch, loss_grad_speedup=speedup)
    print(
      f"loss+grad {shape} (eager torch       ): {1e3 * t_torch:9.1f} ms   -> jax is "
      f"{speedup:.2f}x faster"
    )
  print(f"wrote {write_results('bench_core', results)}")


if __name__ == "__main__":
  main()
