"""What the trainer feeds the loss and what it logs: cut-off completions, rows the loss leaves
out, the learning rate actually applied, throughput at the padded width, and end ids."""

import json
import shutil

import jax
import numpy as np
import pytest
from helpers import OnesTask, make_learner, one_batch, small_config

from jaxrl_llm.rollout import producer as producer_lib
from jaxrl_llm.train import loop as loop_lib
from jaxrl_llm.train import perf, train
from jaxrl_llm.train import step as step_lib


def _truncated_batch(learner, cfg):
  batch = one_batch(learner, cfg)
  truncated = np.asarray(batch.truncated_B)
  assert truncated.any() and not truncated.all()  # the random policy ends some rows only
  return batch, truncated


@pytest.mark.parametrize("mode", ["bootstrap", "mask"])
def test_cut_off_completions(tmp_path, mode):
  """`bootstrap`: the return of a cut-off row continues from the critic's value after its
  last token, ended rows are unchanged; `mask`: cut-off rows leave the loss."""
  base = {"algo.estimator": "gae", "rollout.max_new_tokens": 3}
  exps = {}
  for truncation in ("terminal", mode):
    cfg = small_config(tmp_path, **base, **{"algo.truncation": truncation})
    learner = make_learner(cfg)
    batch, truncated = _truncated_batch(learner, cfg)
    exps[truncation] = jax.device_get(learner.experience(batch)[0])
  terminal, other = exps["terminal"], exps[mode]
  mask = np.asarray(terminal.batch.mask_BxN)
  if mode == "bootstrap":
    np.testing.assert_array_equal(other.loss_mask_BxN, mask)
    ended = ~truncated
    np.testing.assert_allclose(other.returns_BxN[ended], terminal.returns_BxN[ended], atol=1e-6)
    gap = np.abs(other.returns_BxN - terminal.returns_BxN)[truncated].max(-1)
    assert (gap > 1e-6).all()
  else:
    np.testing.assert_array_equal(other.loss_mask_BxN, mask & ~truncated[:, None])
    assert np.asarray(other.advantages_BxN)[truncated].max() == 0


def test_uninformative_groups_leave_the_loss_when_dynamic_sampling_runs_out(tmp_path):
  """A random policy never solves 2-digit addition, so every group has equal rewards and the
  extra rounds cannot replace them: none is kept, so nothing (not even the entropy bonus)
  moves the policy."""
  cfg = small_config(
    tmp_path,
    **{
      "rollout.dynamic_sampling": True,
      "rollout.max_extra_rounds": 1,
      "run.steps": 2,
      "algo.entropy_coef": 0.05,
    },
  )
  summary = train(cfg, devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(summary["metrics"])]
  assert [r["rollout/dynamic_groups_kept"] for r in rows] == [0, 0]
  assert [r["train/grad_norm"] for r in rows] == [0.0, 0.0]


def test_dynamic_sampling_keeps_informative_groups(tmp_path):
  cfg = small_config(tmp_path, **{"rollout.dynamic_sampling": True, "run.steps": 2})
  summary = train(cfg, devices=jax.devices()[:1], task=OnesTask(cfg))
  for row in map(json.loads, open(summary["metrics"])):
    kept = row["rollout/informative_group_fraction"] * cfg.rollout.prompts_per_step
    assert row["rollout/dynamic_groups_kept"] == round(kept) > 0


def test_logged_learning_rate_is_the_one_applied(tmp_path):
  """During critic warm-up the policy takes no step: its logged rate is 0, the critic's not."""
  cfg = small_config(
    tmp_path,
    **{
      "algo.estimator": "gae",
      "algo.critic_warmup_steps": 2,
      "run.steps": 4,
      "optim.learning_rate": 1e-3,
      "algo.critic_lr": 2e-3,
    },
  )
  summary = train(cfg, devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(summary["metrics"])]
  np.testing.assert_allclose(
    [r["train/learning_rate"] for r in rows], [0, 0, 1e-3, 1e-3], rtol=1e-6
  )
  np.testing.assert_allclose([r["train/critic_learning_rate"] for r in rows], [2e-3] * 4, rtol=1e-6)


def test_throughput_counts_the_padded_width(tmp_path):
  """Prompts of 6 characters in a bucket of 6: tokens/s and MFU count 6 prompt positions, not
  task.prompt_length's 10; MFU stays below 1 with asynchronous checkpoint writes running."""
  cfg = small_config(
    tmp_path,
    **{
      "task.prompt_length": 10,
      "task.prompt_buckets": (6,),
      "run.steps": 3,
      "checkpoint.every": 1,
      "checkpoint.async_save": True,
    },
  )
  summary = train(cfg, devices=jax.devices()[:1])
  B, N = cfg.batch_size, cfg.rollout.max_new_tokens
  for row in map(json.loads, open(summary["metrics"])):
    np.testing.assert_allclose(
      row["perf/tokens_per_s"] * row["perf/step_time_s"], B * (6 + N), rtol=1e-9
    )
    assert 0 < row["perf/mfu"] <= 1


def test_mfu_above_one_is_refused_against_a_known_peak():
  peak = perf.Peak(1e9, measured=False)
  with pytest.raises(RuntimeError, match="config.run.peak_flops_per_device"):
    peak.mfu(flops=2e9, seconds=1.0)
  assert peak.mfu(flops=5e8, seconds=1.0) == 0.5


