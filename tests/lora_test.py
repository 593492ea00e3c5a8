"""LoRA and QLoRA: adapters on a frozen (or quantized) base, the reference for free, sampling,
checkpoints and export."""

import json
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import qwix
from flax import nnx
from helpers import (
  OnesTask,
  assert_bitwise_equal,
  make_learner,
  one_batch,
  run_cli,
  run_killed,
  small_config,
  subprocess_env,
)
from safetensors.numpy import load_file, save_file

from jaxrl_llm import core
from jaxrl_llm import export as export_lib
from jaxrl_llm.models import load_model
from jaxrl_llm.models import lora as lora_lib
from jaxrl_llm.models.sharding import make_mesh, shard_params
from jaxrl_llm.rollout import generate
from jaxrl_llm.train import ConfigError, train
from jaxrl_llm.train import step as step_lib

FIXTURES = Path(__file__).parent / "fixtures"
TOKENS = jnp.array([[5, 17, 3, 250, 9, 41, 77, 2], [0, 0, 12, 13, 14, 15, 16, 17]])
MASK = TOKENS != 0
# How far a quantized weight is from the float one (relative Frobenius norm), as measured on
# the fixture (int8 0.005, int4 0.11, nf4 0.09 with tiles of 16), with room to spare. The
# logit bounds on a real model are in smollm2_test.
WEIGHT_BOUNDS = {"int8": 0.01, "int4": 0.15, "nf4": 0.12}


def _adapted(scan=False, targets=tuple(lora_lib.TARGETS), noise=0.05, quantize=None):
  """The fixture model with rank-4 adapters whose B is random (so they change the output)."""
  model = load_model(FIXTURES / "qwen2_untied", scan_layers=scan)
  if quantize:
    model = lora_lib.quantize_base(model, quantize, tile=16)
  model = lora_lib.add_adapters(model, lora_lib.LoraConfig(4, alpha=8.0, targets=targets), seed=1)
  if noise:
    adapters = nnx.state(model, nnx.LoRAParam)
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(adapters))))
    nnx.update(
      model, jax.tree.map(lambda x: x + noise * jax.random.normal(next(keys), x.shape), adapters)
    )
  return model


@pytest.mark.parametrize("scan", [False, True])
def test_fresh_adapters_leave_the_logits_exact(scan):
  base = load_model(FIXTURES / "qwen2_untied", scan_layers=scan)
  expected = np.asarray(base(TOKENS, mask_BxL=MASK)[0])
  model = _adapted(scan, noise=0.0)
  np.testing.assert_array_equal(np.asarray(model(TOKENS, mask_BxL=MASK)[0]), expected)
  assert not np.array_equal(np.asarray(_adapted(scan)(TOKENS, mask_BxL=MASK)[0]), expected)


