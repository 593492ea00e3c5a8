"""The jitted update: `ppo_epochs x num_minibatches` optimizer steps on a rollout's
experience (`train/experience.py`), each accumulated over `micro_batches`, the policy's
and the critic's objectives, and how their metrics combine over pieces of a batch.

All functions are pure; `Learner` binds the static pieces (graph definitions, config,
optimizers, the bound `Algorithm`) and jits them once.
"""

import functools

import jax
import jax.numpy as jnp
import optax

from jaxrl_llm import core
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.rollout.batch import Batch
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.experience import (  # noqa: F401 (the step's public face)
  Algorithm,
  Experience,
  _group,
  algorithm,
  loss_mask,
  make_experience,
  rows_over_mesh,
  sequence_forward,
  sequence_values,
  spread_rows,
  state_after_last_token,
  trained_tokens,
)
from jaxrl_llm.train.state import (
  TrainState,
  applied_updates,
  entropy_controller,
  kl_controller,
  learning_rate_schedule,
)

__all__ = ["Algorithm", "Batch", "Experience", "algorithm", "make_experience", "update"]


def policy_objective(
  params,
  exp: Experience,
  denominator,
  kl_coef,
  entropy_coef=0.0,
  *,
  policy_def,
  cfg: TrainConfig,
  algo: Algorithm,
  dropout_key=None,
):
  """The scalar the policy minimises on one micro-batch (its share of the minibatch loss).
  `dropout_key`: with `config.lora.dropout`, the key of this pass's adapter dropout."""
  a, mask = cfg.algo, exp.loss_mask_BxN
  with lora_lib.dropout_key(dropout_key, cfg.lora.dropout):
    logp, ent = sequence_forward(
      policy_def,
      params,
      exp.batch,
      cfg.rollout.temperature,
      with_entropy=True,
      group=_group(cfg),
      chunk=cfg.model.logprob_chunk_tokens,
    )
  old_logp = jax.lax.stop_gradient(logp) if cfg.single_update else exp.old_logp_BxN
  agg = functools.partial(
    core.aggregate,
    mask_BxT=mask,
    mode=a.aggregation,
    max_len=cfg.completion_tokens,
    global_denominator=denominator,
  )
  behav = exp.batch.behav_logp_BxN  # None (labelled batches): the trainer's own, weight 1
  pg_BxN, metrics = core.corrected_policy_loss(
    algo.policy_loss,
    logp,
    old_logp,
    jax.lax.stop_gradient(old_logp) if behav is None else behav,
    exp.advantages_BxN,
    mask,
    correction=algo.correction,
  )
  pg_loss = agg(pg_BxN)
  loss = pg_loss
  if a.kl_placement == "loss" and a.kl_coef > 0:
    loss = loss + kl_coef * agg(core.kl_penalty(logp, exp.ref_logp_BxN, a.kl_estimator))
  if a.entropy_coef or a.entropy_target is not None:
    loss = loss - entropy_coef * agg(ent)
  metrics = metrics | {"pg_loss": pg_loss, "entropy": core.masked_mean(ent, mask)}
  if cfg.uses_reference:
    metrics |= _kl_to_reference(jax.lax.stop_gradient(logp), exp, a.kl_estimator)
  return loss, metrics


def _kl_to_reference(logp_BxN, exp: Experience, estimator: str) -> dict:
  """The mean per-sequence KL to the reference, by the configured estimator and by k3, over
  the rows with loss tokens (rows with none would dilute it)."""
  mask = exp.loss_mask_BxN
  in_loss_B = jnp.any(mask, axis=-1)
  out = {}
  for name, kind in (("kl_ref", estimator), ("kl_ref_k3", "k3")):
    kl_BxN = core.kl_penalty(logp_BxN, exp.ref_logp_BxN, kind)
    out[name] = core.masked_mean(jnp.sum(jnp.where(mask, kl_BxN, 0.0), axis=-1), in_loss_B)
  return out


def critic_objective(params, exp: Experience, denominator, *, critic_def, cfg: TrainConfig):
  values = sequence_values(critic_def, params, exp.batch, _group(cfg))
  loss_BxN, metrics = core.clipped_value_loss(
    values,
    exp.old_values_BxN,
    exp.returns_BxN,
    exp.loss_mask_BxN,
    cliprange_value=cfg.algo.cliprange_value,
  )
  loss = core.aggregate(
    loss_BxN,
    exp.loss_mask_BxN,
    cfg.algo.aggregation,
    max_len=cfg.completion_tokens,
    global_denominator=denominator,
  )
  return loss, metrics | {"value_loss": loss}


