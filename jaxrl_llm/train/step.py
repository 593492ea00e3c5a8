"""The jitted device side of one iteration: experience (old/ref log-probs, values,
advantages), then `ppo_epochs x num_minibatches` optimizer steps with gradient
accumulation over `micro_batches`.

All functions are pure; `Learner` binds the static pieces (graph definitions,
config, optimizers) and jits them once.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import core
from jaxrl_llm.models import completion_hidden
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models.sharding import BATCH_AXES, rows_over
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.state import (
  TrainState,
  applied_updates,
  entropy_controller,
  join_trainable,
  kl_controller,
  learning_rate_schedule,
  split_trainable,
)


class Batch(NamedTuple):
  """One rollout as the host hands it over: prompts, completions and their scores.

  `truncated_B`: rows cut off at the token budget before their EOS (None: none were).
  `loss_rows_B`: rows that count in the loss (None: all); the host leaves out groups
  that carry no signal when dynamic sampling could not replace them.
  `behav_logp_BxN`: the sampler's log-prob of each completion token under the distribution
  it was drawn from (temperature, top-k, top-p, the params it sampled with): the behaviour
  policy of `config.algo.correction`. None (labelled batches): the trainer's own.
  `model_mask_BxN`: multi-turn episodes (train/episodes.py): the model's tokens among the
  completion's; the environment's replies are attended to but never trained on. None: all.
  `token_rewards_BxN`: each turn's reward on its last token; then `scores_B` is the
  episode's return (their sum), which group estimators use. None: `scores_B` on the last
  token.
  """

  prompt_BxP: jax.Array
  prompt_mask_BxP: jax.Array
  tokens_BxN: jax.Array
  mask_BxN: jax.Array
  scores_B: jax.Array
  truncated_B: jax.Array | None = None
  loss_rows_B: jax.Array | None = None
  behav_logp_BxN: jax.Array | None = None
  model_mask_BxN: jax.Array | None = None
  token_rewards_BxN: jax.Array | None = None


class Experience(NamedTuple):
  """A rollout with everything the losses need, computed before any update.

  `loss_mask_BxN` is the completion mask less the rows the loss leaves out (see
  `Batch.loss_rows_B` and `AlgoSection.truncation`); the forward passes still attend to
  every completion token through `batch.mask_BxN`.
  """

  batch: Batch
  old_logp_BxN: jax.Array
  ref_logp_BxN: jax.Array
  old_values_BxN: jax.Array
  advantages_BxN: jax.Array
  returns_BxN: jax.Array
  loss_mask_BxN: jax.Array


def _hidden(model, batch: Batch, group_size: int, with_last: bool = False):
  return completion_hidden(
    model.decoder,
    batch.prompt_BxP,
    batch.prompt_mask_BxP,
    batch.tokens_BxN,
    batch.mask_BxN,
    group_size,
    with_last=with_last,
  )


def sequence_forward(
  graphdef, params, batch: Batch, temperature, with_entropy=False, group=1, chunk=0
):
  """Teacher-forced log-probs (and entropies) of the completion tokens, float32 `[B, N]`.

  The only function that scores completions: the old log-probs and the
  differentiated ones both come from here, so the first update's ratio is 1.
  `group` > 1: rows come in groups of that size sharing a prompt, which runs once.
  `chunk` > 0: straight from the final hidden states, about `chunk` tokens (rows x
  positions) at a time (`core.hidden_token_logprobs`), so no pass holds `[B, N, V]`
  logits; 0: full logits.
  """
  model = nnx.merge(graphdef, params)
  hidden_BxNxD = _hidden(model, batch, group)
  if chunk:
    return core.hidden_token_logprobs(
      hidden_BxNxD,
      model.unembedding_DxV(),
      batch.tokens_BxN,
      temperature,
      chunk_size=max(1, chunk // batch.tokens_BxN.shape[0]),
      with_entropy=with_entropy,
    )
  logits_BxNxV = model.unembed(hidden_BxNxD)
  logp_BxN = core.token_logprobs(logits_BxNxV, batch.tokens_BxN, temperature)
  if not with_entropy:
    return logp_BxN
  return logp_BxN, core.entropy(logits_BxNxV, temperature)


def sequence_values(graphdef, params, batch: Batch, group=1, with_last=False):
  """The critic's V(s_t) for each completion token t (the state before emitting it), `[B, N]`;
  with `with_last`, `[B, N + 1]`: also V(s_N), the state after the last completion slot."""
  model = nnx.merge(graphdef, params)
  return model.head(_hidden(model, batch, group, with_last))


def _group(cfg: TrainConfig) -> int:
  """Rows per shared prompt in the forward passes (1: no sharing)."""
  return cfg.rollout.group_size if cfg.share_prompts else 1


def spread_rows(tree, mesh):
  """Micro-batched arrays `[U, R, ...]` constrained to split each micro-batch's R rows over the
  mesh's batch axes. Without it the partitioner may keep the sharding of the flat `[B, ...]`
  batch on the micro-batch axis U, so every device would run whole micro-batches (all of
  the activations, none of the split). No-op without a mesh."""
  if mesh is None:
    return tree
  sharding = NamedSharding(mesh, P(None, BATCH_AXES))
  return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, sharding), tree)


def _in_micro_batches(fn, batch: Batch, rows: int, mesh=None):
  """fn over `batch` split into consecutive micro-batches of `rows` (the update's shapes)."""
  split = spread_rows(jax.tree.map(lambda x: x.reshape(-1, rows, *x.shape[1:]), batch), mesh)
  out = jax.lax.map(fn, split)
  return out.reshape(-1, *out.shape[2:])


def trained_tokens(batch: Batch):
  """The completion tokens the policy produced: all of them, or an episode's model turns."""
  if batch.model_mask_BxN is None:
    return batch.mask_BxN
  return batch.mask_BxN & batch.model_mask_BxN


def loss_mask(batch: Batch, cfg: TrainConfig):
  """The completion mask less the environment's tokens and the rows the loss leaves out."""
  rows_B = jnp.ones(batch.mask_BxN.shape[:1], bool)
  if batch.loss_rows_B is not None:
    rows_B = rows_B & batch.loss_rows_B
  if cfg.truncation == "mask" and batch.truncated_B is not None:
    rows_B = rows_B & ~batch.truncated_B
  return trained_tokens(batch) & rows_B[:, None]


def state_after_last_token(mask_BxN):
  """`[B]` int: the index into `[B, N + 1]` values of the state after each row's last real
  token (the count of slots up to and including it; 0 for an empty row)."""
  N = mask_BxN.shape[-1]
  real_BxN = mask_BxN > 0
  return jnp.where(real_BxN.any(-1), N - jnp.argmax(real_BxN[:, ::-1], axis=-1), 0)


def _rows_over_mesh(fn):
  """Traces `fn` with the model's activations split by rows over its `mesh` argument."""

  @functools.wraps(fn)
  def traced(*args, mesh=None, **kwargs):
    with rows_over(mesh):
      return fn(*args, mesh=mesh, **kwargs)

  return traced


@_rows_over_mesh
def make_experience(
  state: TrainState,
  batch: Batch,
  *,
  policy_def,
  critic_def,
  cfg: TrainConfig,
  mesh=None,
  base_def=None,
) -> tuple[Experience, dict]:
  """Old and reference log-probs, values, token rewards and advantages. `mesh`: the mesh
  the batch is sharded over (see `spread_rows`). With LoRA the reference is the frozen
  base inside the policy, run by `base_def` (the graph without adapters): no copy."""
  a, rows, group = cfg.algo, cfg.micro_batch_rows, _group(cfg)
  temperature = cfg.rollout.temperature
  mask_BxN = loss_mask(batch, cfg)

  def logp(params, graphdef=policy_def):
    return _in_micro_batches(
      lambda b: sequence_forward(
        graphdef, params, b, temperature, group=group, chunk=cfg.model.logprob_chunk_tokens
      ),
      batch,
      rows,
      mesh,
    )

  zeros = jnp.zeros(mask_BxN.shape, jnp.float32)
  old_logp = zeros if cfg.single_update else logp(state.policy)  # see TrainConfig.single_update
  ref_logp = zeros
  if state.ref is not None:
    ref_logp = logp(state.ref)
  elif cfg.uses_reference:  # LoRA: the base with the adapters off
    ref_logp = logp(split_trainable(cfg, state.policy)[1], base_def or policy_def)
  values, bootstrap_B = zeros, zeros[:, 0]
  if state.critic is not None:
    values_BxN1 = _in_micro_batches(
      lambda b: sequence_values(critic_def, state.critic, b, group, with_last=True),
      batch,
      rows,
      mesh,
    )
    values = values_BxN1[:, :-1]
    if cfg.truncation == "bootstrap" and batch.truncated_B is not None:
      # A cut-off row did not end: its return continues from the value of the state after
      # its last real token (an episode may stop short of slot N when a reply cannot fit).
      after_B = state_after_last_token(batch.mask_BxN)
      v_after_B = jnp.take_along_axis(values_BxN1, after_B[:, None], axis=1)[:, 0]
      bootstrap_B = jnp.where(batch.truncated_B, v_after_B, 0.0)
  kl_BxN = jnp.where(mask_BxN, core.kl_penalty(old_logp, ref_logp, a.kl_estimator), 0.0)
  if batch.token_rewards_BxN is None:
    rewards_BxN = core.scores_to_token_rewards(batch.scores_B, mask_BxN)
  else:  # each turn's reward on its last model token
    rewards_BxN = jnp.where(mask_BxN, batch.token_rewards_BxN, 0.0)
  if a.kl_placement == "reward" and cfg.uses_reference:
    rewards_BxN = rewards_BxN - state.kl.coef * kl_BxN
  returns = zeros
  if a.estimator in core.TOKEN_ESTIMATORS:
    adv, returns = core.TOKEN_ESTIMATORS[a.estimator].fn(
      rewards_BxN, values, mask_BxN, bootstrap_value_B=bootstrap_B, **cfg.estimator_kwargs()
    )
  else:
    adv_B = core.group_advantages(
      batch.scores_B,
      group_size=cfg.rollout.group_size,
      estimator=a.estimator,
      lengths=mask_BxN.sum(-1),
      **({"eps": a.adv_eps} | cfg.estimator_kwargs()),  # estimator_kwargs' eps wins
    )
    adv = jnp.where(mask_BxN, adv_B[:, None], 0.0)
  exp = Experience(batch, old_logp, ref_logp, values, adv, returns, mask_BxN)
  return exp, {
    "kl_coef": state.kl.coef,
    "entropy_coef": state.entropy.coef,
    "advantage_abs_mean": core.masked_mean(jnp.abs(adv), mask_BxN),
  }


def policy_objective(
  params,
  exp: Experience,
  denominator,
  kl_coef,
  entropy_coef=0.0,
  *,
  policy_def,
  cfg: TrainConfig,
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
    a.policy_loss,
    logp,
    old_logp,
    jax.lax.stop_gradient(old_logp) if behav is None else behav,
    exp.advantages_BxN,
    mask,
    correction=a.correction,
    correction_kwargs=cfg.correction_kwargs(),
    **cfg.policy_loss_kwargs(),
  )
  pg_loss = agg(pg_BxN)
  loss = pg_loss
  if a.kl_placement == "loss" and a.kl_coef > 0:
    loss = loss + kl_coef * agg(core.kl_penalty(logp, exp.ref_logp_BxN, a.kl_estimator))
  if a.entropy_coef or a.entropy_target is not None:
    loss = loss - entropy_coef * agg(ent)
  metrics = metrics | {"pg_loss": pg_loss, "entropy": core.masked_mean(ent, mask)}
  if cfg.uses_reference:  # per-sequence KL to the reference: the configured estimator, and k3
    in_loss_B = jnp.any(mask, axis=-1)  # rows with no loss token would dilute the mean
    for name, estimator in (("kl_ref", a.kl_estimator), ("kl_ref_k3", "k3")):
      kl_BxN = core.kl_penalty(jax.lax.stop_gradient(logp), exp.ref_logp_BxN, estimator)
      metrics[name] = core.masked_mean(jnp.sum(jnp.where(mask, kl_BxN, 0.0), axis=-1), in_loss_B)
  return loss, metrics


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


@_rows_over_mesh
def update(
  state: TrainState,
  exp: Experience,
  *,
  policy_def,
  critic_def,
  cfg: TrainConfig,
  optimizers,
  mesh=None,
) -> tuple[TrainState, dict]:
  """`ppo_epochs x num_minibatches` optimizer steps on shuffled minibatches; returns the new
  state and per-minibatch metrics stacked on a leading axis. `mesh`: see `spread_rows`."""
  a = cfg.algo
  B = cfg.batch_size
  key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
  G = _group(cfg)  # with shared prompts, whole groups are shuffled
  perms = [
    (G * jax.random.permutation(k, B // G)[:, None] + jnp.arange(G)).reshape(-1)
    for k in jax.random.split(key, a.ppo_epochs)
  ]
  rows_MxUxR = jnp.concatenate(perms).reshape(a.ppo_epochs * a.num_minibatches, a.micro_batches, -1)
  policy_on = state.step >= a.critic_warmup_steps
  dropout_key = jax.random.fold_in(key, 7919)  # LoRA dropout's, apart from the shuffles'
  schedules = (
    learning_rate_schedule(cfg, cfg.optim.learning_rate),
    learning_rate_schedule(cfg, a.critic_lr),
  )

  def minibatch(carry, xs):
    rows_UxR, index = xs
    policy, policy_opt, critic, critic_opt = carry
    micro = spread_rows(jax.tree.map(lambda x: x[rows_UxR], exp), mesh)
    mask_RxN = micro.loss_mask_BxN.reshape(-1, micro.loss_mask_BxN.shape[-1])
    denominator = core.aggregate_denominator(mask_RxN, a.aggregation)
    # With LoRA only the adapters are differentiated and updated; the base stays as it is.
    trainable, frozen = split_trainable(cfg, policy)
    objective = functools.partial(policy_objective, policy_def=policy_def, cfg=cfg)
    keys = None
    if cfg.lora.dropout:
      keys = jax.random.split(jax.random.fold_in(dropout_key, index), a.micro_batches)
    loss, grads, metrics = _accumulate(
      lambda t, *args, **kw: objective(join_trainable(t, frozen), *args, **kw),
      trainable,
      micro,
      denominator,
      state.kl.coef,
      state.entropy.coef,
      keys=keys,
    )
    trainable, policy_opt, lr = _apply(
      optimizers[0], schedules[0], grads, policy_opt, trainable, policy_on
    )
    policy = join_trainable(trainable, frozen)
    metrics = metrics | {"loss": loss, "grad_norm": optax.tree.norm(grads), "learning_rate": lr}
    if critic is not None:
      _, c_grads, c_metrics = _accumulate(
        functools.partial(critic_objective, critic_def=critic_def, cfg=cfg),
        critic,
        micro,
        denominator,
      )
      critic, critic_opt, c_lr = _apply(
        optimizers[1], schedules[1], c_grads, critic_opt, critic, True
      )
      c_metrics.pop(TOKENS), c_metrics.pop(ROWS)
      metrics = metrics | c_metrics
      metrics |= {"critic_grad_norm": optax.tree.norm(c_grads), "critic_learning_rate": c_lr}
    return (policy, policy_opt, critic, critic_opt), metrics

  carry = (state.policy, state.policy_opt, state.critic, state.critic_opt)
  steps = jnp.arange(rows_MxUxR.shape[0])
  (policy, policy_opt, critic, critic_opt), metrics = jax.lax.scan(
    minibatch, carry, (rows_MxUxR, steps)
  )
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
