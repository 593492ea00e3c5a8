"""Supervised warm start: next-token cross-entropy on labelled answers, in the RL layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxrl_llm import core
from jaxrl_llm.train.step import Batch, sequence_forward, trained_tokens


def sft_loss(params, batch: Batch, *, policy_def, chunk=0):
  """Mean negative log-likelihood of the answer tokens (the EOS included; in a demonstrated
  episode, the model's turns only); `chunk`: see `sequence_forward`."""
  logp_BxN = sequence_forward(policy_def, params, batch, 1.0, chunk=chunk)
  return -core.masked_mean(logp_BxN, trained_tokens(batch))


@functools.partial(
  jax.jit, static_argnames=("policy_def", "optimizer", "chunk"), donate_argnums=(0, 1)
)
def sft_step(params, opt_state, batch: Batch, *, policy_def, optimizer, chunk=0):
  loss, grads = jax.value_and_grad(sft_loss)(params, batch, policy_def=policy_def, chunk=chunk)
  updates, opt_state = optimizer.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def warm_start(learner, batches, *, steps: int, learning_rate: float, progress=None):
  """`steps` Adam steps over `batches` (an iterator of labelled `Batch`es); returns the losses.

  The host keeps one step in flight: it dispatches step k+1, then reads step k's loss.
  Letting it run further ahead is not only pointless but unsafe on a multi-device CPU
  mesh: XLA's CPU client admits 32 queued computations per device, and a deeper queue of
  programs with collectives (each step all-reduces its gradients) can leave one device
  out of an all-reduce the others already wait in, which aborts the process.
  """
  optimizer = optax.adam(learning_rate)
  params = jax.tree.map(jnp.copy, learner.policy)
  opt_state = optimizer.init(params)
  losses, pending = [], None
  for _ in range(steps):
    params, opt_state, loss = sft_step(
      params,
      opt_state,
      learner.shard_batch(next(batches)),
      policy_def=learner.base_def,
      optimizer=optimizer,
      chunk=learner.cfg.model.logprob_chunk_tokens,
    )
    if pending is not None:
      _record(losses, pending, progress)
    pending = loss
  if pending is not None:
    _record(losses, pending, progress)
  learner.policy = params
  return np.asarray(losses)


def _record(losses: list, loss, progress) -> None:
  losses.append(float(loss))
  if progress is not None:
    progress.update(1)
    progress.set_postfix(loss=f"{losses[-1]:.3f}")
