"""The memory settings change what is kept, never what is computed: log-probs and entropies
from hidden states in chunks, chunked attention, rematerialisation and scanned layers give
the experience and the gradients of the full-logit path, under micro-batching, in bf16 and
on an 8-device mesh; and no pass of the compiled update holds `[B, N, V]`."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import OnesTask, one_batch, small_config

from jaxrl_llm import core
from jaxrl_llm import export as export_lib
from jaxrl_llm.models import load_model, save_model
from jaxrl_llm.models.sharding import make_mesh
from jaxrl_llm.rollout import generate
from jaxrl_llm.train import loop as loop_lib
from jaxrl_llm.train import step as step_lib
from jaxrl_llm.train import train
from jaxrl_llm.train.learner import Learner

FIXTURE = "tests/fixtures/qwen2_tied"  # the same weights in every layout
FULL = {"model.logprob_chunk_tokens": 0, "model.attention_chunk": 0}
# Chunks smaller than the completions (5 tokens; 2 rows x 1 position per log-prob chunk),
# so every pass really runs in pieces.
CHUNKED = {"model.logprob_chunk_tokens": 2, "model.attention_chunk": 2}
SETTINGS = {
  "chunked": CHUNKED,
  "remat_full_scanned": CHUNKED | {"model.remat": "full", "model.scan_layers": True},
  "remat_dots": CHUNKED | {"model.remat": "dots_with_no_batch_dims_saveable"},
}


def _config(tmp_path, setting, **overrides):
  base = {
    "model.path": FIXTURE,
    "model.num_layers": 2,
    "algo.kl_coef": 0.1,
    "algo.entropy_coef": 0.01,
    "algo.ppo_epochs": 2,  # old log-probs come from their own pass
    "algo.share_prompts": False,
  }
  return small_config(tmp_path, **base, **setting, **overrides)


def make_learner(cfg, devices):
  tok = loop_lib.Task(cfg).tokenizer
  learner = Learner(cfg, make_mesh(devices=devices), tok.vocab_size, tok.eos_id, tok.pad_id)
  learner.init_state()
  return learner


def _unstacked(params):
  """Scanned layers' stacked params as the unrolled layout's {layer: params}."""
  pure = nnx.to_pure_dict(params)
  layers = pure["decoder"]["layers"]
  if 0 not in layers:  # stacked
    n = jax.tree.leaves(layers)[0].shape[0]
    pure["decoder"]["layers"] = {i: jax.tree.map(lambda x, i=i: x[i], layers) for i in range(n)}
  return pure


def _experience_and_grads(cfg, devices, batch=None):
  """The experience of one rollout and the policy gradient, accumulated over 2 micro-batches."""
  learner = make_learner(cfg, devices)
  batch = one_batch(learner, cfg) if batch is None else learner.shard_batch(batch)
  exp, _ = learner.experience(batch)
  objective = functools.partial(
    step_lib.policy_objective, policy_def=learner.policy_def, cfg=cfg, algo=step_lib.algorithm(cfg)
  )
  denominator = core.aggregate_denominator(exp.loss_mask_BxN, cfg.algo.aggregation)
  noise = jax.random.normal(jax.random.key(1), exp.old_logp_BxN.shape) * 0.3
  exp = exp._replace(old_logp_BxN=exp.old_logp_BxN + noise)  # ratios away from 1
  micro = jax.tree.map(lambda x: x.reshape(2, -1, *x.shape[1:]), exp)
  loss, grads, metrics = jax.jit(step_lib._accumulate, static_argnums=0)(
    objective, learner.state.policy, micro, denominator, learner.state.kl.coef, 0.01
  )
  host = jax.device_get
  return host(batch), host(exp), host(loss), _unstacked(host(grads)), host(metrics)


def _assert_same(got, want, rtol, atol):
  _, exp, loss, grads, metrics = got
  _, want_exp, want_loss, want_grads, want_metrics = want
  close = functools.partial(np.testing.assert_allclose, rtol=rtol, atol=atol)
  for name in ("old_logp_BxN", "ref_logp_BxN", "advantages_BxN"):
    close(getattr(exp, name), getattr(want_exp, name), err_msg=name)
  close(loss, want_loss)
  jax.tree.map(close, metrics, want_metrics)
  # Gradients: to the float rounding of their largest entry.
  scale = max(float(np.abs(g).max()) for g in jax.tree.leaves(want_grads))
  jax.tree.map(functools.partial(close, atol=10 * atol * scale), grads, want_grads)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
  """The full-logit, unchunked, unrolled path, and the rollout every setting scores."""
  cfg = _config(tmp_path_factory.mktemp("full"), FULL)
  return _experience_and_grads(cfg, jax.devices()[:1])


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_memory_settings_equal_the_full_logit_path(tmp_path, baseline, setting):
  cfg = _config(tmp_path, SETTINGS[setting])
  got = _experience_and_grads(cfg, jax.devices()[:1], batch=baseline[0])
  _assert_same(got, baseline, rtol=1e-5, atol=1e-5)


def test_chunked_on_an_8_device_mesh_equals_one_device(tmp_path, baseline):
  cfg = _config(tmp_path, SETTINGS["remat_full_scanned"], **{"mesh.data": 4, "mesh.fsdp": 2})
  got = _experience_and_grads(cfg, jax.devices(), batch=baseline[0])
  _assert_same(got, baseline, rtol=1e-5, atol=1e-5)


def test_bf16_compute_chunked_equals_bf16_full_logits(tmp_path):
  bf16 = {"model.dtype": "bfloat16"}
  full = _experience_and_grads(_config(tmp_path, FULL | bf16), jax.devices()[:1])
  cfg = _config(tmp_path, SETTINGS["remat_full_scanned"] | bf16)
  got = _experience_and_grads(cfg, jax.devices()[:1], batch=full[0])
  # Log-probs stay float32; bf16 activations round the same way on both paths.
  assert got[1].old_logp_BxN.dtype == np.float32
  _assert_same(got, full, rtol=2e-2, atol=2e-2)


def test_the_compiled_update_never_holds_BxNxV(tmp_path):
  """No value anywhere in the policy update's jaxpr (forward and backward, every micro-batch
  and scan body) has a micro-batch's rows x completion tokens x vocab elements."""
  cfg = _config(tmp_path, CHUNKED, **{"rollout.max_new_tokens": 8})
  learner = make_learner(cfg, jax.devices()[:1])
  exp, _ = learner.experience(one_batch(learner, cfg))
  V, N = learner.model_cfg.vocab_size, exp.batch.tokens_BxN.shape[1]
  rows = cfg.micro_batch_rows

  def big(jaxpr):
    found = []
    for eqn in jaxpr.eqns:
      for var in eqn.outvars:
        shape = getattr(var.aval, "shape", ())
        if shape and shape[-1] == V and np.prod(shape) >= rows * N * V:
          found.append((eqn.primitive.name, shape))
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        found += big(sub)
    return found

  update = functools.partial(
    step_lib.update,
    policy_def=learner.policy_def,
    critic_def=None,
    cfg=cfg,
    algo=step_lib.algorithm(cfg),
    optimizers=learner.optimizers,
  )
  assert not big(jax.make_jaxpr(update)(learner.state, exp).jaxpr)
  # The check can fail: the full-logit path holds them.
  full_cfg = _config(tmp_path, FULL, **{"rollout.max_new_tokens": 8})
  full = functools.partial(update, cfg=full_cfg)
  assert big(jax.make_jaxpr(full)(learner.state, exp).jaxpr)