def test_a_measured_peak_that_a_step_beats_is_raised_to_that_step(caplog):
  """A CPU peak timed while another process shared the cores comes out low: the faster step
  becomes the reference instead of stopping the run."""
  peak = perf.Peak(1e9, measured=True)
  with caplog.at_level("WARNING"):
    assert peak.mfu(flops=2e9, seconds=1.0) == 1.0
  assert "timed at" in caplog.text and peak.flops == 2e9
  assert peak.mfu(flops=1e9, seconds=1.0) == 0.5


def test_generation_stops_on_every_declared_end_id(tmp_path):
  """A checkpoint whose generation_config.json lists end ids besides the tokenizer's EOS (as
  Qwen2.5 and Llama-3-Instruct do): the sampler stops on each of them."""
  model_dir = tmp_path / "model"
  shutil.copytree("tests/fixtures/qwen2_tied", model_dir)
  cfg = small_config(tmp_path, **{"model.path": str(model_dir), "task.prompt_length": 16})
  learner = make_learner(cfg)
  task = loop_lib.Task(cfg)
  local = task.spec.examples("train", 8, 0)
  prompt = producer_lib.local_prompts(learner, task, local)
  run = lambda lrn: jax.device_get(
    lrn.generate(
      lrn.policy,
      prompt.tokens_BxP,
      prompt.mask_BxP,
      jax.random.key(0),
      num_samples=1,
      temperature=0.0,
    )
  )
  first_tokens = sorted({int(t) for t in run(learner).tokens_BxN[:, 0]})
  eos = task.tokenizer.eos_id
  (model_dir / "generation_config.json").write_text(
    json.dumps({"eos_token_id": [eos, *first_tokens]})
  )
  declared = make_learner(cfg)
  assert declared.eos_ids == tuple(sorted({eos, *first_tokens}))
  out = run(declared)
  np.testing.assert_array_equal(out.lengths_B, 1)  # every row ends at its first token
  assert not out.truncated_B.any()


def test_warm_start_rows_pad_to_the_width_every_process_agrees_on(tmp_path, monkeypatch):
  """With prompt buckets, a process whose labelled prompts are all short (bucket 6) still
  pads them to the bucket another process needs (8, as the all-gather would report), so
  the global batch has one width."""
  cfg = small_config(tmp_path, **{"task.prompt_length": 10, "task.prompt_buckets": (4, 6, 8)})
  task = loop_lib.Task(cfg)
  monkeypatch.setattr(loop_lib.hosts, "global_max", lambda width: max(width, 8))
  local = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "10+20=", "answer": "30"}]
  assert task.prompts(local).tokens_BxP.shape == (2, 6)
  batch = loop_lib._labelled_batch(task, local, cfg.rollout.max_new_tokens)
  assert batch.prompt_BxP.shape == (2, 8)
  np.testing.assert_array_equal(batch.prompt_mask_BxP.sum(-1), [4, 6])
  np.testing.assert_array_equal(batch.prompt_mask_BxP[:, -1], True)  # left padding


def _numpy_gae(r, v, m, v_end, gamma, lam):
  """GAE over the positions with m = 1, the others skipped; V after the last one is v_end."""
  adv, v_next, adv_next = np.zeros(len(r)), v_end, 0.0
  for t in reversed(range(len(r))):
    if m[t]:
      adv[t] = r[t] + gamma * v_next - v[t] + gamma * lam * adv_next
      v_next, adv_next = v[t], adv[t]
  return adv


def test_a_cut_off_episode_bootstraps_from_the_state_after_its_last_real_token(tmp_path):
  """An episode cut off at 14 of its 16 slots (the environment's next reply did not fit)
  continues its return from V(s_14), the critic's value after its last real token, not from
  the padding slot after slot 15; GAE on that row equals a numpy reference."""
  cfg = small_config(
    tmp_path,
    **{"algo.estimator": "gae", "algo.gamma": 0.9, "algo.lam": 0.8,
       "algo.estimator_kwargs": '{"whiten": false}', "rollout.max_new_tokens": 4},
  )  # fmt: skip
  learner = make_learner(cfg)
  B, N, rng = cfg.batch_size, 16, np.random.default_rng(0)
  vocab = learner.model_cfg.vocab_size
  mask = np.ones((B, N), bool)
  mask[0, 14:] = False  # row 0 ends at slot 14, cut off; the other rows fill all 16 slots
  model = mask.copy()
  model[0, 5:9] = False  # an environment reply between the model's turns
  rewards = np.zeros((B, N), np.float32)
  rewards[0, 4], rewards[0, 13] = 0.5, 1.0
  truncated = np.zeros(B, bool)
  truncated[0] = True
  batch = step_lib.Batch(
    *learner.shard_batch(
      (rng.integers(2, vocab, (B, 6), dtype=np.int32), np.ones((B, 6), bool),
       rng.integers(2, vocab, (B, N), dtype=np.int32), mask)
    ),
    learner.shard_batch(rewards.sum(-1)),
    learner.shard_batch(truncated),
    model_mask_BxN=learner.shard_batch(model),
    token_rewards_BxN=learner.shard_batch(rewards),
  )  # fmt: skip
  exp = jax.device_get(learner.experience(batch)[0])
  values_BxN1 = np.asarray(
    step_lib.sequence_values(learner.critic_def, learner.state.critic, batch, with_last=True)
  )
  assert abs(values_BxN1[0, 14] - values_BxN1[0, 16]) > 1e-4  # the two differ
  expected = _numpy_gae(
    rewards[0], values_BxN1[0, :N], model[0], values_BxN1[0, 14], gamma=0.9, lam=0.8
  )
  np.testing.assert_allclose(exp.advantages_BxN[0], expected, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(
    exp.returns_BxN[0], np.where(model[0], expected + values_BxN1[0, :N], 0.0), rtol=1e-5, atol=1e-6
  )
