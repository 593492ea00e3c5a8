"""A toy RL run built from the functional core alone: a tabular policy learns to spell words.

  python -m jaxrl_llm.demo [--estimator grpo] [--policy-loss ppo_clip] [--aggregation token-mean]

Each prompt asks for one word. The policy is a table of logits per (prompt,
position), so each token is sampled independently; completions end at the
first '.' (EOS). The verifiable reward is the fraction of the word's letters
and its final '.' produced in place. One iteration samples G completions per
prompt, computes group advantages, and takes `epochs x minibatches` clipped
policy-gradient steps with a k3 KL penalty to the initial policy, exactly as
the trainer does with a transformer, in one file small enough to read whole; it prints
the reward climbing and the words it learned.
"""

import argparse
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from jaxrl_llm import core

ALPHABET = ".abcdefghijklmnopqrstuvwxyz"  # id 0 ('.') is EOS
WORDS = ("jax", "grpo", "ppo", "rloo", "gspo", "flax")
T = 6  # completion length budget


class DemoConfig(NamedTuple):
  estimator: str = "grpo"
  policy_loss: str = "ppo_clip"
  aggregation: str = "token-mean"
  group_size: int = 8
  iterations: int = 150
  epochs: int = 2
  minibatches: int = 2
  learning_rate: float = 0.03
  kl_coef: float = 0.001
  seed: int = 0


class DemoState(NamedTuple):
  params_PxTxV: jax.Array
  opt_state: optax.OptState
  ref_params_PxTxV: jax.Array


def encode(word):
  ids = [ALPHABET.index(c) for c in word + "."]
  return ids + [0] * (T - len(ids))


def decode(ids):
  text = "".join(ALPHABET[i] for i in ids)
  return text[: text.index(".") + 1] if "." in text else text


def completion_mask(tokens_BxT):
  """1 up to and including the first EOS."""
  is_eos = tokens_BxT == 0
  eos_before = jnp.cumsum(is_eos, axis=-1) - is_eos
  return eos_before == 0


def reward(tokens_BxT, mask_BxT, targets_BxT):
  """Fraction of the target's letters and its '.' that the completion has in place."""
  target_len_B = jnp.argmax(targets_BxT == 0, axis=-1) + 1
  in_target_BxT = jnp.arange(tokens_BxT.shape[-1])[None, :] < target_len_B[:, None]
  hits_B = jnp.sum((tokens_BxT == targets_BxT) & mask_BxT & in_target_BxT, axis=-1)
  return hits_B / target_len_B


def policy_loss(params_PxTxV, batch, ref_params_PxTxV, denominator, cfg: DemoConfig):
  prompts_B, tokens_BxT, mask_BxT, old_logp_BxT, adv_B = batch
  logp_BxT = core.token_logprobs(params_PxTxV[prompts_B], tokens_BxT)
  ref_logp_BxT = core.token_logprobs(ref_params_PxTxV[prompts_B], tokens_BxT)
  pg_BxT, metrics = core.POLICY_LOSSES[cfg.policy_loss](logp_BxT, old_logp_BxT, adv_B, mask_BxT)
  per_token = pg_BxT + cfg.kl_coef * core.kl_penalty(logp_BxT, ref_logp_BxT, "k3")
  loss = core.aggregate(per_token, mask_BxT, cfg.aggregation, global_denominator=denominator)
  return loss, metrics


