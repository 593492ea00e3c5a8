"""The trainer end to end: sharding equivalence, exact first ratio, accumulation invariance,
learning, and configuration errors."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import OnesTask, make_learner, one_batch, rewards_of, run_cli, small_config

import experiments.configs.default
from jaxrl_llm import core
from jaxrl_llm.train import ConfigError, TrainingDiverged, from_config_dict, train
from jaxrl_llm.train import step as step_lib


def test_8_device_iteration_equals_1_device(tmp_path):
  cfg = small_config(tmp_path, **{"mesh.data": 4, "mesh.fsdp": 2, "algo.num_minibatches": 2})
  multi = train(cfg)["learner"]
  single_cfg = small_config(tmp_path, **{"algo.num_minibatches": 2})
  single = train(single_cfg, devices=jax.devices()[:1])["learner"]
  assert multi.mesh.shape == {"data": 4, "fsdp": 2, "tensor": 1}
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, atol=1e-5, rtol=1e-5),
    jax.device_get(multi.state.policy),
    jax.device_get(single.state.policy),
  )


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "cispo"])
def test_first_minibatch_ratio_is_exactly_one(tmp_path, loss):
  cfg = small_config(
    tmp_path,
    **{
      "algo.num_minibatches": 2,
      "algo.ppo_epochs": 2,
      "algo.policy_loss": loss,
      "optim.learning_rate": 1e-2,
    },
  )
  learner = make_learner(cfg)
  batch = one_batch(learner, cfg)
  exp, exp_metrics = learner.experience(batch)
  metrics = jax.device_get(learner.update(exp))
  assert metrics["ratio_min"][0] == 1.0 and metrics["ratio_max"][0] == 1.0
  assert metrics["clipfrac_low"][0] == 0.0 and metrics["clipfrac_high"][0] == 0.0
  assert metrics["approx_kl"][0] == 0.0
  assert metrics["ratio_max"][-1] != 1.0  # later minibatches see the updated policy


@pytest.mark.parametrize("mode", sorted(core.AGGREGATION_MODES))
def test_accumulation_does_not_change_loss_or_gradient(tmp_path, mode):
  cfg = small_config(
    tmp_path, **{"algo.aggregation": mode, "algo.kl_coef": 0.1, "algo.entropy_coef": 0.01}
  )
  learner = make_learner(cfg)
  exp, _ = learner.experience(one_batch(learner, cfg))
  objective = functools.partial(
    step_lib.policy_objective, policy_def=learner.policy_def, cfg=cfg, algo=step_lib.algorithm(cfg)
  )
  denominator = core.aggregate_denominator(exp.batch.mask_BxN, mode)
  # Old log-probs off the current policy, so the ratios (and their clip fractions) are not
  # trivially 1 and 0.
  noise = jax.random.normal(jax.random.key(1), exp.old_logp_BxN.shape) * 0.3
  exp = exp._replace(old_logp_BxN=exp.old_logp_BxN + noise)
  results = []
  for micro in (1, 4):
    split = jax.tree.map(lambda x, m=micro: x.reshape(m, -1, *x.shape[1:]), exp)
    results.append(
      step_lib._accumulate(
        objective, learner.state.policy, split, denominator, learner.state.kl.coef, 0.01
      )
    )
  metrics = results[0][2]
  assert metrics["clipfrac_low"] > 0 and metrics["clipfrac_high"] > 0
  tokens = [int(m.sum()) for m in exp.loss_mask_BxN.reshape(4, -1, exp.loss_mask_BxN.shape[-1])]
  assert len(set(tokens)) > 1  # micro-batches of unequal token counts
  for loss, grads, micro_metrics in results[1:]:
    np.testing.assert_allclose(loss, results[0][0], rtol=1e-6, atol=1e-7)
    jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), grads, results[0][1]
    )
    # The logged loss, clip fractions, entropy, ... are the whole minibatch's.
    jax.tree.map(
      functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), micro_metrics, metrics
    )


def test_critic_metrics_do_not_depend_on_micro_batches(tmp_path):
  cfg = small_config(tmp_path, **{"algo.estimator": "gae", "algo.cliprange_value": 0.05})
  learner = make_learner(cfg)
  exp, _ = learner.experience(one_batch(learner, cfg))
  noise = jax.random.normal(jax.random.key(2), exp.old_values_BxN.shape) * 0.2
  exp = exp._replace(old_values_BxN=exp.old_values_BxN + noise)
  objective = functools.partial(step_lib.critic_objective, critic_def=learner.critic_def, cfg=cfg)
  denominator = core.aggregate_denominator(exp.loss_mask_BxN, cfg.algo.aggregation)
  results = [
    step_lib._accumulate(
      objective,
      learner.state.critic,
      jax.tree.map(lambda x, m=micro: x.reshape(m, -1, *x.shape[1:]), exp),
      denominator,
    )
    for micro in (1, 4)
  ]
  (loss, _, whole), (_, _, split) = results
  assert 0 < whole["vf_clipfrac"] < 1
  np.testing.assert_allclose(whole["value_loss"], loss, rtol=1e-6)
  jax.tree.map(functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-7), split, whole)


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_shared_prompts_give_the_same_experience_and_gradients(tmp_path, estimator):
  """Each group's prompt running once gives the experience (reference log-probs, values,
  advantages) and the policy and critic gradients of every row running its own prompt."""
  results = []
  for share in (True, False):
    cfg = small_config(
      tmp_path,
      **{"algo.estimator": estimator, "algo.kl_coef": 0.1, "algo.share_prompts": share},
    )
    assert cfg.share_prompts is share
    learner = make_learner(cfg)
    exp, _ = learner.experience(one_batch(learner, cfg))
    mask = exp.batch.mask_BxN
    denominator = core.aggregate_denominator(mask, cfg.algo.aggregation)
    one_micro = jax.tree.map(lambda x: x[None], exp)
    state = learner.state
    policy_objective = functools.partial(step_lib.policy_objective, algo=step_lib.algorithm(cfg))
    objectives = [
      (policy_objective, "policy_def", state.policy, (state.kl.coef,)),
      (step_lib.critic_objective, "critic_def", state.critic, ()),
    ]
    grads = [
      step_lib._accumulate(
        functools.partial(fn, **{name: getattr(learner, name)}, cfg=cfg),
        params,
        one_micro,
        denominator,
        *extra,
      )[:2]
      for fn, name, params, extra in objectives
      if params is not None
    ]
    results.append(jax.device_get((exp, grads)))
  assert all(float(optax.tree.norm(g)) > 0 for _, g in results[0][1])
  close = functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-6)
  jax.tree.map(close, results[0], results[1])


@pytest.mark.parametrize("estimator", ["grpo", "gae"])
def test_short_run_raises_reward(tmp_path, estimator):
  cfg = small_config(
    tmp_path,
    **{
      "run.steps": 20,
      "algo.estimator": estimator,
      "optim.learning_rate": 1e-2,
      "algo.critic_lr": 1e-2,
    },
  )
  summary = train(cfg, devices=jax.devices()[:1], task=OnesTask(cfg))
  rewards = rewards_of(summary)
  assert len(rewards) == 20
  assert np.mean(rewards[-5:]) > np.mean(rewards[:5]) + 0.1, rewards


def test_metrics_row_has_the_documented_keys(tmp_path):
  cfg = small_config(
    tmp_path,
    **{
      "algo.estimator": "gae",
      "algo.kl_coef": 0.05,
      "algo.kl_placement": "reward",
      "run.eval_every": 1,
    },
  )
  summary = train(cfg, devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(summary["metrics"])]
  row = rows[0]
  # The last step's periodic evaluation is the run's final one (the same policy and examples).
  assert rows[-1]["eval/heldout_accuracy"] == summary["heldout_accuracy_after"]
  assert all("eval/heldout_accuracy" in r for r in rows)
  for key in (
    "rollout/reward_mean",
    "rollout/reward_std",
    "rollout/accuracy",
    "rollout/reward/exact_match",
    "train/kl_ref",
    "train/entropy",
    "train/clipfrac_low",
    "train/clipfrac_high",
    "train/approx_kl",
    "train/ratio_mean",
    "train/ratio_min",
    "train/ratio_max",
    "rollout/response_length_mean",
    "rollout/response_length_max",
    "rollout/truncation_rate",
    "train/grad_norm",
    "train/learning_rate",
    "perf/step_time_s",
    "timing/rollout_wait_s",
    "timing/generation_s",
    "timing/scoring_s",
    "timing/experience_s",
    "timing/update_s",
    "timing/eval_s",
    "timing/checkpoint_s",
    "timing/iteration_s",
    "timing/update_share",
    "perf/tokens_per_s",
    "perf/mfu",
    "train/mismatch_k3",
    "train/is_weight_mean",
    "train/is_weight_max",
    "train/is_masked_frac",
    "rollout/staleness_mean",
    "rollout/staleness_max",
    "train/value_loss",
    "train/vf_clipfrac",
    "train/skipped_updates",
    "eval/heldout_accuracy",
  ):
    assert key in row, key
  assert 0 < row["perf/mfu"] < 1
  groups = {k.split("/", 1)[0] for k in row if k != "step"}
  assert groups == {"rollout", "train", "eval", "perf", "timing"}, groups
  phases = ("rollout_wait", "experience", "update", "eval", "checkpoint")
  assert sum(row[f"timing/{p}_s"] for p in phases) <= row["timing/iteration_s"]
  assert row["timing/generation_s"] + row["timing/scoring_s"] <= row["timing/rollout_wait_s"]
  for p in phases:
    assert row[f"timing/{p}_share"] == row[f"timing/{p}_s"] / row["timing/iteration_s"]


def test_nan_updates_are_skipped_then_stop(tmp_path):
  core.GROUP_ESTIMATORS["nan_test"] = lambda s, **_: s * jnp.nan
  try:
    cfg = small_config(
      tmp_path,
      **{
        "run.steps": 10,
        "algo.estimator": "nan_test",
        "optim.max_consecutive_skips": 3,
        "algo.num_minibatches": 1,
      },
    )
    with pytest.raises(TrainingDiverged, match="3 consecutive updates had a NaN"):
      train(cfg, devices=jax.devices()[:1])
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [r["train/skipped_updates"] for r in rows] == [1, 2, 3]
  finally:
    del core.GROUP_ESTIMATORS["nan_test"]


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"rollout.group_size": 1}, r"group_size=1 with config.algo.estimator='grpo'"),
    (
      {"rollout.group_size": 1, "algo.estimator": "dr_grpo"},
      r"group_size=1 with config.algo.estimator='dr_grpo'.*every advantage is 0",
    ),
    (
      {"rollout.group_size": 1, "algo.estimator": "reinforce_plus_plus_baseline"},
      r"group_size=1 with config.algo.estimator='reinforce_plus_plus_baseline'",
    ),
    ({"rollout.group_size": 1, "algo.estimator": "opo"}, r"estimator='opo'"),
    (
      {"algo.kl_placement": "none", "algo.kl_coef": 0.1},
      r"kl_placement='none' with config.algo.kl_coef=0.1.*kl_placement='loss'",
    ),
    ({"algo.correction": "tis"}, r"config.algo.correction='tis' is unknown.*token_tis"),
    (
      {"algo.correction": "token_tis", "algo.correction_reduce": "product"},
      r"correction_reduce is set but correction='token_tis' takes no reduce",
    ),
    (
      {"algo.correction": "icepop", "algo.correction_low": 2.0},
      r"correction='icepop': the band must hold 1",
    ),
    (
      {"model.param_dtype": "bfloat16"},
      r"param_dtype='bfloat16'.*param_dtype='float32' with config.model.dtype='bfloat16'",
    ),
    ({"algo.truncation": "bootstrap"}, r"truncation='bootstrap'.*estimator='grpo' has no critic"),
    ({"algo.truncation": "drop"}, r"config.algo.truncation='drop'; use"),
    ({"algo.estimator": "gpro"}, r"config.algo.estimator='gpro' is unknown.*grpo"),
    ({"algo.policy_loss": "ppo"}, r"config.algo.policy_loss='ppo' is unknown.*ppo_clip"),
    ({"algo.aggregation": "mean"}, r"config.algo.aggregation='mean' is unknown"),
    ({"algo.num_minibatches": 3}, r"num_minibatches=3 must divide the batch of 32"),
    (
      {"algo.kl_placement": "reward", "algo.kl_coef": 0.1},
      r"kl_placement='reward'.*estimator='grpo' use kl_placement='loss'",
    ),
    ({"algo.kl_mode": "adaptive"}, r"needs config.algo.kl_target"),
    ({"rollout.temperature": 0.0}, r"temperature=0.0 is out of range: it must be > 0 \(RL samples"),
    ({"task.name": "gsm9k"}, r"config.task.name='gsm9k' is unknown"),
    (
      {"algo.share_prompts": True, "algo.num_minibatches": 16},
      r"share_prompts=True needs micro-batches of whole groups.*holds 2 sequences",
    ),
  ],
)
def test_bad_configs_name_the_key(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    small_config(tmp_path, **overrides)


@pytest.mark.parametrize(
  "overrides",
  [{"rollout.top_k": 0, "rollout.top_p": 1.0}, {"algo.estimator": "gae", "rollout.group_size": 1}],
)
def test_no_op_settings_are_accepted(tmp_path, overrides):
  small_config(tmp_path, **overrides)


def test_the_default_run_is_grpo_as_published():
  """GRPO's 1/|o_i| inside the group mean, not DAPO's token mean; the command line says so."""
  cfg = from_config_dict(experiments.configs.default.get_config())
  assert (cfg.algo.estimator, cfg.algo.aggregation) == ("grpo", "seq-mean-token-mean")
  assert cfg.describe().startswith(
    "grpo advantages, ppo_clip loss, seq-mean-token-mean aggregation, no KL term"
  )


def test_unknown_key_suggests_the_right_one(tmp_path):
  c = experiments.configs.default.get_config()
  c.algo.clip_hgh = 0.28
  with pytest.raises(
    ConfigError,
    match=r"config.algo.clip_hgh is not a setting. Did you mean "
    r"config.algo.clip_high\?",
  ):
    from_config_dict(c)


def test_batch_not_divisible_by_devices(tmp_path):
  cfg = small_config(tmp_path, **{"rollout.prompts_per_step": 3, "rollout.group_size": 2})
  with pytest.raises(
    ConfigError,
    match=r"batch of 6 sequences does not split over mesh data x "
    r"fsdp = 8 devices",
  ):
    train(cfg)


def test_prompts_not_divisible_by_devices(tmp_path):
  cfg = small_config(tmp_path, **{"rollout.prompts_per_step": 4, "rollout.group_size": 4})
  with pytest.raises(
    ConfigError, match=r"prompts_per_step=4 does not split over mesh data x fsdp = 8"
  ):
    train(cfg)


def test_cli_runs(tmp_path):
  out = run_cli(
    "--config.run.steps=2",
    "--config.warmstart.steps=2",
    "--config.run.eval_examples=16",
    "--config.run.eval_batch_size=16",
    f"--config.run.workdir={tmp_path / 'cli'}",
    "--config.run.progress=False",
    "--config.model.num_layers=1",
    check=True,
  )
  last = out.stdout.strip().splitlines()[-1]
  assert last.startswith("heldout_accuracy before=") and " after=" in last
  assert (tmp_path / "cli" / "metrics.jsonl").exists()


def test_trains_a_hugging_face_checkpoint_on_a_mesh(tmp_path):
  """model.path loads a local HF directory straight onto the (data 4 x fsdp 2) mesh."""
  cfg = small_config(
    tmp_path,
    **{"model.path": "tests/fixtures/qwen2_tied", "mesh.data": 4, "mesh.fsdp": 2, "run.steps": 2},
  )
  learner = train(cfg)["learner"]
  assert learner.model_cfg.vocab_size == 320 and learner.model_cfg.tie_word_embeddings
  embed = learner.state.policy["decoder"]["embed_VxD"][...]
  assert embed.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
  assert len(json.loads(open(tmp_path / "run" / "metrics.jsonl").readlines()[-1])) > 10


def test_shaping_rewards_are_logged_on_their_own(tmp_path):
  cfg = small_config(
    tmp_path,
    **{
      "rewards.overlong_weight": 1.0,
      "rewards.missing_eos_weight": 0.5,
      "rewards.format_weight": 0.1,
    },
  )
  summary = train(cfg, devices=jax.devices()[:1])
  row = json.loads(open(summary["metrics"]).readline())
  names = ("exact_match", "overlong", "missing_eos", "format")
  assert {f"rollout/reward/{name}" for name in names} <= set(row)
  assert row["rollout/reward/missing_eos"] == -row["rollout/truncation_rate"]


def test_kl_to_the_reference_averages_over_rows_in_the_loss(tmp_path):
  """`kl_ref` (which the adaptive KL controller reads) is the mean per-sequence KL over the
  rows that have loss tokens: rows the loss leaves out do not dilute it, however the
  minibatch is split into micro-batches."""
  cfg = small_config(tmp_path, **{"algo.kl_coef": 0.1, "algo.num_minibatches": 2})
  learner = make_learner(cfg)
  batch = one_batch(learner, cfg)
  B = cfg.batch_size
  kept = np.ones(B, bool)
  kept[: B // 2 : 2] = False  # some rows out of the loss, more of them in the first micro-batches
  exp, _ = learner.experience(batch._replace(loss_rows_B=learner.shard_batch(kept)))
  noise = jax.random.normal(jax.random.key(3), exp.ref_logp_BxN.shape) * 0.3
  exp = exp._replace(ref_logp_BxN=exp.ref_logp_BxN + noise)  # a reference the policy left
  mask = np.asarray(exp.loss_mask_BxN)
  kl_BxN = np.asarray(core.kl_penalty(exp.old_logp_BxN, exp.ref_logp_BxN, "k3"))
  per_row = np.where(mask, kl_BxN, 0.0).sum(-1)
  expected = per_row[mask.any(-1)].mean()
  assert not np.isclose(expected, per_row.mean())  # the diluted mean differs
  objective = functools.partial(
    step_lib.policy_objective, policy_def=learner.policy_def, cfg=cfg, algo=step_lib.algorithm(cfg)
  )
  denominator = core.aggregate_denominator(exp.loss_mask_BxN, cfg.algo.aggregation)
  for micro in (1, 4):
    split = jax.tree.map(lambda x, m=micro: x.reshape(m, -1, *x.shape[1:]), exp)
    _, _, metrics = step_lib._accumulate(
      objective, learner.state.policy, split, denominator, learner.state.kl.coef
    )
    np.testing.assert_allclose(metrics["kl_ref"], expected, rtol=1e-5)
