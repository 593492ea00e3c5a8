"""The run's four device programs, built from abstract state and compiled for any devices.

A configured run executes, per iteration: the sampler's prefill, its decode step (the body of
the decode loop, `rollout.max_new_tokens` times), the experience pass (old and reference
log-probs, values) and the update. `abstract_run` builds the run's state as
ShapeDtypeStructs on a mesh of the target's devices, with the trainer's own sharding rules,
and `programs` gives each program as the trainer jits it, with its abstract arguments. No
weights are loaded and nothing runs.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.layout import Format, Layout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl_llm.models import CausalLM, ModelConfig, ValueModel, paged
from jaxrl_llm.models.config import from_hf_config
from jaxrl_llm.models.hf import read_config
from jaxrl_llm.models.kv_cache import LayerCache
from jaxrl_llm.models.sharding import batch_sharding, batch_size_divisor, rows_over
from jaxrl_llm.rollout import engine, layout, sampler
from jaxrl_llm.train import learner as learner_lib
from jaxrl_llm.train import state as state_lib
from jaxrl_llm.train import step as step_lib
from jaxrl_llm.train.config import ConfigError, TrainConfig

PROGRAMS = ("prefill", "decode_step", "experience", "update")


def model_config(cfg: TrainConfig, vocab_size: int | None = None) -> ModelConfig:
  """The policy's ModelConfig: from `model.path`'s config.json alone (no weights read), or
  from the `model.*` sizes with `vocab_size` (the task tokenizer's)."""
  m = cfg.model
  if m.path:
    try:
      hf = read_config(m.path)
      return from_hf_config(
        hf,
        param_dtype=jnp.dtype(m.param_dtype),
        dtype=jnp.dtype(m.dtype),
        remat=m.remat,
        scan_layers=m.scan_layers,
        attention_chunk=m.attention_chunk,
      )
    except (OSError, KeyError, ValueError) as e:
      raise ConfigError(
        f"config.model.path={m.path!r}: {e}; the planner reads only its config.json."
      ) from None
  if vocab_size is None:
    raise ValueError("model_config without model.path needs the tokenizer's vocab_size.")
  return learner_lib.model_config(cfg, vocab_size, eos_id=0)


@dataclasses.dataclass
class Run:
  """A configured run's abstract state on a mesh."""

  cfg: TrainConfig
  mesh: jax.sharding.Mesh
  model_cfg: ModelConfig
  policy_def: nnx.GraphDef
  critic_def: nnx.GraphDef | None
  optimizers: tuple
  state: state_lib.TrainState  # ShapeDtypeStructs with their shardings
  eos_ids: tuple = (0,)
  base_def: nnx.GraphDef | None = None  # with LoRA, the graph without adapters (reference)
  pad_id: int = 0
  decode_mesh: jax.sharding.Mesh | None = None  # the sampler's (rollout/layout.py)
  decode_params: object = None  # the policy's decode-layout copy, abstract

  @property
  def prompt_length(self) -> int:
    return self.cfg.task.prompt_length

  @property
  def prompts_per_wave(self) -> int:
    r = self.cfg.rollout
    return sampler.prompts_per_wave(r.prompts_per_step, r.group_size, r.max_rows)

  @property
  def waves(self) -> int:
    return -(-self.cfg.rollout.prompts_per_step // self.prompts_per_wave)

  def rows(self, shape, dtype, axis: int = 0, mesh=None):
    """An abstract array with its rows (axis `axis`) over the batch axes of `mesh` (default:
    the run's; replicated when the rows do not divide)."""
    mesh = self.mesh if mesh is None else mesh
    spec = P()
    if shape[axis] % batch_size_divisor(mesh) == 0:
      spec = P(*[None] * axis, *batch_sharding(mesh, len(shape) - axis).spec)
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))


