"""Builds the models, the sharded train state and the jitted programs for a config."""

import functools
import weakref

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding

from jaxrl_llm.models import (
  CausalLM,
  CheckpointError,
  ModelConfig,
  ValueModel,
  end_token_ids,
  hosts,
  load_model,
)
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models.sharding import (
  DEFAULT_RULES,
  ShardingRules,
  batch_size_divisor,
  param_shardings,
)
from jaxrl_llm.rollout import SampleOutput, generate, layout, turns
from jaxrl_llm.train import state as state_lib
from jaxrl_llm.train import step as step_lib
from jaxrl_llm.train.checkpoint import fingerprint
from jaxrl_llm.train.config import ConfigError, TrainConfig


def model_config(cfg: TrainConfig, vocab_size: int, eos_id: int) -> ModelConfig:
  m = cfg.model
  return ModelConfig(
    vocab_size=vocab_size,
    hidden_size=m.hidden_size,
    intermediate_size=m.intermediate_size,
    num_layers=m.num_layers,
    num_heads=m.num_heads,
    num_kv_heads=m.num_kv_heads,
    head_dim=m.head_dim,
    qkv_bias=m.architecture == "qwen2",
    tie_word_embeddings=m.tie_word_embeddings,
    architecture=m.architecture,
    eos_token_id=eos_id,
    max_position_embeddings=4096,
    param_dtype=jnp.dtype(m.param_dtype),
    dtype=jnp.dtype(m.dtype),
    remat=m.remat,
    scan_layers=m.scan_layers,
    attention_chunk=m.attention_chunk,
  )


def policy_graphdef(cfg: TrainConfig, model_cfg: ModelConfig) -> nnx.GraphDef:
  """The graph the trainer differentiates: the model, with the configured adapters."""
  lora = state_lib.lora_config(cfg)
  make = lambda: CausalLM(model_cfg.replace(lora=lora), rngs=nnx.Rngs(0))
  return nnx.split(nnx.eval_shape(make))[0]


def jitted_steps(cfg: TrainConfig, mesh, policy_def, critic_def, optimizers, base_def=None):
  """The jitted experience pass and update the trainer runs (the update donates the state);
  `jaxrl_llm.plan` compiles the same two. `base_def`: with LoRA, the graph without
  adapters, which scores the reference."""
  algo = step_lib.algorithm(cfg)  # the registered functions, their hyperparameters bound
  statics = dict(policy_def=policy_def, critic_def=critic_def, cfg=cfg, algo=algo, mesh=mesh)
  experience = jax.jit(
    functools.partial(step_lib.make_experience, base_def=base_def or policy_def, **statics)
  )
  update = jax.jit(
    functools.partial(step_lib.update, optimizers=optimizers, **statics), donate_argnums=0
  )
  return experience, update


