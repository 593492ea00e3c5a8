"""The sampler's decode layout, its shared prompt KV and its waves: what each changes in the
compiled program and in memory, and that none of them changes a sample."""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import core
from jaxrl_llm.models import load_model
from jaxrl_llm.models.kv_cache import init_cache, share_prompt
from jaxrl_llm.models.sharding import (
  batch_size_divisor,
  make_mesh,
  shard_params,
)
from jaxrl_llm.rollout import engine, generate, layout, sampler

FIXTURES = Path(__file__).parent / "fixtures"
COLLECTIVE = re.compile(
  r"= (\S+) (all-gather|all-reduce|reduce-scatter|all-to-all|collective-permute)(?:-start)?\("
)


@pytest.fixture(scope="module")
def model():
  return load_model(FIXTURES / "qwen2_untied")


def _prompts(n=4):
  g = np.load(FIXTURES / "qwen2_untied" / "greedy.npz")
  prompt, mask = g["prompt"], g["prompt_mask"]
  take = np.arange(n) % prompt.shape[0]
  return jnp.asarray(prompt[take]), jnp.asarray(mask[take])


def _fsdp(model):
  """The model's params as the trainer holds them: FSDP over the 8 devices."""
  graphdef, params = nnx.split(model)
  mesh = make_mesh(data=1, fsdp=8, tensor=1)
  return graphdef, shard_params(params, mesh), mesh


def _collectives(graphdef, params, mesh, prompt, mask):
  """(kind, result shape) of every collective in the compiled engine's program."""
  B, G = prompt.shape[0], 4
  lay = engine.layout(B, prompt.shape[1], G, 6, batch_size_divisor(mesh))
  lowered = engine._run.lower(
    graphdef,
    params,
    prompt,
    mask,
    jax.random.key(0),
    jnp.asarray([7], jnp.int32),
    jnp.asarray(0, jnp.int32),
    lay=lay,
    waves=1,
    keep=B * G,
    sampling=(1.0, None, None),
    pad_id=0,
    cache_dtype=None,
    mesh=mesh,
  )
  text = lowered.compile().as_text()
  out = []
  for m in COLLECTIVE.finditer(text):
    dims = re.match(r"\w+\[([\d,]*)\]", m.group(1))
    out.append((m.group(2), tuple(int(d) for d in dims.group(1).split(",") if d)))
  return out


def _weight_shapes(params, *layouts):
  """Every parameter's global shape and its shard's shape in each layout."""
  shapes = {tuple(x.shape) for x in jax.tree.leaves(params)}
  for shardings in layouts:
    for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(shardings), strict=True):
      shapes.add(tuple(s.shard_shape(x.shape)))
  return shapes


def test_the_decode_layout_gathers_no_weight(model):
  graphdef, params, mesh = _fsdp(model)
  prompt, mask = _prompts(8)
  decode = layout.decode_mesh(mesh, 2)
  # A weight gathered whole, or into the decode layout's shard (the FSDP shards' shapes are
  # left out: a (4, 320) shard of the head is also the shape of 4 rows' gathered logits).
  weights = _weight_shapes(params, layout.decode_shardings(params, decode))
  gathers = lambda colls: [s for kind, s in colls if kind == "all-gather" and s in weights]
  # Laid out for training, the sampler all-gathers the weights (inside the decode loop).
  assert gathers(_collectives(graphdef, params, mesh, prompt, mask))
  copy = layout.to_decode_layout(params, decode, model.cfg.dtype)
  colls = _collectives(graphdef, copy, decode, prompt, mask)
  assert not gathers(colls), gathers(colls)
  # What remains: the tensor-parallel reductions (and gathers of activations' shards).
  assert any(kind == "all-reduce" and len(s) >= 2 for kind, s in colls)
  placed = jax.tree.leaves(layout.decode_shardings(copy, decode))
  for x, s in zip(jax.tree.leaves(copy), placed, strict=True):
    assert x.sharding.is_equivalent_to(s, x.ndim)