def abstract_run(cfg: TrainConfig, mesh, model_cfg: ModelConfig, hbm: int | None = None) -> Run:
  """The TrainState the trainer would build for `cfg` on `mesh`, as ShapeDtypeStructs, and the
  sampler's decode-layout copy of the policy (`hbm`: a chip's memory, for its default)."""
  base_def, params = nnx.split(nnx.eval_shape(lambda: CausalLM(model_cfg, rngs=nnx.Rngs(0))))
  critic_def, critic = None, None
  if cfg.uses_critic:
    critic_def, critic = nnx.split(nnx.eval_shape(lambda: ValueModel(model_cfg, rngs=nnx.Rngs(0))))
  optimizers = state_lib.make_optimizers(cfg)

  def init(base, critic):
    policy = state_lib.with_adapters(cfg, base_def, base)
    return state_lib.init_train_state(cfg, policy, critic, optimizers=optimizers, seed=0)

  shapes = jax.eval_shape(init, params, critic)
  shardings = state_lib.state_shardings(cfg, shapes, mesh, optimizers)
  state = state_lib.with_shardings(shapes, shardings)
  eos = model_cfg.eos_token_id
  eos_ids = tuple(eos) if isinstance(eos, (tuple, list)) else (int(eos or 0),)
  policy_def = learner_lib.policy_graphdef(cfg, model_cfg)
  run = Run(cfg, mesh, model_cfg, policy_def, critic_def, optimizers, state, eos_ids, base_def)
  run.decode_mesh, run.decode_params = decode_copy(cfg, mesh, model_cfg, state.policy, hbm)
  return run


def decode_copy(cfg: TrainConfig, mesh, model_cfg: ModelConfig, policy, hbm: int | None):
  """The sampler's decode mesh and the policy's decode-layout copy (abstract), as the learner
  makes them (`rollout.tensor`, or its default for a chip of `hbm` bytes)."""
  tensor = cfg.rollout.tensor or layout.choose_tensor(
    mesh, layout.weight_bytes(policy, model_cfg.dtype), hbm
  )
  try:
    dmesh = layout.decode_mesh(mesh, tensor)
  except ValueError as e:
    raise ConfigError(f"config.rollout.tensor: {e}") from None
  cast = jax.eval_shape(functools.partial(layout.cast_weights, dtype=model_cfg.dtype), policy)
  return dmesh, state_lib.with_shardings(cast, layout.decode_shardings(cast, dmesh))


def device_bytes(tree) -> int:
  """Bytes one device holds of a tree of sharded ShapeDtypeStructs (the largest shard); 4-bit
  arrays (a QLoRA base) count half a byte an element, as accelerators pack them."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    total += -(-math.prod(shape) * layout.dtype_bits(x.dtype) // 8)
  return total


def _sampling(run: Run):
  r = run.cfg.rollout
  return (float(r.temperature), r.top_k or None, None if r.top_p in (None, 1.0) else r.top_p)


def prefill_program(run: Run):
  """The sampler's prefill, `(jitted, abstract args)`: one wave's prompts into the cache, on
  the decode mesh with the decode-layout weights."""
  r = run.cfg.rollout

  def prefill(params, prompt, mask):
    return sampler.prefill(
      nnx.merge(run.policy_def, params),
      prompt,
      mask,
      max_new_tokens=r.max_new_tokens,
      num_samples=r.group_size,
      pad_id=run.pad_id,
      cache_dtype=None,
      mesh=run.decode_mesh,
    )

  shape, mesh = (run.prompts_per_wave, run.prompt_length), run.decode_mesh
  prompts = (run.rows(shape, jnp.int32, mesh=mesh), run.rows(shape, bool, mesh=mesh))
  return jax.jit(prefill), (run.decode_params, *prompts)


def carry_shape(run: Run) -> sampler.DecodeCarry:
  """The decode loop's carry (KV cache included) as ShapeDtypeStructs, without shardings."""
  prefill, args = prefill_program(run)
  return jax.eval_shape(prefill, *args)


