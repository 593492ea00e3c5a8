"""The NNX transformer against transformers' logits, and its own invariants."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models import (
  CausalLM,
  CheckpointError,
  ModelConfig,
  RewardModel,
  ValueModel,
  apply,
  completion_hidden,
  contract,
  init_cache,
  load_model,
  logical_axes,
  positions_from_mask,
  save_model,
)
from jaxrl_llm.models.transformer import LOGICAL_AXES

FIXTURES = Path(__file__).parent / "fixtures"
NAMES = ["qwen2_untied", "qwen2_tied", "llama3"]
TINY = ModelConfig(
  vocab_size=64,
  hidden_size=32,
  intermediate_size=48,
  num_layers=2,
  num_heads=4,
  num_kv_heads=2,
  qkv_bias=True,
)


def _reference(name):
  return dict(np.load(FIXTURES / name / "reference.npz"))


@pytest.fixture(scope="module", params=NAMES)
def fixture_model(request):
  return request.param, load_model(FIXTURES / request.param)


def test_logits_match_transformers(fixture_model):
  name, model = fixture_model
  ref = _reference(name)
  valid = ref["mask"].astype(bool)
  for positions, key in ((ref["positions"], "logits"), (ref["positions"] + 1000, "logits_far")):
    logits, _ = model(jnp.asarray(ref["tokens"]), jnp.asarray(positions), jnp.asarray(ref["mask"]))
    assert logits.dtype == jnp.float32
    diff = np.abs(np.asarray(logits) - ref[key])[valid].max()
    assert diff <= 1e-4, (name, key, diff)
    # The comparison is not trivially close: logits vary far more than the tolerance.
    assert ref[key][valid].std() > 0.1


def test_fixture_architectures_are_what_they_claim():
  cfgs = {name: load_model(FIXTURES / name).cfg for name in NAMES}
  assert (
    cfgs["qwen2_untied"].architecture == "qwen2" and not cfgs["qwen2_untied"].tie_word_embeddings
  )
  assert cfgs["qwen2_tied"].tie_word_embeddings and cfgs["qwen2_tied"].qkv_bias
  assert cfgs["llama3"].rope_scaling is not None and not cfgs["llama3"].qkv_bias
  assert (FIXTURES / "llama3" / "model.safetensors.index.json").exists()  # sharded load


def test_causality():
  model = CausalLM(TINY, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(1), (2, 10), 0, TINY.vocab_size)
  logits, _ = model(tokens)
  changed, _ = model(tokens.at[:, 6].set((tokens[:, 6] + 1) % TINY.vocab_size))
  np.testing.assert_array_equal(changed[:, :6], logits[:, :6])
  assert np.abs(changed[:, 6:] - logits[:, 6:]).max() > 1e-3


def test_left_padding_invariance():
  model = CausalLM(TINY, rngs=nnx.Rngs(0))
  tokens = jax.random.randint(jax.random.key(2), (1, 7), 0, TINY.vocab_size)
  plain, _ = model(tokens)
  padded_tokens = jnp.concatenate([jnp.full((1, 5), 3), tokens], axis=1)  # pad id is arbitrary
  mask = jnp.arange(12)[None, :] >= 5
  padded, _ = model(padded_tokens, mask_BxL=mask)
  np.testing.assert_allclose(padded[:, 5:], plain, atol=1e-5, rtol=1e-5)
  np.testing.assert_array_equal(positions_from_mask(mask)[0, 5:], jnp.arange(7))


@pytest.mark.parametrize("name", NAMES)
def test_save_load_round_trip_is_bitwise(name, tmp_path):
  model = load_model(FIXTURES / name)
  save_model(model, tmp_path / "out")
  again = load_model(tmp_path / "out")
  assert again.cfg == model.cfg
  jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(model))


def test_save_shards_when_large(tmp_path):
  model = CausalLM(TINY, rngs=nnx.Rngs(0))
  save_model(model, tmp_path, max_shard_bytes=20_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  assert len(set(index["weight_map"].values())) > 2
  jax.tree.map(np.testing.assert_array_equal, nnx.state(load_model(tmp_path)), nnx.state(model))


def test_bf16_params_round_trip(tmp_path):
  model = load_model(FIXTURES / "qwen2_untied", dtype=jnp.bfloat16)
  save_model(model, tmp_path)
  assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
  again = load_model(tmp_path, dtype=jnp.bfloat16)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(again), nnx.state(model))


@pytest.mark.parametrize("prompt_len", [1, 4])
def test_kv_cache_decoding_equals_full_forward(prompt_len):
  model = load_model(FIXTURES / "llama3")
  ref = _reference("llama3")
  tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask"])
  positions = positions_from_mask(mask)
  full, _ = model(tokens, positions, mask)
  B, L = tokens.shape
  cache = init_cache(model.cfg, B, L + 3)  # spare slots stay empty and masked
  step_logits = []
  logits, cache = model(
    tokens[:, :prompt_len], positions[:, :prompt_len], mask[:, :prompt_len], cache
  )
  step_logits.append(logits)
  decode = jax.jit(lambda g, p, t, pos, m, c: apply(g, p, t, pos, m, c))
  graphdef, params = nnx.split(model)
  for t in range(prompt_len, L):
    logits, cache = decode(
      graphdef, params, tokens[:, t : t + 1], positions[:, t : t + 1], mask[:, t : t + 1], cache
    )
    step_logits.append(logits)
  incremental = jnp.concatenate(step_logits, axis=1)
  valid = np.asarray(mask, bool)
  np.testing.assert_allclose(np.asarray(incremental)[valid], np.asarray(full)[valid], atol=1e-5)
  assert int(cache.index) == L


@pytest.mark.parametrize(
  "equation, a_shape, b_shape",
  [
    ("bkglh,bkhs->bkgls", (2, 3, 2, 1, 8), (2, 3, 8, 5)),  # scores over transposed keys
    ("bkglh,bksh->bkgls", (2, 3, 2, 1, 8), (2, 3, 5, 8)),
    ("bkgls,bksh->bkglh", (2, 3, 2, 1, 5), (2, 3, 5, 8)),  # probabilities times values
  ],
)
def test_one_query_product_sum_equals_the_matmul(equation, a_shape, b_shape):
  # A decode step's attention is a product-sum on CPU and a matmul elsewhere: both the same.
  ka, kb = jax.random.split(jax.random.key(0))
  a = jax.random.normal(ka, a_shape).astype(jnp.bfloat16)
  b = jax.random.normal(kb, b_shape).astype(jnp.bfloat16)
  got = contract.product_sum(equation, a, b)
  want = jnp.einsum(equation, a, b, preferred_element_type=jnp.float32)
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
  with pytest.raises(ValueError, match="no product-sum"):
    contract.product_sum("bkgls,bkhs->bkglh", a, b)


def test_shared_prompt_forward_equals_one_prompt_per_row():
  """completion_hidden with groups sharing a prompt: same hidden states and gradients as
  running every row's prompt, with left padding and completions that end early."""
  model = load_model(FIXTURES / "qwen2_untied")
  ref = _reference("qwen2_untied")
  G, N = 3, 5
  prompt = jnp.repeat(jnp.asarray(ref["tokens"]), G, axis=0)
  prompt_mask = jnp.repeat(jnp.asarray(ref["mask"], bool), G, axis=0)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(1, model.cfg.vocab_size, (prompt.shape[0], N)))
  mask = jnp.asarray(np.arange(N)[None, :] < rng.integers(1, N + 1, (prompt.shape[0], 1)))
  graphdef, params = nnx.split(model)

  def loss(params, group):
    m = nnx.merge(graphdef, params)
    hidden = completion_hidden(m.decoder, prompt, prompt_mask, tokens, mask, group)
    return jnp.sum(jnp.where(mask[..., None], jnp.sin(hidden), 0.0)), hidden

  forward = jax.jit(jax.value_and_grad(loss, has_aux=True), static_argnums=1)
  (l_row, h_row), g_row = forward(params, 1)
  (l_grp, h_grp), g_grp = forward(params, G)
  assert h_grp.shape == (prompt.shape[0], N, model.cfg.hidden_size)
  valid = np.asarray(mask)
  np.testing.assert_allclose(np.asarray(h_grp)[valid], np.asarray(h_row)[valid], atol=1e-5)
  np.testing.assert_allclose(l_grp, l_row, rtol=1e-5)
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max()),
    g_grp,
    g_row,
  )
  with pytest.raises(ValueError, match="do not form groups of 4"):
    completion_hidden(model.decoder, prompt, prompt_mask, tokens, mask, 4)