def test_the_decode_copy_is_cast_and_made_only_when_needed(model):
  graphdef, params, mesh = _fsdp(model)
  decode = layout.decode_mesh(mesh, 4)
  half = layout.to_decode_layout(params, decode, jnp.bfloat16)
  assert {x.dtype for x in jax.tree.leaves(half)} == {jnp.dtype(jnp.bfloat16)}
  assert layout.weight_bytes(params, jnp.bfloat16) * 2 == sum(
    x.nbytes for x in jax.tree.leaves(params)
  )
  # attention heads (4 of them) split over the 4 tensor devices, the hidden axis replicated
  q = half["decoder"]["layers"][0]["attn"]["q_DxNxH"].get_value()
  assert q.sharding.shard_shape(q.shape) == (q.shape[0], 1, q.shape[2])
  same = layout.to_decode_layout(half, decode, jnp.bfloat16)
  assert all(a is b for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(half), strict=True))


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_sampled_logprobs_equal_teacher_forced_in_the_decode_layout(model, tensor):
  graphdef, params, mesh = _fsdp(model)
  prompt, mask = _prompts(4)
  G, P = 4, prompt.shape[1]
  out = generate(
    graphdef,
    prompt,
    mask,
    jax.random.key(5),
    params=params,
    mesh=mesh,
    tensor=tensor,
    max_new_tokens=10,
    num_samples=G,
    eos_ids=(7,),
  )
  rows = out.tokens_BxN.sharding.shard_shape(out.tokens_BxN.shape)[0]
  assert rows == 16 // (8 // tensor)  # rows split over the decode mesh's row groups
  seq = jnp.concatenate([jnp.repeat(prompt, G, 0), out.tokens_BxN], axis=1)
  seq_mask = jnp.concatenate([jnp.repeat(mask, G, 0), out.mask_BxN], axis=1)
  logits, _ = model(np.asarray(seq), mask_BxL=np.asarray(seq_mask))
  teacher = core.token_logprobs(logits[:, P - 1 : -1], np.asarray(out.tokens_BxN), 1.0)
  m = np.asarray(out.mask_BxN)
  assert m.sum() > 40
  np.testing.assert_allclose(np.asarray(out.logprobs_BxN)[m], np.asarray(teacher)[m], atol=1e-5)


def test_greedy_tokens_equal_across_layouts(model):
  graphdef, params, mesh = _fsdp(model)
  prompt, mask = _prompts(4)
  kw = dict(max_new_tokens=10, num_samples=2, temperature=0.0)
  single = generate(model, prompt, mask, jax.random.key(0), **kw)
  for tensor in (1, 2, 4, 8):
    out = generate(
      graphdef, prompt, mask, jax.random.key(0), params=params, mesh=mesh, tensor=tensor, **kw
    )
    np.testing.assert_array_equal(out.tokens_BxN, single.tokens_BxN)


@pytest.mark.parametrize("devices", [1, 8])
def test_waves_give_the_samples_of_one_wave(model, devices):
  prompt, mask = _prompts(6)
  kw = dict(max_new_tokens=8, num_samples=4, temperature=1.0, eos_ids=(7,), top_k=50)
  if devices == 1:
    graphdef, params, mesh = *nnx.split(model), None
  else:
    graphdef, params, mesh = _fsdp(model)
    kw["tensor"] = 2  # 4 row groups: a wave of 2 prompts x 4 samples splits over them
  run = lambda max_rows: generate(
    graphdef, prompt, mask, jax.random.key(9), params=params, mesh=mesh, max_rows=max_rows, **kw
  )
  one = run(0)
  for max_rows in (8, 16):  # 3 waves of 2 prompts; 2 waves of 4 (the last padded)
    waves = run(max_rows)
    np.testing.assert_array_equal(waves.tokens_BxN, one.tokens_BxN)
    np.testing.assert_array_equal(waves.mask_BxN, one.mask_BxN)
    np.testing.assert_array_equal(waves.truncated_B, one.truncated_B)
    np.testing.assert_allclose(waves.logprobs_BxN, one.logprobs_BxN, atol=1e-5)  # batch rounding
  assert sampler.prompts_per_wave(6, 4, 16) == 4 and sampler.prompts_per_wave(6, 4, 0) == 6