def test_the_sampler_prefill_unembeds_only_the_last_position():
  model = load_model(FIXTURE, scan_layers=True, attention_chunk=4)
  graphdef, params = nnx.split(model)
  B, P, V = 2, 12, model.cfg.vocab_size
  prompt = jnp.ones((B, P), jnp.int32)
  sample = lambda params, prompt: generate(
    graphdef, prompt, prompt > 0, jax.random.key(0), params=params, max_new_tokens=3
  )
  shapes = []

  def visit(jaxpr):
    for eqn in jaxpr.eqns:
      shapes.extend(getattr(v.aval, "shape", ()) for v in eqn.outvars)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        visit(sub)

  visit(jax.make_jaxpr(sample)(params, prompt).jaxpr)
  assert (B, 1, V) in shapes  # the last position's logits
  assert not [s for s in shapes if len(s) >= 2 and s[-1] == V and s[-2] == P]


def test_scanned_layers_load_and_save_the_same_checkpoint(tmp_path):
  unrolled = load_model(FIXTURE)
  scanned = load_model(FIXTURE, scan_layers=True, remat="full", attention_chunk=3)
  q = scanned.decoder.layers.attn.q_DxNxH
  assert q.shape[0] == unrolled.cfg.num_layers and q.logical_axes[0] == "layers"
  tokens = jnp.arange(14).reshape(2, 7) % unrolled.cfg.vocab_size
  np.testing.assert_allclose(scanned(tokens)[0], unrolled(tokens)[0], rtol=1e-5, atol=1e-5)
  save_model(scanned, tmp_path / "out")
  again = load_model(tmp_path / "out")
  jax.tree.map(
    np.testing.assert_array_equal,
    nnx.to_pure_dict(nnx.state(again, nnx.Param)),
    nnx.to_pure_dict(nnx.state(unrolled, nnx.Param)),
  )


def test_bad_memory_keys_name_the_key(tmp_path):
  with pytest.raises(ValueError, match=r"config.model.remat='some'.*'full'"):
    small_config(tmp_path, **{"model.remat": "some"})
  with pytest.raises(
    ValueError, match=r"config.model.logprob_chunk_tokens=-1 is out of range: it must be >= 0"
  ):
    small_config(tmp_path, **{"model.logprob_chunk_tokens": -1})
  with pytest.raises(
    ValueError, match=r"config.model.attention_chunk=-2 is out of range: it must be >= 0"
  ):
    small_config(tmp_path, **{"model.attention_chunk": -2})


@pytest.mark.slow  # three runs of the trainer
def test_a_scanned_run_checkpoints_resumes_and_exports(tmp_path):
  """Orbax checkpoints hold the stacked layout as it is; a resumed run continues from them,
  and the export writes the per-layer Hugging Face tensors."""
  scanned = {"model.scan_layers": True, "model.remat": "full", "checkpoint.every": 1}
  cfg = small_config(tmp_path, **scanned, **{"run.steps": 2})
  summary = train(cfg, task=OnesTask(cfg), devices=jax.devices()[:1])
  learner = summary["learner"]
  policy = nnx.merge(learner.policy_def, jax.device_get(learner.state.policy))
  out = export_lib.export(tmp_path / "run", tmp_path / "hf")
  tokens = jnp.asarray([loop_lib.Task(cfg).tokenizer.encode("47+15=62")])
  np.testing.assert_allclose(load_model(out)(tokens)[0], policy(tokens)[0], rtol=1e-6, atol=1e-6)
  longer = small_config(tmp_path, **scanned, **{"run.steps": 3})
  resumed = train(longer, task=OnesTask(longer), devices=jax.devices()[:1])["learner"]
  assert int(resumed.state.step) == 3
