"""Rollout producers: on-policy and off-policy staleness, the sampler's log-probs as the
behaviour policy, and runs (on-policy, off-policy with dynamic sampling drawing from the same
prompt stream, asynchronous) that resume bitwise after kill -9 in the middle of a rollout,
with rollouts in flight, or after SIGTERM."""

import json
from pathlib import Path

import jax
import pytest
from helpers import (
  ENGINE,
  N,
  OnesTask,
  assert_bitwise_equal,
  metric_rows,
  params,
  run_killed,
  small_config,
)

from jaxrl_llm.train import ConfigError, train

OFF_POLICY = ENGINE | {
  "rollout.off_policy_steps": 2,
  "rollout.dynamic_sampling": True,  # its extra rounds draw prompts between dispatches
  "algo.correction": "token_tis",
}


def _rows(summary):
  return [json.loads(line) for line in Path(summary["metrics"]).read_text().splitlines()]


@pytest.mark.parametrize("ahead,staleness", [(0, [0, 0, 0, 0]), (2, [0, 1, 2, 2])])
def test_rollouts_are_at_most_off_policy_steps_old(tmp_path, ahead, staleness):
  """Off-policy by k: the first k + 1 rollouts come from the initial params, then each is k
  updates old; the trainer sees the gap as a ratio pi_old / pi_behav away from 1."""
  cfg = small_config(
    tmp_path,
    **ENGINE,
    **{"rollout.off_policy_steps": ahead, "algo.correction": "token_tis", "run.steps": 4},
  )
  rows = _rows(train(cfg, task=OnesTask(cfg)))  # rewards that vary: the params move
  assert [r["rollout/staleness_max"] for r in rows] == staleness
  assert [r["rollout/staleness_mean"] for r in rows] == staleness
  stale = [r["train/mismatch_k3"] for r, age in zip(rows, staleness, strict=True) if age]
  fresh = [r["train/mismatch_k3"] for r, age in zip(rows, staleness, strict=True) if not age]
  assert max(fresh) < 1e-6
  if stale:
    assert min(stale) > 100 * max(fresh)  # older params sampled them: a measurable gap


ASYNC = ENGINE | {
  "rollout.mode": "async",
  "rollout.sampler_devices": 4,
  "rollout.off_policy_steps": 1,
  "algo.correction": "token_tis",
  "run.steps": 2 * N,
  "checkpoint.every": N,
}


@pytest.mark.slow
@pytest.mark.parametrize(
  "lora",
  [{}, {"lora.rank": 4, "lora.alpha": 8.0}],
  ids=["full", "lora"],
)
def test_async_on_4_plus_4_devices_equals_sync_off_policy_on_4(tmp_path, lora):
  """The sampler's own mesh and params copy change where rollouts run, not what they are:
  the same key gives the same samples on any mesh, so the run is the synchronous
  off-policy one on the trainer's 4 devices (with LoRA, the sampler's copy gets the
  adapters after each update, and keeps the base it was given)."""
  async_run = train(small_config(tmp_path / "async", **(ASYNC | lora)))
  assert async_run["mesh"]["data"] == 4 and async_run["sampler_mesh"]["data"] == 4
  sync_settings = ASYNC | lora | {"rollout.mode": "sync"}
  sync_run = train(small_config(tmp_path / "sync", **sync_settings), devices=jax.devices()[:4])
  assert_bitwise_equal(params(async_run), params(sync_run))
  rows = _rows(async_run)
  assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 1, 1]
  assert metric_rows(tmp_path / "async") == metric_rows(tmp_path / "sync")


MODES = {
  "sync": ENGINE,
  "off_policy": OFF_POLICY,
  "async": ASYNC,
}