def test_a_wave_that_does_not_split_over_the_row_groups_is_refused(model):
  graphdef, params, mesh = _fsdp(model)
  prompt, mask = _prompts(8)
  with pytest.raises(ValueError, match="choose max_rows as a multiple of 4 x 8"):
    generate(
      graphdef,
      prompt,
      mask,
      jax.random.key(0),
      params=params,
      mesh=mesh,
      max_new_tokens=2,
      num_samples=4,
      max_rows=12,
      tensor=1,
    )


def test_a_group_shares_one_copy_of_its_prompt_kv(model):
  """The shared cache gives the hidden states of a cache with the prompt repeated per row,
  and holds the prompt once per group: P + G N slots per group instead of G (P + N)."""
  cfg = model.cfg
  prompt, mask = _prompts(3)
  Bp, P = prompt.shape
  G, N = 4, 3
  positions = jnp.maximum(jnp.cumsum(mask, -1) - 1, 0)
  _, cache = model.decoder(prompt, positions, mask, init_cache(cfg, Bp, P))
  shared = share_prompt(cache, G, N)
  _, long = model.decoder(prompt, positions, mask, init_cache(cfg, Bp, P + N))
  repeated = long.map_rows(lambda x: jnp.repeat(x, G, axis=0))
  tokens = jax.random.randint(jax.random.key(1), (Bp * G, N), 1, cfg.vocab_size)
  next_pos = jnp.repeat(positions[:, -1:] + 1, G, 0) + jnp.arange(N)
  ones = jnp.ones_like(tokens, bool)
  got, _ = model.decoder(tokens, next_pos, ones, shared)
  want, _ = model.decoder(tokens, next_pos, ones, repeated)
  np.testing.assert_allclose(got, want, atol=1e-5)
  per_slot = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # k and v, float32
  kv_bytes = lambda c: sum(x.nbytes for x in jax.tree.leaves(c.layers))
  assert kv_bytes(shared) == Bp * (P + G * N) * per_slot
  assert kv_bytes(repeated) == Bp * G * (P + N) * per_slot


def test_the_static_samplers_repeated_prompt_layout_gives_the_same_samples(model):
  prompt, mask = _prompts(3)
  kw = dict(max_new_tokens=8, num_samples=4, temperature=1.0, eos_ids=(7,), static=True)
  shared = generate(model, prompt, mask, jax.random.key(4), **kw)
  repeated = generate(model, prompt, mask, jax.random.key(4), shared_prompt_kv=False, **kw)
  np.testing.assert_array_equal(shared.tokens_BxN, repeated.tokens_BxN)
  np.testing.assert_allclose(shared.logprobs_BxN, repeated.logprobs_BxN, atol=1e-5)


def test_a_scanned_model_writes_its_cache_in_place_and_samples_the_same(model):
  """The scanned layers' decode step keeps the stacked cache in the scan's carry."""
  scanned = load_model(FIXTURES / "qwen2_untied", scan_layers=True)
  prompt, mask = _prompts(3)
  kw = dict(max_new_tokens=8, num_samples=4, temperature=1.0, eos_ids=(7,))
  want = generate(model, prompt, mask, jax.random.key(6), **kw)
  got = generate(scanned, prompt, mask, jax.random.key(6), **kw)
  np.testing.assert_array_equal(got.tokens_BxN, want.tokens_BxN)
  np.testing.assert_allclose(got.logprobs_BxN, want.logprobs_BxN, atol=1e-5)
