"""A jitted sampler: one prefill, then a `lax.while_loop` of single-token decode steps.

Everything has static shape: the KV cache holds `P + N` slots from the start,
completions are written into a preallocated `[B*G, N]` buffer, and the loop stops
as soon as every row has produced an EOS. The model code is the trainer's, so
the log-probs recorded here are the ones the trainer computes (to float
rounding) for the same tokens.
"""

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl_llm.models.kv_cache import KVCache, LayerCache, init_cache, share_prompt
from jaxrl_llm.models.sharding import (
  BATCH_AXES,
  batch_size_divisor,
  current_rows_mesh,
  rows_over,
  split_rows,
)
from jaxrl_llm.models.transformer import positions_from_mask
from jaxrl_llm.rollout import engine, layout
from jaxrl_llm.rollout.sampling import SampleOutput, process_logits, sample_from_logprobs


class DecodeCarry(NamedTuple):
  """The state of the decode loop after `step` completion tokens."""

  step: jax.Array
  logits_BxV: jax.Array  # the model's logits for the next token
  cache: KVCache
  tokens_BxN: jax.Array
  logprobs_BxN: jax.Array
  done_B: jax.Array  # the row has produced an EOS
  next_pos_B: jax.Array  # RoPE position of the next token


def decode_step(
  carry: DecodeCarry, model, unembedding_VxD, key, eos_ids, sampling, pad_id, rows=(0, None)
):
  """Samples token `step`, records it, and runs the model on it for the next logits. `rows`:
  the carry's first row and the whole batch's row count, when the carry is a wave of it."""
  temperature, top_k, top_p = sampling
  logp_BxV = process_logits(carry.logits_BxV, temperature, top_k, top_p)
  if temperature == 0:
    token_B = jnp.argmax(logp_BxV, axis=-1)
  else:
    step_key = jax.random.fold_in(key, carry.step)
    token_B = sample_from_logprobs(step_key, logp_BxV, row_offset=rows[0], rows_total=rows[1])
  token_B = token_B.astype(jnp.int32)
  lp_B = jnp.take_along_axis(logp_BxV, token_B[:, None], axis=-1)[:, 0]
  token_B = jnp.where(carry.done_B, pad_id, token_B)
  lp_B = jnp.where(carry.done_B, 0.0, lp_B)
  tokens_BxN = carry.tokens_BxN.at[:, carry.step].set(token_B)
  logprobs_BxN = carry.logprobs_BxN.at[:, carry.step].set(lp_B)
  done_B = carry.done_B | jnp.isin(token_B, eos_ids)
  hidden_Bx1xD, cache = model.decoder(
    token_B[:, None], carry.next_pos_B[:, None], jnp.ones_like(token_B[:, None], bool), carry.cache
  )
  logits_Bx1xV = model.unembed(hidden_Bx1xD, unembedding_VxD)
  return DecodeCarry(
    carry.step + 1,
    logits_Bx1xV[:, 0],
    cache,
    tokens_BxN,
    logprobs_BxN,
    done_B,
    carry.next_pos_B + 1,
  )


def kv_spec(shape, row_axis: int, mesh) -> PartitionSpec:
  """How the sampler lays out a KV-cache array of `shape` (`[.., rows, K, ...]`, rows at
  `row_axis`) on `mesh`: rows over the batch axes and KV heads over `tensor`, each where it
  divides."""
  spec = [None] * len(shape)
  if shape[row_axis] % batch_size_divisor(mesh) == 0:
    spec[row_axis] = BATCH_AXES
  if shape[row_axis + 1] % mesh.shape["tensor"] == 0:
    spec[row_axis + 1] = "tensor"
  return PartitionSpec(*spec)


def split_cache(cache: KVCache) -> KVCache:
  """`cache` constrained to `kv_spec` on the rows mesh (within `rows_over`; a shared
  prompt's rows too)."""
  mesh = current_rows_mesh()
  if mesh is None:
    return cache
  row_axis = 1 if isinstance(cache.layers, LayerCache) else 0  # stacked: layers first
  place = lambda x: jax.lax.with_sharding_constraint(
    x, NamedSharding(mesh, kv_spec(x.shape, row_axis, mesh))
  )
  return cache._replace(
    layers=jax.tree.map(place, cache.layers), mask_BxS=split_rows(cache.mask_BxS)
  )