def test_bf16_forward_close_to_fp32():
  ref = _reference("qwen2_untied")
  args = [jnp.asarray(ref[k]) for k in ("tokens", "positions", "mask")]
  fp32, _ = load_model(FIXTURES / "qwen2_untied")(*args)
  bf16_model = load_model(FIXTURES / "qwen2_untied", dtype=jnp.bfloat16)
  assert bf16_model.decoder.embed_VxD[...].dtype == jnp.bfloat16
  bf16, _ = bf16_model(*args)
  assert bf16.dtype == jnp.float32  # logits for log-probs are fp32 even in bf16
  valid = ref["mask"].astype(bool)
  diff = np.abs(np.asarray(bf16) - np.asarray(fp32))[valid]
  scale = np.abs(np.asarray(fp32))[valid].max()
  assert diff.max() < 0.05 * scale, (diff.max(), scale)
  logp32 = jax.nn.log_softmax(fp32, -1)[valid]
  logp16 = jax.nn.log_softmax(bf16, -1)[valid]
  kl = np.sum(np.exp(logp32) * (logp32 - logp16), -1)  # KL(fp32 || bf16) per position
  assert kl.max() < 5e-3, kl.max()


def test_every_param_has_logical_axes():
  for cls in (CausalLM, ValueModel, RewardModel):
    model = cls(TINY.replace(qkv_bias=True, o_bias=True), rngs=nnx.Rngs(0))
    params = nnx.state(model, nnx.Param)
    axes = logical_axes(model)
    for p, a in zip(
      jax.tree.leaves(params),
      jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)),
      strict=True,
    ):
      assert len(a) == p.ndim and set(a) <= set(LOGICAL_AXES), (a, p.shape)


