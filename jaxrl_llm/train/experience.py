"""The experience pass: everything the losses need, computed once per rollout before any
update (old and reference log-probs, values, token rewards, advantages), and the forward
passes every step shares.

`Algorithm` holds the registered functions a run calls, with their hyperparameters bound
when the step functions are built (`algorithm(cfg)`), so traced code neither parses the
config's JSON objects nor looks names up in registries.
"""

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import core
from jaxrl_llm.models import completion_hidden
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models.sharding import BATCH_AXES, rows_over
from jaxrl_llm.rollout.batch import Batch
from jaxrl_llm.train.config import TrainConfig
from jaxrl_llm.train.state import TrainState


class Algorithm(NamedTuple):
  """A run's registered functions with their hyperparameters bound.

  `policy_loss(logp, old_logp, adv, mask, *, axis_name)` and `correction(old_logp,
  behav_logp, mask, *, axis_name)` as in `core`; `estimator`: a token estimator
  (`token_level`: `(rewards, values, mask, *, bootstrap_value_B)`) or a group one
  (`(scores_NxG, *, lengths_NxG, axis_name)`).
  """

  policy_loss: Callable
  correction: Callable
  estimator: Callable
  token_level: bool


def algorithm(cfg: TrainConfig) -> Algorithm:
  """The functions `cfg.algo` names, each bound to its keyword arguments (validated)."""
  a = cfg.algo
  token = core.TOKEN_ESTIMATORS.get(a.estimator)
  if token is not None:
    estimator = functools.partial(token.fn, **cfg.estimator_kwargs())
  else:
    group_fn = core.GROUP_ESTIMATORS[a.estimator]
    estimator = functools.partial(group_fn, eps=a.adv_eps, **cfg.estimator_kwargs())
  return Algorithm(
    policy_loss=functools.partial(core.POLICY_LOSSES[a.policy_loss], **cfg.policy_loss_kwargs()),
    correction=functools.partial(core.CORRECTIONS[a.correction], **cfg.correction_kwargs()),
    estimator=estimator,
    token_level=token is not None,
  )


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


def rows_over_mesh(fn):
  """Traces `fn` with the model's activations split by rows over its `mesh` argument."""

  @functools.wraps(fn)
  def traced(*args, mesh=None, **kwargs):
    with rows_over(mesh):
      return fn(*args, mesh=mesh, **kwargs)

  return traced


@rows_over_mesh
def make_experience(
  state: TrainState,
  batch: Batch,
  *,
  policy_def,
  critic_def,
  cfg: TrainConfig,
  algo: Algorithm,
  mesh=None,
  base_def=None,
) -> tuple[Experience, dict]:
  """Old and reference log-probs, values, token rewards and advantages. `mesh`: the mesh
  the batch is sharded over (see `spread_rows`). With LoRA the reference is the frozen
  base inside the policy, run by `base_def` (the graph without adapters): no copy."""
  mask_BxN = loss_mask(batch, cfg)
  logp = functools.partial(_micro_batched_logp, batch=batch, cfg=cfg, mesh=mesh)
  zeros = jnp.zeros(mask_BxN.shape, jnp.float32)
  old_logp = zeros if cfg.single_update else logp(policy_def, state.policy)  # single_update
  ref_logp = zeros
  if state.ref is not None:
    ref_logp = logp(policy_def, state.ref)
  elif cfg.uses_reference:  # LoRA: the base with the adapters off
    ref_logp = logp(base_def or policy_def, lora_lib.split_trainable(state.policy)[1])
  values, bootstrap_B = _values_and_bootstrap(state, batch, critic_def, cfg, mesh)
  rewards_BxN = _token_rewards(batch, mask_BxN, old_logp, ref_logp, state.kl.coef, cfg)
  returns = zeros
  if algo.token_level:
    adv, returns = algo.estimator(rewards_BxN, values, mask_BxN, bootstrap_value_B=bootstrap_B)
  else:
    adv_B = core.group_advantages(
      batch.scores_B, group_size=cfg.rollout.group_size, estimator=algo.estimator,
      lengths=mask_BxN.sum(-1),
    )  # fmt: skip
    adv = jnp.where(mask_BxN, adv_B[:, None], 0.0)
  exp = Experience(batch, old_logp, ref_logp, values, adv, returns, mask_BxN)
  return exp, {
    "kl_coef": state.kl.coef,
    "entropy_coef": state.entropy.coef,
    "advantage_abs_mean": core.masked_mean(jnp.abs(adv), mask_BxN),
  }


def _micro_batched_logp(graphdef, params, *, batch: Batch, cfg: TrainConfig, mesh):
  """Teacher-forced log-probs of the whole batch, a micro-batch of the update's at a time."""
  forward = lambda b: sequence_forward(
    graphdef, params, b, cfg.rollout.temperature, group=_group(cfg),
    chunk=cfg.model.logprob_chunk_tokens,
  )  # fmt: skip
  return _in_micro_batches(forward, batch, cfg.micro_batch_rows, mesh)


def _values_and_bootstrap(state: TrainState, batch: Batch, critic_def, cfg: TrainConfig, mesh):
  """The critic's V(s_t) per completion token, and each cut-off row's bootstrap value (zeros
  without a critic)."""
  zeros = jnp.zeros(batch.mask_BxN.shape, jnp.float32)
  if state.critic is None:
    return zeros, zeros[:, 0]
  values_BxN1 = _in_micro_batches(
    lambda b: sequence_values(critic_def, state.critic, b, _group(cfg), with_last=True),
    batch,
    cfg.micro_batch_rows,
    mesh,
  )
  bootstrap_B = zeros[:, 0]
  if cfg.truncation == "bootstrap" and batch.truncated_B is not None:
    # A cut-off row did not end: its return continues from the value of the state after
    # its last real token (an episode may stop short of slot N when a reply cannot fit).
    after_B = state_after_last_token(batch.mask_BxN)
    v_after_B = jnp.take_along_axis(values_BxN1, after_B[:, None], axis=1)[:, 0]
    bootstrap_B = jnp.where(batch.truncated_B, v_after_B, 0.0)
  return values_BxN1[:, :-1], bootstrap_B


def _token_rewards(batch: Batch, mask_BxN, old_logp, ref_logp, kl_coef, cfg: TrainConfig):
  """Each row's score on its last loss token (or each turn's on its own), less the per-token
  KL to the reference when the KL sits in the reward."""
  a = cfg.algo
  if batch.token_rewards_BxN is None:
    rewards_BxN = core.scores_to_token_rewards(batch.scores_B, mask_BxN)
  else:  # each turn's reward on its last model token
    rewards_BxN = jnp.where(mask_BxN, batch.token_rewards_BxN, 0.0)
  if a.kl_placement == "reward" and cfg.uses_reference:
    kl_BxN = jnp.where(mask_BxN, core.kl_penalty(old_logp, ref_logp, a.kl_estimator), 0.0)
    rewards_BxN = rewards_BxN - kl_coef * kl_BxN
  return rewards_BxN