class Learner:
  """The policy (and critic) on a mesh, the TrainState, and jitted experience/update steps.

  `policy` holds the base model's params until `init_state` (the warm start trains them,
  with `base_def`); the state's policy is `state_lib.with_adapters` of them, run with
  `policy_def` (the same graph without LoRA).
  """

  def __init__(
    self,
    cfg: TrainConfig,
    mesh,
    vocab_size: int,
    eos_id: int,
    pad_id: int,
    rules: ShardingRules = DEFAULT_RULES,
  ):
    self.cfg, self.mesh, self.rules = cfg, mesh, rules
    self.eos_id, self.pad_id = eos_id, pad_id
    declared = ()  # the end ids a checkpoint declares besides the tokenizer's EOS
    if cfg.model.path:
      place = lambda axes, shape: NamedSharding(mesh, rules.spec(axes, shape, mesh))
      try:
        declared = end_token_ids(cfg.model.path)
        policy_model = load_model(
          cfg.model.path,
          dtype=jnp.dtype(cfg.model.dtype),
          param_dtype=jnp.dtype(cfg.model.param_dtype),
          sharding=place,
          remat=cfg.model.remat,
          scan_layers=cfg.model.scan_layers,
          attention_chunk=cfg.model.attention_chunk,
        )
      except CheckpointError as e:
        raise ConfigError(f"config.model.path={cfg.model.path!r}: {e}") from None
      self.base_def, policy = nnx.split(policy_model)
      self.model_cfg = policy_model.cfg
    else:
      self.model_cfg = model_config(cfg, vocab_size, eos_id)
      self.base_def, policy = self._init_params(
        lambda: CausalLM(self.model_cfg, rngs=nnx.Rngs(cfg.run.seed))
      )
    self.policy_def = policy_graphdef(cfg, self.model_cfg)
    # Generation stops on the tokenizer's EOS and on every end id the checkpoint declares.
    self.eos_ids = tuple(sorted({eos_id, *declared}))
    self.critic_def = None
    if cfg.uses_critic:
      self.critic_def, _ = nnx.split(
        nnx.eval_shape(lambda: ValueModel(self.model_cfg, rngs=nnx.Rngs(0)))
      )
    self.policy = policy
    self.optimizers = state_lib.make_optimizers(cfg)
    self.state = None
    self._base_fingerprint = None
    self._decode_copy = None  # (decode mesh, the params' arrays, their decode-layout copy)
    self._decode_tensor = {}  # mesh -> rollout.tensor's default on it
    self._experience, self._update = jitted_steps(
      cfg, mesh, self.policy_def, self.critic_def, self.optimizers, self.base_def
    )

  def _init_params(self, make_module):
    """Shape first: abstract module, then shardings, then a jitted init straight onto them."""
    graphdef, abstract = nnx.split(nnx.eval_shape(make_module))
    shardings = param_shardings(abstract, self.mesh, self.rules)
    init = jax.jit(lambda: nnx.split(make_module())[1], out_shardings=shardings)
    return graphdef, init()

  def critic_from_policy(self, policy):
    """A value model whose backbone is the (warm-started) policy's, head freshly initialised."""
    make = lambda: ValueModel.from_policy(
      nnx.merge(self.base_def, policy), rngs=nnx.Rngs(self.cfg.run.seed + 1)
    )
    return self._init_params(make)[1]

  def _state_init(self):
    cfg = self.cfg

    def init(base, critic):
      policy = state_lib.with_adapters(cfg, self.base_def, base)
      return state_lib.init_train_state(
        cfg, policy, critic, optimizers=self.optimizers, seed=cfg.run.seed
      )

    return init

  def _shardings(self, abstract):
    return state_lib.state_shardings(self.cfg, abstract, self.mesh, self.optimizers, self.rules)

  def init_state(self):
    """The TrainState, from the current policy params; its shardings decided shape-first."""
    critic = self.critic_from_policy(self.policy) if self.cfg.uses_critic else None
    init = self._state_init()
    shardings = self._shardings(jax.eval_shape(init, self.policy, critic))
    self.state = jax.jit(init, out_shardings=shardings)(self.policy, critic)
    return self.state

  def state_target(self):
    """The TrainState as ShapeDtypeStructs carrying this mesh's shardings: what a
    checkpoint restores onto. Nothing is computed."""
    critic = None
    if self.cfg.uses_critic:
      critic = nnx.split(nnx.eval_shape(lambda: ValueModel(self.model_cfg, rngs=nnx.Rngs(0))))[1]
    abstract = jax.eval_shape(self._state_init(), self.policy, critic)
    return self.saved(state_lib.with_shardings(abstract, self._shardings(abstract)))

  @property
  def base_saved(self) -> bool:
    """Whether checkpoints hold the frozen LoRA base: not when it is `model.path`'s weights
    as they load (checkpoints then name the path and the weights' fingerprint); yes when
    the run made it (random init, or a warm start)."""
    return not (self.cfg.model.path and not self.cfg.warmstart.steps)

  def saved(self, state):
    """What a checkpoint holds of `state` (a state or its target): all of it, less the frozen
    LoRA base when `base_saved` is False."""
    if not self.cfg.lora.rank or self.base_saved:
      return state
    return state._replace(policy=lora_lib.split_trainable(state.policy)[0])

  def restored(self, state, meta: dict):
    """A restored checkpoint's state, whole again: the base that `saved` left out (built
    from `policy` as `init_state` builds it) joined back, once its fingerprint matches the
    one the checkpoint recorded."""
    if not self.cfg.lora.rank or self.base_saved:
      return state
    if self.state is None:
      self.init_state()
    recorded = meta.get("lora_base", {})
    if recorded.get("fingerprint") != self.base_fingerprint():
      raise ConfigError(
        f"the checkpoint's adapters were trained on the base at {recorded.get('path')!r}, and "
        f"the weights now at config.model.path={self.cfg.model.path!r} differ from it "
        "(or are quantized differently). Point config.model.path at that base, or start "
        "over with --config.checkpoint.fresh=True."
      )
    frozen = lora_lib.split_trainable(self.state.policy)[1]
    return state._replace(policy=lora_lib.join_trainable(state.policy, frozen))

  def base_fingerprint(self) -> list[int]:
    """The frozen LoRA base's per-array fingerprint (see `checkpoint.fingerprint`), computed
    once: the base never changes."""
    if self._base_fingerprint is None:
      frozen = lora_lib.split_trainable(self.state.policy)[1]
      self._base_fingerprint = [int(v) for v in jax.device_get(fingerprint(frozen))]
    return self._base_fingerprint

  def shard_batch(self, tree):
    """Global batch-sharded arrays from this process's rows (all rows with one process)."""
    return hosts.global_batch(self.mesh, tree)

  def generate(
    self,
    params,
    prompt_BxP,
    mask_BxP,
    rng,
    *,
    num_samples,
    temperature,
    max_new_tokens=None,
    mesh=None,
    eos_ids=None,
    trim=True,
  ) -> SampleOutput:
    """Samples from `params`: the state's policy, or before `init_state` the base's. `mesh`:
    the mesh the params and prompts are on (default: the learner's). `eos_ids`: the ids that
    end a completion (default: the model's end ids); `trim`: see `rollout.generate`."""
    r = self.cfg.rollout
    graphdef = self.base_def if self.state is None else self.policy_def
    mesh = self.decode_mesh(self.mesh if mesh is None else mesh)
    return generate(
      graphdef,
      prompt_BxP,
      mask_BxP,
      rng,
      params=self.decode_params(params, mesh),
      mesh=mesh,
      max_rows=r.max_rows,
      static=r.sampler == "static",
      decode_slots=r.decode_slots,
      page_size=r.page_size,
      prefill_chunk=r.prefill_chunk,
      max_new_tokens=max_new_tokens or r.max_new_tokens,
      **dict(zip(("temperature", "top_k", "top_p"), self.sampling(temperature), strict=True)),
      eos_ids=self.eos_ids if eos_ids is None else eos_ids,
      num_samples=num_samples,
      pad_id=self.pad_id,
      trim=trim,
    )

  def sampling(self, temperature) -> tuple:
    """(temperature, top_k, top_p) as the sampler takes them: the config's truncation, none
    when greedy."""
    r = self.cfg.rollout
    top_k = (r.top_k or None) if temperature else None
    return float(temperature), top_k, (None if r.top_p == 1.0 else r.top_p) if temperature else None

  def turn_decoder(self, params, num_rows, prompt_width, episode_tokens, temperature, eos_ids):
    """A multi-turn decoder (`rollout.turns.Decoder`) of `num_rows` episodes from `params` on
    the learner's decode mesh: each episode keeps its slot and KV pages across its turns."""
    r = self.cfg.rollout
    graphdef = self.base_def if self.state is None else self.policy_def
    mesh = self.decode_mesh(self.mesh)
    lay = turns.layout(
      num_rows,
      prompt_width,
      r.max_new_tokens,
      episode_tokens,
      batch_size_divisor(mesh),
      page_size=r.page_size,
      prefill_chunk=r.prefill_chunk,
    )
    return turns.Decoder(
      graphdef,
      self.decode_params(params, mesh),
      lay,
      sampling=self.sampling(temperature),
      eos_ids=eos_ids,
      pad_id=self.pad_id,
      mesh=mesh,
    )

  def decode_mesh(self, mesh):
    """The sampler's decode mesh over `mesh`'s devices (see `rollout.layout`)."""
    tensor = self.cfg.rollout.tensor
    if not tensor:  # the weights' bytes never change: chosen once per mesh
      tensor = self._decode_tensor.get(mesh)
      if tensor is None:
        weights = layout.weight_bytes(
          self.policy if self.state is None else self.state.policy, self.model_cfg.dtype
        )
        tensor = layout.choose_tensor(mesh, weights, layout.device_memory(mesh))
        self._decode_tensor[mesh] = tensor
    return layout.decode_mesh(mesh, tensor)

  def decode_params(self, params, decode_mesh):
    """`params` in the decode layout on `decode_mesh`: made once per version of the params
    (the last copy is kept, so the turns of an episode and the batches of an evaluation
    reuse it, and replaced when they change; it holds the params by weak reference)."""
    leaves = jax.tree.leaves(params)
    cached = self._decode_copy
    if cached is not None and cached[0] == decode_mesh and len(cached[1]) == len(leaves):
      if all(ref() is x for ref, x in zip(cached[1], leaves, strict=True)):
        return cached[2]
    self._decode_copy = None  # free the old copy before making the new one
    copy = layout.to_decode_layout(params, decode_mesh, self.model_cfg.dtype)
    self._decode_copy = (decode_mesh, [weakref.ref(x) for x in leaves], copy)
    return copy

  def experience(self, batch: step_lib.Batch):
    return self._experience(self.state, batch)

  def update(self, exp: step_lib.Experience):
    self.state, metrics = self._update(self.state, exp)
    return metrics

  @property
  def num_params(self) -> int:
    return sum(x.size for x in jax.tree.leaves(self.state.policy if self.state else self.policy))