def test_split_merge_under_jit():
  """The functional pattern: split once, pass params through jit, merge inside."""
  model = CausalLM(TINY, rngs=nnx.Rngs(0))
  graphdef, params = nnx.split(model)
  tokens = jnp.arange(12).reshape(2, 6)

  @jax.jit
  def loss(params, tokens):
    logits, _ = apply(graphdef, params, tokens)
    return -jnp.mean(jax.nn.log_softmax(logits)[:, :-1].max(-1))

  value, grads = jax.value_and_grad(loss)(params, tokens)
  assert np.isfinite(value)
  assert jax.tree.structure(grads) == jax.tree.structure(params)
  np.testing.assert_array_equal(apply(graphdef, params, tokens)[0], model(tokens)[0])


def test_value_model_from_policy_and_reward_model():
  policy = load_model(FIXTURES / "qwen2_untied")
  critic = ValueModel.from_policy(policy, rngs=nnx.Rngs(3))
  jax.tree.map(np.testing.assert_array_equal, nnx.state(critic.decoder), nnx.state(policy.decoder))
  ref = _reference("qwen2_untied")
  tokens, mask = jnp.asarray(ref["tokens"]), jnp.asarray(ref["mask"])
  values = critic(tokens, mask_BxL=mask)
  assert values.shape == tokens.shape and values.dtype == jnp.float32
  rm = RewardModel.from_policy(policy, rngs=nnx.Rngs(4))
  right_padded = jnp.asarray([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
  rmask = jnp.asarray([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
  scores = rm(right_padded, mask_BxL=rmask)
  per_token = rm.per_token(right_padded, mask_BxL=rmask)
  np.testing.assert_allclose(scores, [per_token[0, 2], per_token[1, 4]], rtol=1e-6)


# Bad checkpoints: errors that name the tensor and the file.


def _copy(name, tmp_path):
  dst = tmp_path / name
  shutil.copytree(FIXTURES / name, dst)
  return dst


def test_unsupported_architecture(tmp_path):
  path = _copy("qwen2_untied", tmp_path)
  cfg = json.loads((path / "config.json").read_text())
  cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
  (path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match="MistralForCausalLM.*not supported"):
    load_model(path)


def test_missing_tensor_names_tensor_and_file(tmp_path):
  path = _copy("llama3", tmp_path)
  index_file = path / "model.safetensors.index.json"
  index = json.loads(index_file.read_text())
  del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
  index_file.write_text(json.dumps(index))
  with pytest.raises(
    CheckpointError, match=r"'model\.layers\.1\.mlp\.up_proj\.weight' is missing from .*index"
  ):
    load_model(path)


def test_shape_mismatch_names_tensor_and_file(tmp_path):
  path = _copy("qwen2_untied", tmp_path)
  cfg = json.loads((path / "config.json").read_text())
  cfg["intermediate_size"] = 80
  (path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(
    CheckpointError,
    match=r"'model\.layers\.0\.mlp\.gate_proj\.weight' in .*model\.safetensors "
    r"has shape \[64, 32\]; this config\.json implies \[80, 32\]",
  ):
    load_model(path)


def test_unexpected_tensor_and_missing_files(tmp_path):
  path = _copy("qwen2_untied", tmp_path)
  cfg = json.loads((path / "config.json").read_text())
  cfg["num_hidden_layers"] = 1
  (path / "config.json").write_text(json.dumps(cfg))
  with pytest.raises(CheckpointError, match=r"'model\.layers\.1\..*' in .*model\.safetensors"):
    load_model(path)
  (path / "model.safetensors").rename(path / "pytorch_model.bin")
  with pytest.raises(CheckpointError, match="pickle"):
    load_model(path)
  with pytest.raises(CheckpointError, match="not a directory"):
    load_model(path / "nope")


def test_config_validation_names_the_key():
  with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
    TINY.replace(num_heads=6, num_kv_heads=4)


def test_llama3_rope_scaling_is_exercised():
  """Without its rope scaling the llama3 fixture's far-position logits are far off, so the
  parity test above really checks the scaling."""
  model = load_model(FIXTURES / "llama3")
  unscaled = CausalLM(model.cfg.replace(rope_scaling=None), rngs=nnx.Rngs(0))
  nnx.update(unscaled, nnx.state(model))
  ref = _reference("llama3")
  logits, _ = unscaled(
    jnp.asarray(ref["tokens"]), jnp.asarray(ref["positions"] + 1000), jnp.asarray(ref["mask"])
  )
  assert np.abs(np.asarray(logits) - ref["logits_far"])[ref["mask"].astype(bool)].max() > 0.1
