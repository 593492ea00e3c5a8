"""The rollout engine: continuous batching over a paged KV cache. Its samples do not depend on
scheduling (slots, page size, prefill chunks, lanes), its pages all come back, and its paged
attention equals the contiguous cache's and JAX's TPU kernel's (run in interpret mode)."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental.pallas import tpu as pltpu

from jaxrl_llm import core
from jaxrl_llm.models import load_model, paged
from jaxrl_llm.models.sharding import make_mesh
from jaxrl_llm.rollout import engine, generate, layout, turns

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def model():
  return load_model(FIXTURES / "qwen2_untied")


def _prompts(n):
  g = np.load(FIXTURES / "qwen2_untied" / "greedy.npz")
  take = np.arange(n) % g["prompt"].shape[0]
  return jnp.asarray(g["prompt"][take]), jnp.asarray(g["prompt_mask"][take])


def _sample(model, prompt, mask, *, mesh=None, G=4, N=10, eos=(7,), **kw):
  graphdef, params = nnx.split(model)
  if mesh is not None:
    mesh = layout.decode_mesh(mesh, kw.pop("tensor", 1))
    params = layout.to_decode_layout(params, mesh, model.cfg.dtype)
  sampling = (kw.pop("temperature", 1.0), None, None)
  return engine.run(
    graphdef,
    params,
    prompt,
    mask,
    jax.random.key(11),
    jnp.asarray(eos),
    max_new_tokens=N,
    num_samples=G,
    sampling=sampling,
    mesh=mesh,
    **kw,
  )


def _assert_same_samples(a, b):
  np.testing.assert_array_equal(a.tokens_BxN, b.tokens_BxN)
  np.testing.assert_array_equal(a.mask_BxN, b.mask_BxN)
  np.testing.assert_array_equal(a.truncated_B, b.truncated_B)
  # The batch shape moves the logits' float rounding by an ulp or so.
  np.testing.assert_allclose(a.logprobs_BxN, b.logprobs_BxN, atol=1e-5)


def test_samples_do_not_depend_on_slots_pages_or_prefill_chunks(model):
  prompt, mask = _prompts(16)  # 64 rows
  base, stats = _sample(model, prompt, mask, decode_slots=64)
  assert int(stats.pages_held) == 0
  for kw in (
    dict(decode_slots=8),
    dict(decode_slots=3, page_size=3),
    dict(decode_slots=8, page_size=1, prefill_chunk=3),
    dict(decode_slots=64, page_size=64, prefill_rows=1),
  ):
    out, stats = _sample(model, prompt, mask, **kw)
    _assert_same_samples(out, base)
    assert int(stats.pages_held) == 0, kw  # every page came back
  # With fewer slots, rows wait for a slot: more decode steps, fewer pages at once.
  few, few_stats = _sample(model, prompt, mask, decode_slots=8)
  assert int(few_stats.decode_steps) > int(stats.decode_steps)
  assert int(few_stats.peak_pages) < int(_sample(model, prompt, mask)[1].peak_pages)


def test_samples_do_not_depend_on_the_mesh(model):
  prompt, mask = _prompts(8)
  one, _ = _sample(model, prompt, mask, decode_slots=8)
  for tensor, slots in ((1, 16), (2, 8), (4, 32)):
    out, stats = _sample(model, prompt, mask, mesh=make_mesh(), tensor=tensor, decode_slots=slots)
    _assert_same_samples(out, one)
    assert int(stats.pages_held) == 0
    rows = out.tokens_BxN.sharding.shard_shape(out.tokens_BxN.shape)[0]
    assert rows == 32 // (8 // tensor)  # each lane holds its block of rows


def test_behaviour_logprobs_equal_the_trainers_with_few_slots(model):
  prompt, mask = _prompts(5)
  G, P = 3, prompt.shape[1]
  out, _ = _sample(model, prompt, mask, G=G, N=12, decode_slots=4, page_size=5)
  seq = jnp.concatenate([jnp.repeat(prompt, G, 0), out.tokens_BxN], axis=1)
  seq_mask = jnp.concatenate([jnp.repeat(mask, G, 0), out.mask_BxN], axis=1)
  logits, _ = model(seq, mask_BxL=seq_mask)
  teacher = core.token_logprobs(logits[:, P - 1 : -1], out.tokens_BxN, 1.0)
  m = np.asarray(out.mask_BxN)
  assert m.sum() > 60
  np.testing.assert_allclose(np.asarray(out.logprobs_BxN)[m], np.asarray(teacher)[m], atol=1e-5)
  assert np.all(np.asarray(out.logprobs_BxN)[~m] == 0)


def test_rows_end_at_their_own_end_id_and_free_their_slots(model):
  prompt, mask = _prompts(4)
  common = dict(G=4, N=12, decode_slots=4)
  # Every id ends a row: each row is one token long.
  out, stats = _sample(model, prompt, mask, **common, temperature=0.0, eos=(-1,))
  ended = generate(
    model, prompt, mask, jax.random.key(0), max_new_tokens=12, num_samples=4,
    eos_ids=jnp.arange(model.cfg.vocab_size), decode_slots=4, with_stats=True,
  )  # fmt: skip
  np.testing.assert_array_equal(ended[0].lengths_B, 1)
  assert not np.any(ended[0].truncated_B)
  # 16 one-token rows in 4 slots: 4 decode steps, against 16 rows x 12 tokens / 4 slots.
  assert int(ended[1].decode_steps) == 4 and int(stats.decode_steps) == 48


def test_the_pool_holds_a_groups_prompt_once(model):
  """The lane's pool: S rows' own pages and the prompts', each prompt's pages once."""
  lay = engine.layout(8, 20, 4, 10, slots=8, page_size=4)
  assert lay.prompt_pages == 5 and lay.table_width == 5 + 3 + 1
  assert lay.pages == 8 * 4 + min(lay.prompts, 2 * 8 + lay.prefill_rows) * 5
  prompt, mask = _prompts(3)  # 8, 5 and 1 real tokens
  _, stats = _sample(model, prompt, mask, G=4, N=4, page_size=4, eos=(-1,))
  # 12 rows, each writing 3 tokens (the 4th is sampled, never written): the rows of the
  # prompts that end mid-page (5 and 1 tokens) copy that page, which their tokens fit in;
  # the rows of the prompt that ends on a page boundary (8 tokens) take a fresh page. The
  # prompts' pages (2 + 2 + 1) are held once each.
  assert int(stats.peak_pages) == 12 * 1 + 5


def test_paged_attention_equals_the_contiguous_cache(model):
  cfg = model.cfg
  B, L, T = 2, 13, 4
  tokens = jax.random.randint(jax.random.key(0), (B, L), 0, cfg.vocab_size)
  want, _ = model(tokens)
  pools = paged.init_pools(cfg, 16, T)
  table = jnp.array([[3, 7, 1, 9], [2, 0, 5, 11]], jnp.int32)
  got, start = [], 0
  for n in (6, 3, 1, 1, 1, 1):  # two prefill chunks, then one token at a time
    pos = jnp.broadcast_to(start + jnp.arange(n), (B, n))
    view = paged.PagedView(table, pos, jnp.ones((B, n), bool), jnp.full((B,), start + n))
    logits, cache = model(tokens[:, start : start + n], pos, None, paged.PagedCache(pools, view))
    pools, start = cache.layers, start + n
    got.append(logits)
  np.testing.assert_allclose(jnp.concatenate(got, 1), want, atol=1e-5)


def test_the_tpu_kernel_in_interpret_mode_equals_the_xla_path():
  """JAX's Pallas paged-attention kernel, run on CPU in interpret mode, against the XLA
  path. Inputs are bfloat16-exact (interpret mode runs the kernel's float32 matmuls at the
  TPU's default, bfloat16 precision); rows of 5, 17 and 32 tokens and an empty one."""
  K, P, T, H, N, W = 2, 12, 8, 128, 4, 4
  exact = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
  keys = jax.random.split(jax.random.key(0), 3)
  k_pages, v_pages = (exact(jax.random.normal(k, (K, P, T, H))) for k in keys[:2])
  q = exact(jax.random.normal(keys[2], (4, N, H))) * H**0.5  # scaled by H^-0.5: exact
  table = jnp.array([[3, 7, 1, 9], [2, 0, 5, 11], [4, 6, 8, 10], [1, 1, 1, 1]], jnp.int32)
  kv_len = jnp.array([5, 17, 32, 0], jnp.int32)
  args = (table, (kv_len - 1)[:, None], kv_len, jnp.float32)
  xla = paged.xla_attention(q[:, None], k_pages, v_pages, *args, slots_last=False)[:, 0]
  with pltpu.force_tpu_interpret_mode():
    kernel = paged.kernel_attention(q, k_pages, v_pages, table, kv_len, jnp.float32)
  np.testing.assert_allclose(kernel[:3], xla[:3], atol=1e-5)
  # The XLA path's own layout (keys with each page's slots last) gives the same.
  keys_slots_last = jnp.swapaxes(k_pages, -1, -2)
  own = paged.xla_attention(q[:, None], keys_slots_last, v_pages, *args)[:, 0]
  np.testing.assert_allclose(own, xla, atol=1e-5)
  assert paged.compute_block(W) == 4 and paged.compute_block(33) == 3


def test_the_xla_path_gathers_only_the_widths_it_needs():
  assert paged.page_widths(33) == (3, 5, 9, 17, 33)
  assert paged.page_widths(2) == (1, 2)


def test_a_turn_continues_in_its_slot_with_its_pages_kept(model):
  """Multi-turn decoding: the second turn prefills only what the pages lack (the first turn's
  last token and a reply), and its log-probs equal the teacher-forced ones over the whole
  interleaved sequence; every page comes back when the episodes end."""
  prompt, mask = _prompts(3)
  graphdef, params = nnx.split(model)
  lay = turns.layout(3, prompt.shape[1], 6, 30, 1, page_size=4, prefill_chunk=4)
  decoder = turns.Decoder(
    graphdef, params, lay, sampling=(1.0, None, None), eos_ids=[-1], pad_id=0, mesh=None
  )
  first = decoder.start(prompt, mask, jax.random.key(1))
  lens = np.asarray(mask).sum(1)
  # Six tokens each; the pages hold the prompt and five of them (the last was never run).
  np.testing.assert_array_equal(first.out.lengths_B, 6)
  np.testing.assert_array_equal(first.context_B, lens + 5)
  history = [
    list(np.asarray(prompt[i])[np.asarray(mask[i]).astype(bool)])
    + list(np.asarray(first.out.tokens_BxN[i]))
    + reply
    for i, reply in enumerate(([11, 12, 13], [21], [31, 32, 33, 34, 35]))
  ]
  new = np.zeros((3, 8), np.int32)
  n = np.array([len(h) - int(c) for h, c in zip(history, first.context_B, strict=True)])
  for i, h in enumerate(history):
    new[i, : n[i]] = h[int(first.context_B[i]) :]
  np.testing.assert_array_equal(n, [4, 2, 6])  # the last token and the reply
  second = decoder.resume(jnp.asarray(new), jnp.asarray(n), jnp.zeros(3, bool), jax.random.key(2))
  np.testing.assert_array_equal(second.context_B, [len(h) + 5 for h in history])
  for i, h in enumerate(history):
    seq = jnp.asarray([h + list(np.asarray(second.out.tokens_BxN[i]))])
    logits, _ = model(seq)
    teacher = core.token_logprobs(logits[:, len(h) - 1 : -1], seq[:, len(h) :], 1.0)
    np.testing.assert_allclose(second.out.logprobs_BxN[i], teacher[0], atol=1e-5)
  last = decoder.resume(jnp.asarray(new), jnp.asarray(n), jnp.ones(3, bool), jax.random.key(3))
  np.testing.assert_array_equal(last.out.lengths_B, 0)
  state = decoder.turns.state
  np.testing.assert_array_equal(state.free_count_D, lay.pages)  # every page is back