@pytest.mark.slow
@pytest.mark.parametrize("mode", list(MODES))
def test_kill_9_mid_rollout_then_resume_equals_uninterrupted_run(tmp_path, mode):
  """Killed while a rollout is on the devices (the first dispatched after checkpoint N),
  the run resumes from checkpoint N, with its rollouts in flight, to the uninterrupted
  run's params and metrics."""
  settings = MODES[mode] | {"run.steps": 3 * N, "checkpoint.every": N}
  ref = train(small_config(tmp_path / "ref", **settings))
  cfg = small_config(tmp_path / "killed", **settings)
  run_killed(cfg, "mid-rollout", N, tmp_path)
  assert len(metric_rows(tmp_path / "killed")) < 3 * N
  resumed = train(cfg)
  assert resumed["resumed_from"] == N
  assert_bitwise_equal(params(resumed), params(ref))
  assert metric_rows(tmp_path / "killed") == metric_rows(tmp_path / "ref")
  if mode == "off_policy":  # its dynamic-sampling rounds drew prompts between dispatches
    assert any(r["rollout/dynamic_extra_rounds"] for r in metric_rows(tmp_path / "ref"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["off_policy", "async"])
def test_sigterm_mid_rollout_saves_the_rollouts_in_flight_and_exits_0(tmp_path, mode):
  """A preemption notice while a rollout is on the devices (no periodic checkpoints): the
  run saves after its step, rollouts in flight included, and exits 0; the re-run resumes
  from that save to the uninterrupted run's params and metrics."""
  from jaxrl_llm.train.checkpoint import Checkpointer

  settings = MODES[mode] | {"run.steps": 3 * N, "checkpoint.every": 100}
  ref = train(small_config(tmp_path / "ref", **settings))
  cfg = small_config(tmp_path / "stopped", **settings)
  run_killed(cfg, "sigterm-mid-rollout", N, tmp_path, returncode=0)
  (saved,) = [s for s in Checkpointer(cfg, read_only=True).steps() if s]
  assert N <= saved < 3 * N
  assert len(metric_rows(tmp_path / "stopped")) == saved
  resumed = train(cfg)
  assert resumed["resumed_from"] == saved
  assert_bitwise_equal(params(resumed), params(ref))
  assert metric_rows(tmp_path / "stopped") == metric_rows(tmp_path / "ref")


@pytest.mark.parametrize(
  "overrides,message",
  [
    ({"rollout.mode": "async"}, r"mode='async'.*off_policy_steps >= 1"),
    (
      {"rollout.mode": "async", "rollout.off_policy_steps": 1, "rollout.dynamic_sampling": True},
      r"dynamic_sampling.*use mode='sync'",
    ),
    ({"rollout.mode": "overlap"}, r"config.rollout.mode='overlap'; use 'sync' or 'async'"),
    ({"rollout.sampler": "paged"}, r"config.rollout.sampler='paged'; use 'engine'"),
    (
      {"rollout.sampler": "static", "env.name": "calculator"},
      r"only the engine does; set config.rollout.sampler='engine'",
    ),
    (
      {"rollout.off_policy_steps": -1},
      r"off_policy_steps=-1 is out of range: it must be >= 0 \(0: on-policy\)",
    ),
  ],
)
def test_bad_producer_settings_name_the_key(tmp_path, overrides, message):
  with pytest.raises(ConfigError, match=message):
    small_config(tmp_path, **overrides)


def test_a_sampler_that_leaves_no_trainer_devices_is_refused(tmp_path):
  cfg = small_config(tmp_path, **(ASYNC | {"rollout.sampler_devices": 8}))
  with pytest.raises(ConfigError, match=r"config.rollout.sampler_devices=8 must leave"):
    train(cfg)


def test_rollout_sampler_static_samples_with_the_static_sampler(tmp_path):
  from helpers import make_learner

  from jaxrl_llm.rollout import generate

  learner = make_learner(small_config(tmp_path, **{"rollout.sampler": "static"}))
  prompt = jax.numpy.asarray([[5, 6, 7, 8], [0, 0, 9, 10]], jax.numpy.int32)
  mask = prompt > 0
  key = jax.random.key(3)
  got = learner.generate(learner.state.policy, prompt, mask, key, num_samples=4, temperature=1.0)
  kw = dict(max_new_tokens=got.tokens_BxN.shape[1], num_samples=4, temperature=1.0)
  kw |= dict(eos_ids=learner.eos_ids, pad_id=learner.pad_id, params=learner.state.policy)
  graphdef = learner.policy_def
  static = generate(graphdef, prompt, mask, key, static=True, **kw)
  engine = generate(graphdef, prompt, mask, key, **kw)
  assert (got.tokens_BxN == static.tokens_BxN).all()
  assert not (static.tokens_BxN == engine.tokens_BxN).all()  # the two draw differently
