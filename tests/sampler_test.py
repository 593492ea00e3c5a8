from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm import core
from jaxrl_llm.models import load_model
from jaxrl_llm.models.sharding import make_mesh, shard_params
from jaxrl_llm.rollout import generate, process_logits
from jaxrl_llm.rollout.sampler import _drop_padding_columns
from jaxrl_llm.rollout.sampling import _invert_cdf, sample_from_logprobs

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ["qwen2_untied", "qwen2_tied", "llama3"]


@pytest.fixture(scope="module")
def model():
  return load_model(FIXTURES / "qwen2_untied")


def _prompts():
  g = np.load(FIXTURES / "qwen2_untied" / "greedy.npz")
  return jnp.asarray(g["prompt"]), jnp.asarray(g["prompt_mask"])


@pytest.mark.parametrize("name", NAMES)
def test_greedy_equals_transformers_generate(name):
  ref = np.load(FIXTURES / name / "greedy.npz")
  out = generate(
    load_model(FIXTURES / name),
    jnp.asarray(ref["prompt"]),
    jnp.asarray(ref["prompt_mask"]),
    jax.random.key(0),
    max_new_tokens=int(ref["max_new_tokens"]),
    temperature=0.0,
    eos_ids=(int(ref["eos"]),),
    pad_id=0,
  )
  hf = ref["tokens"]
  np.testing.assert_array_equal(np.asarray(out.tokens_BxN)[:, : hf.shape[1]], hf)
  assert np.all(np.asarray(out.tokens_BxN)[:, hf.shape[1] :] == 0)
  # Row 0 was made to end on its 4th token: mask, length and truncation follow.
  np.testing.assert_array_equal(out.mask_BxN[0], np.arange(10) < 4)
  assert int(out.lengths_B[0]) == 4 and not bool(out.truncated_B[0])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_logprobs_equal_teacher_forced(model, temperature):
  prompt, prompt_mask = _prompts()
  out = generate(
    model,
    prompt,
    prompt_mask,
    jax.random.key(3),
    max_new_tokens=12,
    temperature=temperature,
    num_samples=3,
    eos_ids=(7,),
  )
  G, P = 3, prompt.shape[1]
  seq = jnp.concatenate([jnp.repeat(prompt, G, 0), out.tokens_BxN], axis=1)
  seq_mask = jnp.concatenate([jnp.repeat(prompt_mask, G, 0), out.mask_BxN], axis=1)
  logits, _ = model(seq, mask_BxL=seq_mask)
  teacher = core.token_logprobs(logits[:, P - 1 : -1], out.tokens_BxN, temperature)
  m = np.asarray(out.mask_BxN)
  # fp32 agreement: 1e-5 absolute at temperature 1. Dividing logits by a temperature < 1
  # scales the rounding of the two (differently ordered) computations with the log-probs'
  # size, so there the bound is 1e-5 relative (measured: at most 8e-6).
  tol = dict(atol=1e-5, rtol=0) if temperature == 1.0 else dict(atol=1e-6, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(out.logprobs_BxN)[m], np.asarray(teacher)[m], **tol)
  assert np.all(np.asarray(out.logprobs_BxN)[~m] == 0)


def test_same_key_same_samples_and_groups_differ(model):
  prompt, prompt_mask = _prompts()
  kw = dict(max_new_tokens=8, num_samples=4)
  a = generate(model, prompt, prompt_mask, jax.random.key(5), **kw)
  b = generate(model, prompt, prompt_mask, jax.random.key(5), **kw)
  c = generate(model, prompt, prompt_mask, jax.random.key(6), **kw)
  jax.tree.map(np.testing.assert_array_equal, a, b)
  assert not np.array_equal(a.tokens_BxN, c.tokens_BxN)
  groups = np.asarray(a.tokens_BxN).reshape(3, 4, 8)
  for g in groups:
    assert len({tuple(row) for row in g}) > 1