def decode_program(run: Run, carry_shardings=None):
  """One decode step, the body of the sampler's loop, `(jitted, abstract args)`; the carry
  is donated, as the loop updates it in place. `carry_shardings`: the compiled prefill's
  output shardings (default: every carry array split by rows)."""
  carry_shapes = carry_shape(run)
  if carry_shardings is None:
    carry = jax.tree.map(
      lambda x: run.rows(x.shape, x.dtype, mesh=run.decode_mesh) if x.ndim else x, carry_shapes
    )
    stacked = isinstance(carry_shapes.cache.layers, LayerCache)  # rows are axis 1
    layers = jax.tree.map(lambda x: _kv(run, x, 1 if stacked else 0), carry_shapes.cache.layers)
    carry = carry._replace(cache=carry.cache._replace(layers=layers))
  else:
    carry = jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      carry_shapes,
      carry_shardings,
    )
  eos_ids, sampling = run.eos_ids, _sampling(run)

  r = run.cfg.rollout
  rows = (0, None) if run.waves == 1 else (0, run.waves * run.prompts_per_wave * r.group_size)

  def decode_step(params, carry, key):
    model = nnx.merge(run.policy_def, params)
    eos = jnp.asarray(eos_ids, jnp.int32)
    with rows_over(run.decode_mesh):
      return sampler.decode_step(
        carry, model, model.unembedding_VxD(), key, eos, sampling, run.pad_id, rows
      )

  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype)
  # The KV cache in the layout the compiler picks for it, as inside the sampler's decode
  # loop (compiled alone with the default layout, the step would convert it twice a step).
  replicated = NamedSharding(run.decode_mesh, P())
  sharding = _placed(run)
  auto = lambda x: Format(Layout.AUTO, sharding(x))
  carry_formats = jax.tree.map(sharding, carry)
  layers = jax.tree.map(auto, carry.cache.layers)
  carry_formats = carry_formats._replace(cache=carry_formats.cache._replace(layers=layers))
  params = jax.tree.map(sharding, run.decode_params)
  step = jax.jit(
    decode_step,
    donate_argnums=1,
    in_shardings=(params, carry_formats, replicated),
    out_shardings=carry_formats,
  )
  return step, (run.decode_params, carry, key)


def _placed(run: Run):
  """An abstract array's sharding, or replicated over the decode mesh where it has none."""
  replicated = NamedSharding(run.decode_mesh, P())
  return lambda x: x.sharding if x.sharding is not None else replicated


def engine_layout(run: Run, mean_completion: float | None = None) -> engine.Layout:
  """The rollout engine's layout for one wave on the decode mesh. With `mean_completion` (a
  fraction of `max_new_tokens`), the layout the planner compiles a decode step at: every
  slot busy with a row `mean_completion * N` tokens in, the table as wide as such a row's
  pages and the pool just what the slots and their groups' prompts hold then (the real pool
  is sized for the worst case: `state_breakdown` counts that one)."""
  r = run.cfg.rollout
  lay = engine.layout(
    run.prompts_per_wave,
    run.prompt_length,
    r.group_size,
    r.max_new_tokens,
    batch_size_divisor(run.decode_mesh),
    slots=r.decode_slots,
    page_size=r.page_size,
    prefill_chunk=r.prefill_chunk,
  )
  if mean_completion is None:
    return lay
  T, S, P = lay.page_size, lay.slots, run.prompt_length
  done = int(mean_completion * r.max_new_tokens)
  groups = -(-S // r.group_size)
  live_pages = S * -(-done // T) + groups * -(-P // T)
  return dataclasses.replace(lay, table_width=-(-(P + done) // T), pages=live_pages)


def engine_state(run: Run, lay: engine.Layout) -> engine.State:
  """The engine's loop state for `lay` as sharded ShapeDtypeStructs: lane arrays split by
  lane over the decode mesh's batch axes, the page pools as `paged.pool_spec` says."""
  mesh = run.decode_mesh
  with rows_over(mesh):
    shapes = jax.eval_shape(lambda: engine.init_state(lay, run.model_cfg, run.pad_id, None, mesh))
  lanes = lambda x: run.rows(x.shape, x.dtype, mesh=mesh) if x.ndim else _replicated(run, x)
  state = jax.tree.map(lanes, shapes._replace(pools=None))
  spec = lambda x: paged.pool_spec(x.ndim, run.model_cfg.num_kv_heads, mesh)
  pools = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec(x))),
    shapes.pools,
  )
  return state._replace(pools=pools)


def _replicated(run: Run, x):
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(run.decode_mesh, P()))