# How metrics combine over the micro-batches of a minibatch and over an iteration's
# minibatches. Every other metric is a masked mean over tokens, combined weighted by the
# tokens each piece holds, so it is the whole batch's however the batch was split.
LOSS_SHARES = ("pg_loss", "value_loss")  # a micro-batch's additive share of the loss
PER_SEQUENCE = ("kl_ref", "kl_ref_k3")  # means over the rows that have loss tokens
PER_UPDATE = ("loss", "grad_norm", "critic_grad_norm", "learning_rate", "critic_learning_rate")
TOKENS = "response_tokens"  # the loss mask's count of each piece
ROWS = "loss_rows"  # the count of each piece's rows with at least one loss token


def _weights(counts):
  return counts / jnp.maximum(counts.sum(0), 1.0)


def combine_metrics(stacked: dict, sum_keys=()) -> dict:
  """Metrics stacked over pieces of a batch (leading axis) to the whole batch's.

  `sum_keys` add up (loss shares); `*_min` and `*_max` take the min and max; per-row
  means are weighted by the rows each piece holds (`ROWS`), per-update values average; the
  rest are token means, weighted by `TOKENS`.
  """
  tokens, rows = stacked[TOKENS], stacked[ROWS]

  def combine(key, x):
    if key in (TOKENS, ROWS) or key in sum_keys:
      return x.sum(0)
    if key.endswith("_min"):
      return x.min(0)
    if key.endswith("_max"):
      return x.max(0)
    if key in PER_SEQUENCE:
      return (x * _weights(rows)).sum(0)
    if key in PER_UPDATE or key in LOSS_SHARES:
      return x.mean(0)
    return (x * _weights(tokens)).sum(0)

  return {k: combine(k, v) for k, v in stacked.items()}


def _accumulate(objective, params, micro_exps, denominator, *extra, keys=None):
  """Sum of value-and-grads over micro-batches (each already divided by the global
  denominator), and their metrics combined into the minibatch's. `keys`: one dropout key
  per micro-batch, passed to `objective` as `dropout_key`."""

  def one(carry, xs):
    exp, key = xs
    fn = objective if key is None else functools.partial(objective, dropout_key=key)
    (loss, metrics), grads = jax.value_and_grad(fn, has_aux=True)(params, exp, denominator, *extra)
    total_loss, total_grads = carry
    mask = exp.loss_mask_BxN
    metrics |= {
      TOKENS: jnp.sum(mask, dtype=jnp.float32),
      ROWS: jnp.sum(jnp.any(mask, axis=-1), dtype=jnp.float32),
    }
    return (total_loss + loss, jax.tree.map(jnp.add, total_grads, grads)), metrics

  zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
  (loss, grads), metrics = jax.lax.scan(one, zero, (micro_exps, keys))
  return loss, grads, combine_metrics(metrics, sum_keys=LOSS_SHARES)


def reduce_metrics(stacked: dict) -> dict:
  """An iteration's per-minibatch metrics to one value each (see `combine_metrics`);
  the counts of loss tokens and rows are dropped."""
  out = combine_metrics(stacked)
  out.pop(TOKENS), out.pop(ROWS)
  return out


def _apply(optimizer, schedule, grads, opt_state, params, enabled):
  """One optimizer step, or none when `enabled` is False (critic warm-up); also the learning
  rate it used (0 when no update was applied: warm-up, or a non-finite gradient)."""
  updates, new_opt_state = optimizer.update(grads, opt_state, params)
  new_params = optax.apply_updates(params, updates)
  keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(enabled, n, o), new, old)
  new_params, new_opt_state = keep(new_params, params), keep(new_opt_state, opt_state)
  before, after = applied_updates(opt_state), applied_updates(new_opt_state)
  learning_rate = jnp.where(after > before, schedule(before), 0.0)
  return new_params, new_opt_state, learning_rate