def test_all_padding_columns_change_no_sample(model):
  prompt, prompt_mask = _prompts()
  pad = 21  # the prefill drops them again, down to a multiple of 8 columns
  wide = jnp.pad(prompt, ((0, 0), (pad, 0))), jnp.pad(prompt_mask, ((0, 0), (pad, 0)))
  a, b = (
    generate(model, p, m, jax.random.key(5), max_new_tokens=8, num_samples=2)
    for p, m in ((prompt, prompt_mask), wide)
  )
  np.testing.assert_array_equal(a.tokens_BxN, b.tokens_BxN)
  np.testing.assert_allclose(a.logprobs_BxN, b.logprobs_BxN, atol=1e-5)
  first_real = int(np.argmax(np.asarray(prompt_mask).any(axis=0)))
  kept, kept_mask = _drop_padding_columns(*wide)
  assert kept.shape[1] == -(-(prompt.shape[1] - first_real) // 8) * 8 < wide[0].shape[1]
  np.testing.assert_array_equal(kept_mask.sum(), prompt_mask.sum())


def test_eos_padding_and_early_stop(model):
  prompt, prompt_mask = _prompts()
  every_token = jnp.arange(model.cfg.vocab_size)
  out = generate(
    model, prompt, prompt_mask, jax.random.key(0), max_new_tokens=6, eos_ids=every_token, pad_id=0
  )
  np.testing.assert_array_equal(out.lengths_B, 1)
  assert not np.any(out.truncated_B)
  np.testing.assert_array_equal(out.tokens_BxN[:, 1:], 0)
  np.testing.assert_array_equal(out.mask_BxN, np.broadcast_to(np.arange(6) < 1, (3, 6)))
  free = generate(model, prompt, prompt_mask, jax.random.key(0), max_new_tokens=6)
  assert np.all(free.truncated_B) and np.all(free.lengths_B == 6)


def test_top_k_1_and_tiny_top_p_equal_greedy(model):
  prompt, prompt_mask = _prompts()
  kw = dict(max_new_tokens=8, num_samples=2)
  greedy = generate(model, prompt, prompt_mask, jax.random.key(0), temperature=0.0, **kw)
  top1 = generate(model, prompt, prompt_mask, jax.random.key(1), top_k=1, **kw)
  nucleus = generate(model, prompt, prompt_mask, jax.random.key(2), top_p=1e-6, **kw)
  np.testing.assert_array_equal(top1.tokens_BxN, greedy.tokens_BxN)
  np.testing.assert_array_equal(nucleus.tokens_BxN, greedy.tokens_BxN)
  np.testing.assert_allclose(top1.logprobs_BxN, 0.0, atol=1e-6)  # a point mass


def test_process_logits_by_hand():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.15, 0.05]]))
  np.testing.assert_allclose(
    jnp.exp(process_logits(logits, 1.0, top_k=2)), [[0.625, 0.375, 0, 0]], atol=1e-6
  )
  # top_p=0.7 keeps the smallest most-likely set reaching 0.7: {0.5, 0.3}.
  np.testing.assert_allclose(
    jnp.exp(process_logits(logits, 1.0, top_p=0.7)), [[0.625, 0.375, 0, 0]], atol=1e-6
  )
  np.testing.assert_allclose(
    jnp.exp(process_logits(logits, 1.0, top_p=0.85)),
    [[0.5, 0.3, 0.15, 0]] / np.float32(0.95),
    atol=1e-6,
  )
  hot = jnp.exp(process_logits(logits, 2.0))
  expected = np.sqrt([0.5, 0.3, 0.15, 0.05])
  np.testing.assert_allclose(hot, [expected / expected.sum()], atol=1e-6)


@pytest.mark.parametrize("V", [50, 3000])  # one level; two levels with a padded last block
def test_inverse_cdf_draws_follow_the_distribution(V):
  rng = np.random.default_rng(V)
  logits = rng.normal(size=V) * 2
  logits[rng.random(V) < 0.3] = -np.inf  # cut tokens (as top-k/top-p leave them)
  logits[:200] = -np.inf if V > 200 else logits[:200]  # a whole block without mass
  logits[-1] = -np.inf
  logp = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32))
  rows = 20_000
  draw = jax.jit(lambda k: sample_from_logprobs(k, jnp.broadcast_to(logp, (rows, V))))
  tokens = np.concatenate([np.asarray(draw(jax.random.key(i))) for i in range(10)])
  counts = np.bincount(tokens, minlength=V)
  probs = np.exp(np.asarray(logp, np.float64))
  assert counts[probs == 0].sum() == 0
  expected = probs * len(tokens)
  kept = expected > 0
  chi2 = ((counts[kept] - expected[kept]) ** 2 / expected[kept]).sum()
  dof = kept.sum() - 1
  assert chi2 < dof + 5 * np.sqrt(2 * dof), (chi2, dof)


def test_a_target_past_the_last_sum_draws_the_last_possible_token():
  probs = jnp.array([[0.5, 0.5, 0.0, 0.0]])
  cdf = jnp.cumsum(probs, axis=-1)
  assert int(_invert_cdf(cdf, jnp.array([[1.0]]), probs)[0]) == 1
  assert int(_invert_cdf(cdf, jnp.array([[0.5]]), probs)[0]) == 1
  assert int(_invert_cdf(cdf, jnp.array([[0.49]]), probs)[0]) == 0


def test_8_device_mesh_gives_same_samples(model):
  prompt, prompt_mask = _prompts()
  kw = dict(max_new_tokens=8, num_samples=8, top_k=20, temperature=0.9)
  single = generate(model, prompt, prompt_mask, jax.random.key(11), **kw)
  mesh = make_mesh(data=4, fsdp=1, tensor=2)
  graphdef, params = nnx.split(model)
  sharded_params = shard_params(params, mesh)
  multi = generate(
    graphdef, prompt, prompt_mask, jax.random.key(11), params=sharded_params, mesh=mesh, **kw
  )
  assert {s.data.shape for s in multi.tokens_BxN.addressable_shards} == {(6, 8)}  # 24 rows / 4
  np.testing.assert_array_equal(multi.tokens_BxN, single.tokens_BxN)
  np.testing.assert_allclose(multi.logprobs_BxN, single.logprobs_BxN, atol=1e-5)


def test_bad_arguments(model):
  prompt, prompt_mask = _prompts()
  with pytest.raises(ValueError, match="one \\[B, P\\] shape"):
    generate(model, prompt, prompt_mask[:, :3], jax.random.key(0), max_new_tokens=2)
  with pytest.raises(ValueError, match="top_p"):
    generate(model, prompt, prompt_mask, jax.random.key(0), max_new_tokens=2, top_p=1.5)
  with pytest.raises(ValueError, match="must divide over the decode mesh"):
    generate(
      model, prompt, prompt_mask, jax.random.key(0), max_new_tokens=2, mesh=make_mesh(data=8)
    )