@functools.partial(jax.jit, static_argnames=("cfg", "optimizer"), donate_argnums=0)
def iteration(state: DemoState, key, targets_PxT, cfg: DemoConfig, optimizer):
  """Sample, score, estimate advantages, then epochs x minibatches updates."""
  P, G = targets_PxT.shape[0], cfg.group_size
  sample_key, perm_key = jax.random.split(key)
  prompts_B = jnp.repeat(jnp.arange(P), G)  # group-major rows
  logits_BxTxV = state.params_PxTxV[prompts_B]
  tokens_BxT = jax.random.categorical(sample_key, logits_BxTxV)
  mask_BxT = completion_mask(tokens_BxT)
  scores_B = reward(tokens_BxT, mask_BxT, targets_PxT[prompts_B])
  adv_B = core.group_advantages(
    scores_B, group_size=G, estimator=cfg.estimator, lengths=mask_BxT.sum(-1)
  )
  old_logp_BxT = core.token_logprobs(logits_BxTxV, tokens_BxT)
  batch = (prompts_B, tokens_BxT, mask_BxT, old_logp_BxT, adv_B)

  def minibatch_step(carry, rows):
    params, opt_state = carry
    mb = jax.tree.map(lambda x: x[rows], batch)
    denominator = core.aggregate_denominator(mb[2], cfg.aggregation)
    (loss, metrics), grads = jax.value_and_grad(policy_loss, has_aux=True)(
      params, mb, state.ref_params_PxTxV, denominator, cfg
    )
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), (loss, metrics)

  # Whole groups go to a minibatch together, in a fresh order each epoch.
  perms = [jax.random.permutation(k, P) for k in jax.random.split(perm_key, cfg.epochs)]
  group_rows = jnp.concatenate(perms).reshape(cfg.epochs * cfg.minibatches, -1)
  rows_MxR = (group_rows[:, :, None] * G + jnp.arange(G)).reshape(group_rows.shape[0], -1)
  (params, opt_state), (_, metrics) = jax.lax.scan(
    minibatch_step, (state.params_PxTxV, state.opt_state), rows_MxR
  )
  metrics = jax.tree.map(jnp.mean, metrics) | {"reward": scores_B.mean()}
  return DemoState(params, opt_state, state.ref_params_PxTxV), metrics


def run(cfg: DemoConfig, progress=True):
  """Runs the demo; returns the per-iteration mean rewards and the greedy completions."""
  if len(WORDS) % cfg.minibatches:
    raise ValueError(f"minibatches={cfg.minibatches} must divide the {len(WORDS)} prompts.")
  targets_PxT = jnp.array([encode(w) for w in WORDS])
  key = jax.random.key(cfg.seed)
  init_key, key = jax.random.split(key)
  params = 0.01 * jax.random.normal(init_key, (len(WORDS), T, len(ALPHABET)))
  optimizer = optax.adam(cfg.learning_rate)
  state = DemoState(params, optimizer.init(params), jnp.copy(params))
  rewards = []
  bar = tqdm(range(cfg.iterations), desc=f"{cfg.estimator}/{cfg.policy_loss}", disable=not progress)
  for step in bar:
    state, metrics = iteration(state, jax.random.fold_in(key, step), targets_PxT, cfg, optimizer)
    metrics = jax.device_get(metrics)
    if not np.isfinite(metrics["reward"]):
      raise FloatingPointError(f"non-finite reward at iteration {step}: {metrics}")
    rewards.append(float(metrics["reward"]))
    bar.set_postfix(reward=f"{rewards[-1]:.3f}", kl=f"{float(metrics['approx_kl']):.2e}")
  greedy = [decode(row) for row in np.asarray(jnp.argmax(state.params_PxTxV, -1))]
  return np.array(rewards), greedy


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  defaults = DemoConfig()
  for field, value in defaults._asdict().items():
    parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
  cfg = DemoConfig(**vars(parser.parse_args(argv)))
  core.lookup(core.GROUP_ESTIMATORS, cfg.estimator, "advantage estimator")
  core.lookup(core.POLICY_LOSSES, cfg.policy_loss, "policy loss")
  core.lookup(core.AGGREGATION_MODES, cfg.aggregation, "aggregation mode")
  rewards, greedy = run(cfg)
  k = max(1, len(rewards) // 10)
  print(
    f"\nmean reward: first {k} iterations {rewards[:k].mean():.3f} -> "
    f"last {k} iterations {rewards[-k:].mean():.3f}"
  )
  print(f"{'prompt':>8}  greedy completion")
  for word, text in zip(WORDS, greedy, strict=True):
    print(f"{word + '.':>8}  {text}")


if __name__ == "__main__":
  main()
