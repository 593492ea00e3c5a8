"""The train state pytree, its optimizers, and its sharded, shape-first construction."""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm import core
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models.sharding import DEFAULT_RULES, param_shardings
from jaxrl_llm.train.config import ConfigError, TrainConfig

NO_LIMIT = 2**31 - 1  # apply_if_finite never gives up by itself; the host loop decides


class TrainState(NamedTuple):
  """Everything that changes during training, as one pytree (orbax saves it as it is).

  `rng` is raw key data (uint32), so it checkpoints like any array. The critic
  fields are None without a critic, `ref` is None without a KL term. `kl` and
  `entropy` are the coefficient controllers' states.
  """

  step: jax.Array
  rng: jax.Array
  policy: nnx.State
  policy_opt: optax.OptState
  ref: nnx.State | None
  critic: nnx.State | None
  critic_opt: optax.OptState | None
  kl: core.KLControllerState
  entropy: core.EntropyControllerState


def lora_config(cfg: TrainConfig) -> lora_lib.LoraConfig | None:
  """The adapters `config.lora` asks for (None: full fine-tuning)."""
  c = cfg.lora
  if not c.rank:
    return None
  targets = lora_lib.resolve_targets(c.targets)
  return lora_lib.LoraConfig(rank=c.rank, alpha=c.alpha, targets=targets, dropout=c.dropout)


def with_adapters(cfg: TrainConfig, base_def: nnx.GraphDef, base: nnx.State) -> nnx.State:
  """The policy params a run trains: `base` itself, or with LoRA the base (quantized when
  `config.lora.quantize` says so) plus fresh adapters (B = 0, so the policy starts as the
  base). Traceable: the trainer runs it inside its jitted state init."""
  lora = lora_config(cfg)
  if lora is None:
    return base
  model = nnx.merge(base_def, base)
  if cfg.lora.quantize:
    try:
      model = lora_lib.quantize_base(model, cfg.lora.quantize, cfg.lora.quant_tile)
    except ValueError as e:
      raise ConfigError(f"config.lora.quant_tile={cfg.lora.quant_tile}: {e}") from None
  return nnx.state(lora_lib.add_adapters(model, lora, seed=cfg.run.seed + 5))


def learning_rate_schedule(cfg: TrainConfig, peak: float) -> optax.Schedule:
  """Linear warmup to `peak`, then constant or cosine decay to 0 at the last step."""
  warmup = cfg.optim.warmup_steps
  if cfg.optim.schedule == "cosine":
    return optax.warmup_cosine_decay_schedule(
      0.0, peak, max(warmup, 1), max(cfg.run.steps * _updates_per_step(cfg), warmup + 1)
    )
  if warmup == 0:
    return optax.constant_schedule(peak)
  return optax.join_schedules(
    [optax.linear_schedule(0.0, peak, warmup), optax.constant_schedule(peak)], [warmup]
  )


def _updates_per_step(cfg: TrainConfig) -> int:
  return cfg.algo.ppo_epochs * cfg.algo.num_minibatches


def make_optimizer(cfg: TrainConfig, peak_lr: float) -> optax.GradientTransformation:
  """Global-norm clipping then AdamW; a non-finite gradient skips the update (and is counted
  in the state's `notfinite_count`)."""
  o = cfg.optim
  inner = optax.chain(
    optax.clip_by_global_norm(o.grad_clip),
    optax.adamw(
      learning_rate_schedule(cfg, peak_lr), b1=o.b1, b2=o.b2, weight_decay=o.weight_decay
    ),
  )
  return optax.apply_if_finite(inner, max_consecutive_errors=NO_LIMIT)


def make_optimizers(cfg: TrainConfig) -> tuple:
  """The policy's and the critic's optimizers, at their configured peak learning rates."""
  return make_optimizer(cfg, cfg.optim.learning_rate), make_optimizer(cfg, cfg.algo.critic_lr)


def with_shardings(tree, shardings):
  """ShapeDtypeStructs of `tree`'s arrays carrying `shardings` (a prefix of `tree`, such as
  one sharding per Variable of a state)."""
  return jax.tree.map(
    lambda s, a: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), a),
    shardings,
    tree,
  )


def applied_updates(opt_state: optax.OptState) -> jax.Array:
  """How many updates an optimizer from `make_optimizer` has applied: its learning-rate
  schedule's step count, which neither a skipped (non-finite) update nor a held one
  (critic warm-up) advances."""
  for path, count in optax.tree.get_all_with_path(opt_state, "count"):
    if getattr(path[-1], "tuple_name", None) == "ScaleByScheduleState":
      return count
  raise ValueError("the optimizer state has no learning-rate schedule count.")


def kl_controller(cfg: TrainConfig) -> core.KLController:
  a = cfg.algo
  return core.kl_controller(a.kl_mode, a.kl_coef, target=a.kl_target, horizon=a.kl_horizon)


def entropy_controller(cfg: TrainConfig) -> core.EntropyController:
  a = cfg.algo
  return core.entropy_controller(
    a.entropy_coef, target=a.entropy_target, step_size=a.entropy_step, max_coef=a.entropy_coef_max
  )


def opt_shardings(optimizer, opt_state, params, replicated):
  """An optimizer state's shardings: moments like their params' (`params`: a sharding per
  Variable), the rest (counts) `replicated`."""
  return optax.tree_map_params(
    optimizer,
    lambda _, s: s,
    opt_state,
    params,
    transform_non_params=lambda _: replicated,
    is_leaf=lambda x: isinstance(x, nnx.Variable),
  )


def state_shardings(
  cfg: TrainConfig, abstract: TrainState, mesh, optimizers, rules=DEFAULT_RULES
) -> TrainState:
  """NamedShardings for every leaf: params by their logical axes, optimizer moments like
  their params, scalars and keys replicated."""
  replicated = NamedSharding(mesh, P())

  def params(state):
    return None if state is None else param_shardings(state, mesh, rules)

  def opt(opt_state, param_state, optimizer):
    if opt_state is None:
      return None
    return opt_shardings(optimizer, opt_state, params(param_state), replicated)

  return TrainState(
    step=replicated,
    rng=replicated,
    policy=params(abstract.policy),
    policy_opt=opt(
      abstract.policy_opt, lora_lib.split_trainable(abstract.policy)[0], optimizers[0]
    ),
    ref=params(abstract.ref),
    critic=params(abstract.critic),
    critic_opt=opt(abstract.critic_opt, abstract.critic, optimizers[1]),
    kl=jax.tree.map(lambda _: replicated, abstract.kl),
    entropy=jax.tree.map(lambda _: replicated, abstract.entropy),
  )


def init_train_state(
  cfg: TrainConfig, policy: nnx.State, critic: nnx.State | None, optimizers, seed: int
) -> TrainState:
  """Builds the state from (possibly already placed) params (`with_adapters`' result); the
  reference is a copy, except with LoRA, whose reference is the base with the adapters off."""
  policy_opt = optimizers[0].init(lora_lib.split_trainable(policy)[0])
  ref = jax.tree.map(jnp.copy, policy) if cfg.uses_reference and not cfg.lora.rank else None
  critic_opt = None if critic is None else optimizers[1].init(critic)
  return TrainState(
    step=jnp.zeros((), jnp.int32),
    rng=jax.random.key_data(jax.random.key(seed)),
    policy=policy,
    policy_opt=policy_opt,
    ref=ref,
    critic=critic,
    critic_opt=critic_opt,
    kl=kl_controller(cfg).init(),
    entropy=entropy_controller(cfg).init(),
  )