@rows_over_mesh
def update(
  state: TrainState,
  exp: Experience,
  *,
  policy_def,
  critic_def,
  cfg: TrainConfig,
  algo: Algorithm,
  optimizers,
  mesh=None,
) -> tuple[TrainState, dict]:
  """`ppo_epochs x num_minibatches` optimizer steps on shuffled minibatches; returns the new
  state and per-minibatch metrics stacked on a leading axis. `mesh`: see `spread_rows`."""
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  step = functools.partial(
    _minibatch,
    exp=exp,
    state=state,
    dropout_key=jax.random.fold_in(key, 7919),  # LoRA dropout's, apart from the shuffles'
    policy_def=policy_def,
    critic_def=critic_def,
    cfg=cfg,
    algo=algo,
    optimizers=optimizers,
    mesh=mesh,
  )
  rows_MxUxR = _minibatch_rows(key, cfg)
  carry = (state.policy, state.policy_opt, state.critic, state.critic_opt)
  steps = jnp.arange(rows_MxUxR.shape[0])
  (policy, policy_opt, critic, critic_opt), metrics = jax.lax.scan(step, carry, (rows_MxUxR, steps))
  kl = state.kl
  if cfg.uses_reference:  # the rollout policy's per-sequence KL (the first minibatch's)
    kl = kl_controller(cfg).update(state.kl, metrics["kl_ref"][0], cfg.batch_size)
  step_entropy = combine_metrics({k: metrics[k] for k in ("entropy", TOKENS, ROWS)})
  entropy = entropy_controller(cfg).update(state.entropy, step_entropy["entropy"])
  new = state._replace(
    step=state.step + 1,
    entropy=entropy,
    policy=policy,
    policy_opt=policy_opt,
    critic=critic,
    critic_opt=critic_opt,
    kl=kl,
  )
  return new, metrics


def _minibatch_rows(key, cfg: TrainConfig):
  """`[M, U, R]` row indices: each epoch's shuffle (of whole groups when prompts are shared)
  cut into M minibatches of U micro-batches of R rows."""
  a, B, G = cfg.algo, cfg.batch_size, _group(cfg)
  perms = [
    (G * jax.random.permutation(k, B // G)[:, None] + jnp.arange(G)).reshape(-1)
    for k in jax.random.split(key, a.ppo_epochs)
  ]
  return jnp.concatenate(perms).reshape(a.ppo_epochs * a.num_minibatches, a.micro_batches, -1)


def _minibatch(carry, xs, *, exp, state, dropout_key, policy_def, critic_def, cfg, algo,
               optimizers, mesh):  # fmt: skip
  """One minibatch's policy step (the adapters only, with LoRA) and critic step: the scan
  body of `update`."""
  a = cfg.algo
  rows_UxR, index = xs
  policy, policy_opt, critic, critic_opt = carry
  micro = spread_rows(jax.tree.map(lambda x: x[rows_UxR], exp), mesh)
  mask_RxN = micro.loss_mask_BxN.reshape(-1, micro.loss_mask_BxN.shape[-1])
  denominator = core.aggregate_denominator(mask_RxN, a.aggregation)
  schedules = (
    learning_rate_schedule(cfg, cfg.optim.learning_rate),
    learning_rate_schedule(cfg, a.critic_lr),
  )
  trainable, frozen = lora_lib.split_trainable(policy)  # the base stays as it is
  objective = functools.partial(policy_objective, policy_def=policy_def, cfg=cfg, algo=algo)
  keys = None
  if cfg.lora.dropout:
    keys = jax.random.split(jax.random.fold_in(dropout_key, index), a.micro_batches)
  loss, grads, metrics = _accumulate(
    lambda t, *args, **kw: objective(lora_lib.join_trainable(t, frozen), *args, **kw),
    trainable,
    micro,
    denominator,
    state.kl.coef,
    state.entropy.coef,
    keys=keys,
  )
  policy_on = state.step >= a.critic_warmup_steps
  trainable, policy_opt, lr = _apply(
    optimizers[0], schedules[0], grads, policy_opt, trainable, policy_on
  )
  policy = lora_lib.join_trainable(trainable, frozen)
  metrics = metrics | {"loss": loss, "grad_norm": optax.tree.norm(grads), "learning_rate": lr}
  if critic is not None:
    objective = functools.partial(critic_objective, critic_def=critic_def, cfg=cfg)
    _, c_grads, c_metrics = _accumulate(objective, critic, micro, denominator)
    critic, critic_opt, c_lr = _apply(
      optimizers[1], schedules[1], c_grads, critic_opt, critic, True
    )
    c_metrics.pop(TOKENS), c_metrics.pop(ROWS)
    metrics |= c_metrics
    metrics |= {"critic_grad_norm": optax.tree.norm(c_grads), "critic_learning_rate": c_lr}
  return (policy, policy_opt, critic, critic_opt), metrics