def prefill(
  model,
  prompt_BxP,
  prompt_mask_BxP,
  *,
  max_new_tokens,
  num_samples,
  pad_id,
  cache_dtype,
  mesh,
  shared_prompt_kv=True,
) -> DecodeCarry:
  """The decode loop's first carry: each prompt is prefilled once into a cache of P slots,
  which its `num_samples` completions share (`share_prompt`: one copy of the prompt's keys
  and values per group, plus max_new_tokens slots per row); its next-token logits are
  repeated for them. Rows are split over `mesh`'s batch axes where they divide, KV heads over
  its tensor axis. With `shared_prompt_kv=False` the prompt's keys and values are instead
  repeated into each row's own P + max_new_tokens slots (the same samples, G times the
  prompt's KV memory; kept to measure against). (Its own program in `jaxrl_llm.plan`.)"""

  def repeat(x):  # prompt i's row to rows i*G .. i*G+G-1
    return split_rows(jnp.repeat(x, num_samples, axis=0))

  with rows_over(mesh):
    prompt_mask_BxP = split_rows(prompt_mask_BxP.astype(bool))
    B, P = prompt_BxP.shape[0] * num_samples, prompt_BxP.shape[1]
    N = max_new_tokens
    slots = P if shared_prompt_kv else P + N
    cache = init_cache(model.cfg, B // num_samples, slots, cache_dtype)
    positions_BxP = positions_from_mask(prompt_mask_BxP)
    hidden, cache = model.decoder(split_rows(prompt_BxP), positions_BxP, prompt_mask_BxP, cache)
    logits_BxV = model.unembed(hidden[:, -1:], model.unembedding_VxD())[:, 0]  # last token
    if shared_prompt_kv:
      cache = share_prompt(cache, num_samples, N)
    else:
      cache = cache.map_rows(repeat)
    return DecodeCarry(
      step=jnp.zeros((), jnp.int32),
      logits_BxV=repeat(logits_BxV),
      cache=split_cache(cache),
      tokens_BxN=split_rows(jnp.full((B, N), pad_id, jnp.int32)),
      logprobs_BxN=split_rows(jnp.zeros((B, N), jnp.float32)),
      done_B=split_rows(jnp.zeros((B,), bool)),
      next_pos_B=repeat(positions_BxP[:, -1] + 1),
    )


def _decode_rows(model, prompt_BxP, prompt_mask_BxP, rng, eos_ids, rows, **kw) -> SampleOutput:
  """Prefill and the decode loop for one wave of prompts. `rows`: the wave's first sample
  row and the rows of all waves (see `decode_step`)."""
  N, mesh = kw["max_new_tokens"], kw["mesh"]
  carry = prefill(
    model,
    prompt_BxP,
    prompt_mask_BxP,
    max_new_tokens=N,
    num_samples=kw["num_samples"],
    pad_id=kw["pad_id"],
    cache_dtype=kw["cache_dtype"],
    mesh=mesh,
    shared_prompt_kv=kw["shared_prompt_kv"],
  )
  step = functools.partial(
    decode_step,
    model=model,
    unembedding_VxD=model.unembedding_VxD(),
    key=rng,
    eos_ids=eos_ids,
    sampling=kw["sampling"],
    pad_id=kw["pad_id"],
    rows=rows,
  )
  with rows_over(mesh):
    carry = jax.lax.while_loop(lambda c: (c.step < N) & ~jnp.all(c.done_B), step, carry)
  # A row's mask covers its tokens up to and including its first EOS.
  is_eos_BxN = jnp.isin(carry.tokens_BxN, eos_ids) & (jnp.arange(N) < carry.step)
  eos_before_BxN = jnp.cumsum(is_eos_BxN, axis=-1) - is_eos_BxN
  mask_BxN = (eos_before_BxN == 0) & (jnp.arange(N) < carry.step)
  return SampleOutput(
    tokens_BxN=carry.tokens_BxN,
    mask_BxN=mask_BxN,
    logprobs_BxN=jnp.where(mask_BxN, carry.logprobs_BxN, 0.0),
    lengths_B=mask_BxN.sum(-1).astype(jnp.int32),
    truncated_B=~jnp.any(is_eos_BxN, axis=-1),
  )


def prompts_per_wave(num_prompts: int, num_samples: int, max_rows: int) -> int:
  """Prompts a wave takes: all of them, or as many as `max_rows` rows hold (0: no limit)."""
  if not max_rows or num_prompts * num_samples <= max_rows:
    return num_prompts
  return max(max_rows // num_samples, 1)


@functools.partial(
  jax.jit,
  static_argnames=(
    "graphdef",
    "max_new_tokens",
    "num_samples",
    "sampling",
    "pad_id",
    "cache_dtype",
    "mesh",
    "per_wave",
    "shared_prompt_kv",
  ),
)
def _generate(graphdef, params, prompt_BxP, prompt_mask_BxP, rng, eos_ids, *, per_wave, **kw):
  model = nnx.merge(graphdef, params)
  Bp, G = prompt_BxP.shape[0], kw["num_samples"]
  if per_wave == Bp:
    return _decode_rows(model, prompt_BxP, prompt_mask_BxP, rng, eos_ids, (0, None), **kw)
  # Waves: the prompts padded to whole waves (copies of the last, dropped at the end), each
  # wave decoded in turn into its rows of the output. A row's random numbers are drawn as
  # for the whole batch, so the samples equal one wave's.
  waves = -(-Bp // per_wave)
  pad = ((0, waves * per_wave - Bp), (0, 0))
  prompt_BxP = jnp.pad(prompt_BxP, pad, mode="edge")
  prompt_mask_BxP = jnp.pad(prompt_mask_BxP, pad, mode="edge")
  total = waves * per_wave * G
  wave_out = jax.eval_shape(
    lambda p, m: _decode_rows(model, p, m, rng, eos_ids, (0, total), **kw),
    prompt_BxP[:per_wave],
    prompt_mask_BxP[:per_wave],
  )
  out = jax.tree.map(lambda x: jnp.zeros((total, *x.shape[1:]), x.dtype), wave_out)

  def wave(w, out):
    start = w * per_wave
    take = lambda x: jax.lax.dynamic_slice_in_dim(x, start, per_wave)
    rows = (start * G, total)
    got = _decode_rows(model, take(prompt_BxP), take(prompt_mask_BxP), rng, eos_ids, rows, **kw)
    put = lambda buf, x: jax.lax.dynamic_update_slice_in_dim(buf, x, start * G, axis=0)
    return jax.tree.map(put, out, got)

  out = jax.lax.fori_loop(0, waves, wave, out)
  with rows_over(kw["mesh"]):
    return jax.tree.map(lambda x: split_rows(x[: Bp * G]), out)


def _drop_padding_columns(prompt_BxP, prompt_mask_BxP, multiple: int = 8):
  """The prompts without the leading columns that are padding in every row, so the prefill
  computes no all-padding column; the width kept is a multiple of `multiple` (or P), so a
  loop over varied batches compiles a few widths at most. The samples do not change: masked
  key slots get zero attention weight and positions count real tokens only. Prompts spread
  over several processes are left as they are (each process would have to agree)."""
  if isinstance(prompt_mask_BxP, jax.core.Tracer) or (
    isinstance(prompt_mask_BxP, jax.Array) and not prompt_mask_BxP.is_fully_addressable
  ):
    return prompt_BxP, prompt_mask_BxP
  real_P = np.asarray(prompt_mask_BxP).astype(bool).any(axis=0)
  P = real_P.shape[0]
  width = -(-(P - int(np.argmax(real_P))) // multiple) * multiple
  if width >= P or not real_P.any():
    return prompt_BxP, prompt_mask_BxP
  return prompt_BxP[:, P - width :], prompt_mask_BxP[:, P - width :]


def _check_arguments(
  prompt_BxP, prompt_mask_BxP, max_new_tokens, num_samples, sampling, mesh, per_wave
):
  """`generate`'s arguments, checked before anything traces, with a message that names them."""
  temperature, top_k, top_p = sampling
  if prompt_BxP.ndim != 2 or prompt_BxP.shape != prompt_mask_BxP.shape:
    raise ValueError(
      f"prompts {prompt_BxP.shape} and mask {prompt_mask_BxP.shape} must be one [B, P] shape."
    )
  if max_new_tokens < 1 or num_samples < 1:
    raise ValueError(
      f"max_new_tokens ({max_new_tokens}) and num_samples ({num_samples}) must be >= 1."
    )
  if (
    temperature < 0
    or (top_p is not None and not 0 < top_p <= 1)
    or (top_k is not None and top_k < 1)
  ):
    raise ValueError(
      f"need temperature >= 0, 0 < top_p <= 1 and top_k >= 1; got {temperature}, {top_p}, {top_k}."
    )
  rows = prompt_BxP.shape[0] * num_samples
  if mesh is not None and rows % batch_size_divisor(mesh):
    raise ValueError(
      f"B*G = {rows} rows must divide over the decode mesh's {batch_size_divisor(mesh)} row "
      "groups (devices / tensor)."
    )
  if mesh is not None and (per_wave * num_samples) % batch_size_divisor(mesh):
    raise ValueError(
      f"a wave of {per_wave} prompts x {num_samples} samples does not divide over the decode "
      f"mesh's {batch_size_divisor(mesh)} row groups; choose max_rows as a multiple of "
      f"{num_samples} x {batch_size_divisor(mesh)}."
    )


def generate(
  model,
  prompt_BxP,
  prompt_mask_BxP,
  rng,
  *,
  max_new_tokens: int,
  temperature: float = 1.0,
  top_k: int | None = None,
  top_p: float | None = None,
  eos_ids=(),
  num_samples: int = 1,
  pad_id: int = 0,
  params=None,
  mesh=None,
  tensor: int | None = None,
  max_rows: int = 0,
  cache_dtype=None,
  trim: bool = True,
  decode_slots: int = 0,
  page_size: int = 16,
  prefill_chunk: int = 512,
  static: bool = False,
  shared_prompt_kv: bool = True,
  with_stats: bool = False,
):
  """Samples `num_samples` completions of every left-padded prompt. (Long on purpose: the
  public entry point, each of its arguments documented here.)

  Args:
    model: a `CausalLM`, or its graphdef (then pass `params=`).
    prompt_BxP: left-padded prompt ids; each row needs at least one real token.
    prompt_mask_BxP: 1 on real prompt tokens.
    rng: a `jax.random.key`; the same key gives the same samples, on any mesh, with any
      slot count, page size or waves.
    max_new_tokens: N, the completion buffer's length.
    temperature: > 0 samples from softmax(logits / temperature); 0 is greedy.
    top_k, top_p: optional truncation of the sampling distribution.
    eos_ids: ids that end a completion (the EOS itself is kept and masked in).
    num_samples: G completions per prompt, rows i*G .. i*G+G-1 for prompt i; pad_id:
      written after a row's EOS.
    params: the parameter state when `model` is a graphdef.
    mesh: a (data, fsdp, tensor) mesh the params and prompts are on. The sampler decodes on
      its decode mesh (`layout.decode_mesh(mesh, tensor)`: rows over devices / tensor row
      groups, heads and MLP columns over `tensor`) with the weights in the decode layout
      (`layout.to_decode_layout`: a copy, unless they are placed so already).
    tensor: the decode mesh's tensor axis (default: the mesh's own).
    max_rows: at most this many rows decode at once: the prompts go in waves of
      max_rows // num_samples (0: one wave).
    cache_dtype: KV cache dtype (default: the model's compute dtype).
    trim: drop columns of padding in every row (a few widths compile); False keeps the
      width, so one program serves every call of that shape.
    decode_slots, page_size, prefill_chunk: the engine's slots (0: one per row), tokens per
      KV page and prompt tokens per prefill pass (`rollout/engine.py`).
    static: decode with the static sampler instead (every row in the batch until the
      longest ends, each row's KV in P + N slots): kept as the baseline the engine is
      measured against (`bench_sampler`, `bench_smollm2`, the planner's comparison rows).
    shared_prompt_kv: the static sampler's G samples attend to one copy of their prompt's
      KV (see `prefill`); False repeats it per row.
    with_stats: also return the engine's `engine.Stats` (None from the static sampler).
  """
  if not (shared_prompt_kv or static):
    raise ValueError(
      "shared_prompt_kv=False is the static sampler's layout (static=True); the engine's rows "
      "always share their prompt's pages."
    )
  graphdef, params = nnx.split(model) if params is None else (model, params)
  if mesh is not None:
    mesh = layout.decode_mesh(mesh, tensor or mesh.shape["tensor"])
    params = layout.to_decode_layout(params, mesh, nnx.merge(graphdef, params).cfg.dtype)
  per_wave = prompts_per_wave(prompt_BxP.shape[0], num_samples, max_rows)
  sampling = (float(temperature), top_k, top_p)
  _check_arguments(
    prompt_BxP, prompt_mask_BxP, max_new_tokens, num_samples, sampling, mesh, per_wave
  )
  if trim:
    prompt_BxP, prompt_mask_BxP = _drop_padding_columns(prompt_BxP, prompt_mask_BxP)
  kw = dict(max_new_tokens=max_new_tokens, num_samples=num_samples, sampling=sampling)
  kw.update(pad_id=pad_id, cache_dtype=cache_dtype, mesh=mesh)
  eos = jnp.asarray(eos_ids, jnp.int32).reshape(-1)
  if static:
    prompt = jnp.asarray(prompt_BxP, jnp.int32), jnp.asarray(prompt_mask_BxP)
    out = _generate(
      graphdef,
      params,
      *prompt,
      rng,
      eos,
      per_wave=per_wave,
      shared_prompt_kv=shared_prompt_kv,
      **kw,
    )
    return (out, None) if with_stats else out
  out, stats = engine.run(
    graphdef,
    params,
    prompt_BxP,
    prompt_mask_BxP,
    rng,
    eos,
    decode_slots=decode_slots,
    page_size=page_size,
    prefill_chunk=prefill_chunk,
    per_wave=per_wave,
    **kw,
  )
  return (out, stats) if with_stats else out