def test_targets_choose_the_projections_and_carry_logical_axes():
  assert lora_lib.resolve_targets("attn\\..*") == ("q", "k", "v", "o")
  assert lora_lib.resolve_targets("v, q") == ("q", "v")
  assert lora_lib.resolve_targets(["mlp.gate", "up|down"]) == ("gate", "up", "down")
  with pytest.raises(ValueError, match="matches no projection"):
    lora_lib.resolve_targets("qkv")
  model = _adapted(targets=("q", "down"))
  names = {str(path[-1]) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
  assert names == {"q_lora_a", "q_lora_b", "down_lora_a", "down_lora_b"}
  attn = model.decoder.layers[0].attn
  assert attn.q_lora_a.logical_axes == ("embed", "lora")
  assert attn.q_lora_b.logical_axes == ("lora", "heads", "head_dim")


@pytest.mark.parametrize("scan", [False, True])
def test_merged_model_equals_the_adapter_forward(scan):
  model = _adapted(scan)
  merged = lora_lib.merge_adapters(model)
  assert merged.cfg.lora is None and not nnx.state(merged, nnx.LoRAParam)
  expected = np.asarray(model(TOKENS, mask_BxL=MASK)[0])
  # float32 rounding of two orders of summation, relative to the logit scale
  scale = np.abs(expected).max()
  np.testing.assert_allclose(
    np.asarray(merged(TOKENS, mask_BxL=MASK)[0]), expected, atol=1e-5 * scale
  )


@pytest.mark.parametrize("qtype", sorted(WEIGHT_BOUNDS))
def test_quantized_base_stores_low_bit_weights_close_to_the_float_ones(qtype):
  floats = load_model(FIXTURES / "qwen2_untied")
  model = lora_lib.quantize_base(load_model(FIXTURES / "qwen2_untied"), qtype, tile=16)
  for name in ("q_DxNxH", "o_NxHxD"):
    stored = getattr(model.decoder.layers[0].attn, name)[...]
    assert isinstance(stored, qwix.QArray)
    assert stored.qvalue.dtype == {"int8": jnp.int8, "int4": jnp.int4, "nf4": jnp.uint4}[qtype]
    w = getattr(floats.decoder.layers[0].attn, name)[...]
    error = jnp.linalg.norm(qwix.dequantize(stored) - w) / jnp.linalg.norm(w)
    assert 0 < error < WEIGHT_BOUNDS[qtype], (name, error)
  # Embeddings and norms keep their float values.
  np.testing.assert_array_equal(model.decoder.embed_VxD[...], floats.decoder.embed_VxD[...])
  expected = np.asarray(floats(TOKENS, mask_BxL=MASK)[0])
  logits = np.asarray(model(TOKENS, mask_BxL=MASK)[0])
  assert np.all(np.isfinite(logits)) and not np.array_equal(logits, expected)


@pytest.mark.parametrize("tensor", [None, 2])  # one device; FSDP x 8 decoded with tensor 2
@pytest.mark.parametrize("quantize", [None, "nf4"])
def test_sampled_logprobs_equal_teacher_forced_with_adapters(quantize, tensor):
  model = _adapted(quantize=quantize)
  prompt, prompt_mask = TOKENS[:, :5], MASK[:, :5]
  kw = dict(max_new_tokens=8, num_samples=2)
  if tensor:  # the adapters (and the quantized base) in the decode layout
    mesh = make_mesh(data=1, fsdp=8, tensor=1)
    graphdef, params = nnx.split(model)
    kw |= dict(params=shard_params(params, mesh), mesh=mesh, tensor=tensor)
  out = generate(graphdef if tensor else model, prompt, prompt_mask, jax.random.key(3), **kw)
  seq = jnp.concatenate([jnp.repeat(prompt, 2, 0), out.tokens_BxN], axis=1)
  seq_mask = jnp.concatenate([jnp.repeat(prompt_mask, 2, 0), out.mask_BxN], axis=1)
  logits, _ = model(seq, mask_BxL=seq_mask)
  teacher = core.token_logprobs(logits[:, 4:-1], out.tokens_BxN, 1.0)
  m = np.asarray(out.mask_BxN)
  np.testing.assert_allclose(np.asarray(out.logprobs_BxN)[m], np.asarray(teacher)[m], atol=1e-5)


def _shapes(tree):
  return [x.shape for x in jax.tree.leaves(tree) if np.ndim(x) >= 2]


def test_only_the_adapters_train_and_the_reference_is_the_base(tmp_path):
  cfg = small_config(
    tmp_path,
    **{
      "lora.rank": 4,
      "algo.kl_coef": 0.05,
      "algo.num_minibatches": 2,
      "optim.learning_rate": 1e-2,
    },
  )
  learner = make_learner(cfg)
  state = learner.state
  adapters, base = lora_lib.split_trainable(state.policy)
  # No copy of the base anywhere: no reference, and optimizer moments for adapters only.
  assert state.ref is None
  assert sorted(_shapes(state.policy_opt)) == sorted(2 * _shapes(adapters))
  base_shapes = set(_shapes(base)) - set(_shapes(adapters))
  outside = state._replace(policy=None)
  assert not base_shapes & set(_shapes(outside))
  base_before, adapters_before = jax.device_get((base, adapters))

  batch = one_batch(learner, cfg)
  exp, _ = learner.experience(batch)
  assert np.any(np.asarray(exp.ref_logp_BxN) != 0)
  np.testing.assert_array_equal(exp.ref_logp_BxN, exp.old_logp_BxN)  # B = 0: policy = base
  learner.update(exp)
  adapters_after, base_after = lora_lib.split_trainable(learner.state.policy)
  assert_bitwise_equal(jax.device_get(base_after), base_before)
  for path, b in nnx.to_flat_state(jax.device_get(adapters_after)):
    if str(path[-1]).endswith("lora_b"):  # every B moved off its zero init
      assert np.any(b[...] != 0), path
  exp2, _ = learner.experience(batch)
  # The reference is still the base's log-probs; the policy's moved away from them.
  np.testing.assert_array_equal(exp2.ref_logp_BxN, exp.ref_logp_BxN)
  assert not np.array_equal(exp2.old_logp_BxN, exp.old_logp_BxN)
  base_only = step_lib.sequence_forward(learner.base_def, base_after, batch, 1.0, group=1)
  m = np.asarray(exp.loss_mask_BxN, bool)
  np.testing.assert_allclose(np.asarray(base_only)[m], np.asarray(exp2.ref_logp_BxN)[m], atol=1e-6)


def test_gradients_reach_the_adapters_only(tmp_path):
  cfg = small_config(tmp_path, **{"lora.rank": 4, "lora.targets": "q,v", "algo.num_minibatches": 1})
  learner = make_learner(cfg)
  exp, _ = learner.experience(one_batch(learner, cfg))
  adapters, base = lora_lib.split_trainable(learner.state.policy)
  names = {str(path[-1]) for path, _ in nnx.to_flat_state(adapters)}
  assert names == {"q_lora_a", "q_lora_b", "v_lora_a", "v_lora_b"}
  assert not {str(p[-1]) for p, _ in nnx.to_flat_state(base)} & names
  denominator = core.aggregate_denominator(exp.loss_mask_BxN, cfg.algo.aggregation)
  algo = step_lib.algorithm(cfg)

  def objective(a, base, exp, denominator):
    joined = lora_lib.join_trainable(a, base)
    return step_lib.policy_objective(
      joined, exp, denominator, 0.0, policy_def=learner.policy_def, cfg=cfg, algo=algo
    )[0]

  grads = jax.jit(jax.grad(objective))(adapters, base, exp, denominator)
  assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  assert any(np.any(g != 0) for g in jax.tree.leaves(grads))
  metrics = jax.device_get(learner.update(exp))  # the update's gradient is the adapters' one
  np.testing.assert_allclose(metrics["grad_norm"][0], optax.tree.norm(grads), rtol=1e-5)


def _lora_path_config(tmp_path, **overrides):
  settings = {
    "model.path": str(FIXTURES / "qwen2_tied"),
    "lora.rank": 4,
    "lora.quantize": "nf4",
    "lora.quant_tile": 16,
    "algo.kl_coef": 0.05,
    "optim.learning_rate": 1e-2,
    "run.steps": 4,
    "checkpoint.every": 2,
  }
  return small_config(tmp_path, **(settings | overrides))


@pytest.mark.slow
def test_lora_checkpoints_hold_adapters_only_and_resume_bitwise_after_kill_9(tmp_path):
  ref = train(_lora_path_config(tmp_path / "ref"))
  cfg = _lora_path_config(tmp_path / "killed")
  run_killed(cfg, "after-step", 3, tmp_path)  # dies after step 3; the last checkpoint is 2
  step = tmp_path / "killed" / "run" / "checkpoints" / "2"
  meta = json.loads((step / "meta" / "metadata").read_text())
  assert meta["lora_base"]["path"] == str(FIXTURES / "qwen2_tied")
  saved = json.dumps(json.loads((step / "state" / "_METADATA").read_text()))
  assert "lora_a" in saved and "embed_VxD" not in saved and "q_DxNxH" not in saved
  resumed = train(cfg)
  assert resumed["resumed_from"] == 2
  assert_bitwise_equal(
    jax.device_get(resumed["learner"].state), jax.device_get(ref["learner"].state)
  )


@pytest.mark.slow  # two trainer runs on a quantized base
def test_resume_refuses_a_base_whose_weights_changed(tmp_path):
  base = tmp_path / "base"
  shutil.copytree(FIXTURES / "qwen2_tied", base)
  train(_lora_path_config(tmp_path, **{"model.path": str(base), "run.steps": 2}))
  tensors = load_file(base / "model.safetensors")
  tensors["model.norm.weight"] = tensors["model.norm.weight"] * 2
  save_file(tensors, base / "model.safetensors")
  with pytest.raises(ConfigError, match="differ from it"):
    train(_lora_path_config(tmp_path, **{"model.path": str(base)}))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("lora_export")
  cfg = small_config(
    tmp, **{"lora.rank": 4, "checkpoint.every": 1, "run.steps": 2, "optim.learning_rate": 1e-2}
  )
  summary = train(cfg, task=OnesTask(cfg))
  learner = summary["learner"]
  return tmp, nnx.merge(learner.policy_def, jax.device_get(learner.state.policy))


def test_merged_export_equals_the_adapter_forward(lora_run):
  tmp, policy = lora_run
  with pytest.raises(export_lib.ExportError, match="--merge"):
    export_lib.export(tmp / "run", tmp / "plain")
  out = export_lib.export(tmp / "run", tmp / "merged", merge=True)
  tokens = TOKENS % policy.cfg.vocab_size
  np.testing.assert_allclose(
    np.asarray(load_model(out)(tokens)[0]), np.asarray(policy(tokens)[0]), atol=1e-5
  )


def test_adapter_export_is_a_peft_directory(lora_run):
  tmp, policy = lora_run
  out = export_lib.export(tmp / "run", tmp / "adapter", adapter=True)
  config = json.loads((out / "adapter_config.json").read_text())
  assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 16.0
  assert set(config["target_modules"]) == {
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
  }
  assert Path(config["base_model_name_or_path"]) == (out / "base").resolve()  # the run's own base
  tensors = load_file(out / "adapter_model.safetensors")
  cfg = policy.cfg
  q_a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
  o_b = tensors["base_model.model.model.layers.0.self_attn.o_proj.lora_B.weight"]
  assert q_a.shape == (4, cfg.hidden_size) and o_b.shape == (cfg.hidden_size, 4)
  assert len(tensors) == 2 * 7 * cfg.num_layers
  # The adapter on its base is the policy: fold the PEFT tensors in by hand.
  base = load_model(out / "base")
  q = base.decoder.layers[0].attn.q_DxNxH
  b = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
  folded = q[...] + (config["lora_alpha"] / config["r"]) * (q_a.T @ b.T).reshape(q.shape)
  np.testing.assert_allclose(
    folded,
    np.asarray(lora_lib.merge_adapters(policy).decoder.layers[0].attn.q_DxNxH[...]),
    atol=1e-6,
  )


@pytest.mark.parametrize(
  "overrides, message",
  [
    ({"lora.quantize": "nf4"}, "config.lora.quantize='nf4' quantizes a frozen base"),
    ({"lora.rank": 4, "lora.targets": "qkv"}, "config.lora.targets='qkv'"),
    ({"lora.rank": 4, "lora.quantize": "fp3"}, "config.lora.quantize='fp3' is unknown"),
    ({"lora.rank": 4, "lora.dropout": 1.0}, "config.lora.dropout=1.0"),
    (
      {"lora.rank": 4, "lora.dropout": 0.1, "model.scan_layers": True},
      "config.model.scan_layers=False or config.lora.dropout=0",
    ),
    ({"lora.rank": -1}, "config.lora.rank=-1"),
  ],
)
def test_bad_lora_settings_name_the_key(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message.replace("(", "\\(").replace(".", "\\.")):
    small_config(tmp_path, **overrides)


def test_the_planner_counts_a_4_bit_base_at_half_a_byte():
  from jaxrl_llm.plan.programs import device_bytes

  arrays = [jax.ShapeDtypeStruct((64, 8), d) for d in (jnp.uint4, jnp.int4, jnp.int8, jnp.bfloat16)]
  assert [device_bytes(a) for a in arrays] == [256, 256, 512, 1024]


def test_lora_grpo_raises_the_reward(tmp_path):
  """Rank-8 adapters alone, on a base warm-started for 100 steps (the base then frozen),
  learn a trivially learnable reward: the mean reward of the last 5 of 20 steps beats the
  first 5's by a wide margin (measured: about 0.45 -> 0.87)."""
  cfg = small_config(
    tmp_path,
    **{"lora.rank": 8, "lora.alpha": 16.0, "warmstart.steps": 100, "run.steps": 20,
       "optim.learning_rate": 1e-2},
  )  # fmt: skip
  summary = train(cfg, devices=jax.devices()[:1], task=OnesTask(cfg))
  rewards = [json.loads(line)["rollout/reward_mean"] for line in open(summary["metrics"])]
  assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.2, rewards


@pytest.mark.slow
def test_lora_grpo_learns_the_default_task(tmp_path):
  """The default run (warm start, then GRPO) with rank-16 adapters in place of full
  fine-tuning learns, over seeds: one trajectory's float chaos decides how fast (measured on
  a 2-core AMD EPYC, gains of +0.55 to +0.76 in 1500 steps, also with XLA's CPU code capped
  at AVX2 and with single-threaded Eigen), so each of 3 seeds is evaluated every 250 of its
  1500 steps, and 2 of the 3 must reach 0.15 above their start at some evaluation
  (experiments/results/lora_default_run.jsonl has the 3000-step run). Each seed is the
  README's main command in a subprocess at XLA's default optimisation level: 1500 steps run
  about 3x faster there than at the suite's level 0, which saves far more than the few
  programs' slower compiles."""
  env = subprocess_env(XLA_FLAGS="")  # no level-0 flag
  reached = []
  for seed in range(3):
    workdir = tmp_path / f"seed{seed}"
    flags = [
      "--config.lora.rank=16", "--config.lora.alpha=32", "--config.optim.learning_rate=1e-3",
      "--config.optim.warmup_steps=100", "--config.run.steps=1500", f"--config.run.seed={seed}",
      "--config.run.eval_examples=256", "--config.run.eval_every=250",
      "--config.run.progress=False", "--config.run.loggers=jsonl",
      f"--config.run.workdir={workdir}", "--config.checkpoint.every=0",
      "--config.run.peak_flops_per_device=1e13",  # MFU's reference: no timing of this host
    ]  # fmt: skip
    result = run_cli(*flags, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    before = float(re.search(r"heldout_accuracy before=([0-9.]+)", result.stdout).group(1))
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
    best = max(r["eval/heldout_accuracy"] for r in rows if "eval/heldout_accuracy" in r)
    reached.append(best - before >= 0.15)
    if sum(reached) >= 2:  # decided: a third seed could not change the verdict
      break
  assert sum(reached) >= 2, reached


def test_a_quantization_tile_that_does_not_divide_names_the_key(tmp_path):
  cfg = small_config(tmp_path, **{"lora.rank": 4, "lora.quantize": "int8", "lora.quant_tile": 48})
  with pytest.raises(ConfigError, match="config.lora.quant_tile=48: .*tiles of 48"):
    make_learner(cfg)


def test_a_lora_training_pass_counts_4n_flops_per_token(tmp_path):
  from jaxrl_llm.train import perf

  full, lora = small_config(tmp_path), small_config(tmp_path, **{"lora.rank": 4})
  B, G, N = full.batch_size, full.rollout.group_size, full.rollout.max_new_tokens
  trained_tokens = (B // G if full.share_prompts else B) * 6 + B * N  # prompts of 6 tokens
  flops = lambda cfg: perf.iteration_flops(1000, cfg, 6, [(6, N)])
  # The frozen base saves the weight gradients: 2 n per trained token and epoch.
  assert flops(full) - flops(lora) == 2 * 1000 * trained_tokens * full.algo.ppo_epochs


@pytest.mark.parametrize("updates", [1, 2])
def test_adapter_dropout_stays_out_of_the_behaviour_correction(tmp_path, updates):
  """pi_old / pi_behav is taken without dropout with one update per rollout as with several:
  on a batch sampled from the current params the two agree to float rounding."""
  cfg = small_config(
    tmp_path,
    **{"lora.rank": 4, "lora.dropout": 0.5, "algo.correction": "token_tis",
       "algo.num_minibatches": updates},
  )  # fmt: skip
  learner = make_learner(cfg)
  adapters, base = lora_lib.split_trainable(learner.state.policy)
  keys = iter(jax.random.split(jax.random.key(4), len(jax.tree.leaves(adapters))))
  moved = jax.tree.map(lambda x: x + 0.3 * jax.random.normal(next(keys), x.shape), adapters)
  learner.state = learner.state._replace(policy=lora_lib.join_trainable(moved, base))
  exp, _ = learner.experience(one_batch(learner, cfg))
  metrics = jax.device_get(learner.update(exp))
  assert metrics["mismatch_k3"][0] < 1e-6, metrics["mismatch_k3"]
  assert metrics["is_weight_mean"][0] == pytest.approx(1.0, abs=1e-5)