def engine_decode_program(run: Run, lay: engine.Layout):
  """One decode iteration of the rollout engine with every slot busy (each slot samples,
  records, retires or grows, and runs the model on its token), `(jitted, abstract args)`; the
  state is donated. Only the step on all the slots is compiled (the smaller slot-count
  buckets run when slots are idle, and a step runs one of them), and the page pools take the
  layout the compiler picks, as inside the engine's loop."""
  eos_ids, sampling, mesh = run.eos_ids, _sampling(run), run.decode_mesh
  lanes = engine.lanes_of(lay)

  def decode_step(params, state, lens_DxQ, key):
    model = nnx.merge(run.policy_def, params)
    run_ = engine.Run(key, jnp.asarray(eos_ids, jnp.int32), sampling, jnp.zeros((), jnp.int32))
    with rows_over(mesh):
      unembedding = model.unembedding_VxD()
      return engine.decode(
        model, unembedding, state, lay, lanes, lens_DxQ, run_, buckets=(lay.slots,)
      )

  state = engine_state(run, lay)
  lens = run.rows((lay.lanes, lay.prompts), jnp.int32, mesh=mesh)
  key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype)
  replicated = NamedSharding(mesh, P())
  sharding = _placed(run)
  formats = jax.tree.map(lambda x: Format(Layout.AUTO, sharding(x)), state)
  params = jax.tree.map(sharding, run.decode_params)
  step = jax.jit(
    decode_step,
    donate_argnums=1,
    in_shardings=(params, formats, sharding(lens), replicated),
    out_shardings=formats,
  )
  return step, (run.decode_params, state, lens, key)


def _kv(run: Run, x, row_axis: int):
  """A KV-cache array as the sampler lays it out (`sampler.kv_spec`)."""
  spec = sampler.kv_spec(x.shape, row_axis, run.decode_mesh)
  return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(run.decode_mesh, spec))


def _batch(run: Run) -> step_lib.Batch:
  B, P_, N = run.cfg.batch_size, run.prompt_length, run.cfg.rollout.max_new_tokens
  return step_lib.Batch(
    prompt_BxP=run.rows((B, P_), jnp.int32),
    prompt_mask_BxP=run.rows((B, P_), jnp.bool_),
    tokens_BxN=run.rows((B, N), jnp.int32),
    mask_BxN=run.rows((B, N), jnp.bool_),
    scores_B=run.rows((B,), jnp.float32),
    truncated_B=run.rows((B,), jnp.bool_),
  )


def _steps(run: Run):
  return learner_lib.jitted_steps(
    run.cfg, run.mesh, run.policy_def, run.critic_def, run.optimizers, run.base_def
  )


def experience_program(run: Run):
  """The experience pass (old and reference log-probs, values, advantages)."""
  return _steps(run)[0], (run.state, _batch(run))


def update_program(run: Run):
  """The update: every minibatch's optimizer step; the state is donated."""
  experience, update = _steps(run)
  exp_shapes, _ = jax.eval_shape(experience, run.state, _batch(run))
  exp = jax.tree.map(lambda x: run.rows(x.shape, x.dtype), exp_shapes)
  return update, (run.state, exp)


def state_argument_bytes(run: Run, name: str) -> int:
  """Bytes per device of a program's arguments that stay resident anyway: the train state,
  or for the sampler's programs its decode-layout copy of the weights."""
  return device_bytes(run.decode_params if name in ("prefill", "decode_step") else run.state)


def resident_bytes(run: Run) -> int:
  """Bytes per device held throughout an iteration: the train state and the sampler's
  decode-layout copy of the policy (made once per update, kept until the next)."""
  return device_bytes(run.state) + device_bytes(run.decode_params)


BUILDERS = {
  "prefill": prefill_program,
  "experience": experience_program,
  "update": update_program,
}
