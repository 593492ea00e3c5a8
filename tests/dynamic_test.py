import json

import jax
import numpy as np
import pytest
from helpers import ENGINE, OnesTask, small_config

from jaxrl_llm.rollout.dynamic import Round, assemble, informative_groups
from jaxrl_llm.train import train


def _round(scores, prompt_len, offset):
  B = len(scores)
  return Round(
    np.full((B, prompt_len), offset, np.int32),
    np.ones((B, prompt_len), bool),
    np.arange(B)[:, None] + offset + np.zeros((B, 3), np.int32),
    np.ones((B, 3), bool),
    np.asarray(scores, np.float32),
    np.zeros(B, bool),
    np.full((B, 3), -offset / 1000, np.float32),
    np.asarray(scores, np.float32),
  )


def test_informative_groups():
  np.testing.assert_array_equal(
    informative_groups(np.array([1, 1, 0, 1, 0, 0.0]), 2), [False, True, False]
  )


def test_assemble_prefers_informative_groups_and_keeps_shapes():
  first = _round([1, 1, 0, 1], prompt_len=3, offset=100)  # groups: equal, informative
  second = _round([0, 1, 0, 0], prompt_len=5, offset=200)  # informative, equal
  batch = assemble([first, second], group_size=2, num_groups=2, pad_id=7)
  np.testing.assert_array_equal(batch.scores_B, [0, 1, 0, 1])
  np.testing.assert_array_equal(batch.tokens_BxN[:, 0], [102, 103, 200, 201])
  np.testing.assert_allclose(batch.logprobs_BxN[:, 0], [-0.1, -0.1, -0.2, -0.2], rtol=1e-6)
  assert batch.prompt_BxP.shape == (4, 5)  # re-padded on the left to the longer round
  np.testing.assert_array_equal(batch.prompt_BxP[0], [7, 7, 100, 100, 100])
  np.testing.assert_array_equal(batch.prompt_mask_BxP[0], [0, 0, 1, 1, 1])
  # Not enough informative groups: dropped ones fill the rest.
  batch = assemble([first], group_size=2, num_groups=2, pad_id=7)
  np.testing.assert_array_equal(batch.scores_B, [0, 1, 1, 1])


def test_assemble_filters_on_its_metric_not_on_the_scores():
  """An all-wrong group whose shaped scores differ ([0, -1/3]: an overlong penalty) is not
  informative when groups are filtered on correctness."""
  rnd = _round([0, -1 / 3, 1, 0], prompt_len=3, offset=100)._replace(
    filter_B=np.array([0, 0, 1, 0], np.float32)
  )
  batch = assemble([rnd], group_size=2, num_groups=2, pad_id=7)
  np.testing.assert_array_equal(batch.tokens_BxN[:, 0], [102, 103, 100, 101])
  np.testing.assert_array_equal(informative_groups(batch.filter_B, 2), [True, False])


@pytest.mark.parametrize("metric", ["accuracy", "score"])
def test_dynamic_sampling_filters_on_correctness_by_default(tmp_path, metric):
  """A random policy never solves 2-digit addition, but DAPO's overlong penalty varies with
  its lengths: on accuracy (the default) no group is informative, so none is kept and the
  policy does not move on length alone; on the score the penalty makes groups informative."""
  cfg = small_config(
    tmp_path,
    **{**ENGINE, "rollout.dynamic_sampling": True, "rollout.dynamic_sampling_metric": metric,
       "rollout.max_extra_rounds": 1, "rewards.overlong_weight": 1.0,
       "rewards.overlong_cache_tokens": 3, "run.steps": 1},
  )  # fmt: skip
  summary = train(cfg, devices=jax.devices()[:1])
  (row,) = [json.loads(line) for line in open(summary["metrics"])]
  assert row["rollout/accuracy"] == 0.0 and row["rollout/reward_std"] > 0  # the penalty varies
  if metric == "accuracy":
    assert row["rollout/dynamic_groups_kept"] == 0 and row["train/grad_norm"] == 0.0
  else:
    assert row["rollout/dynamic_groups_kept"] > 0 and row["train/grad_norm"] > 0.0


def test_trainer_with_dynamic_sampling(tmp_path):
  cfg = small_config(tmp_path, **{**ENGINE, "rollout.dynamic_sampling": True, "run.steps": 3})
  summary = train(cfg, devices=jax.devices()[:1], task=OnesTask(cfg))
  rows = [json.loads(line) for line in open(summary["metrics"])]
  for row in rows:
    assert 0 <= row["rollout/zero_variance_group_fraction"] <= 1
    assert 0 <= row["rollout/dynamic_extra_rounds"] <= 2
    assert (
      row["rollout/informative_group_fraction"]
      >= 1 - row["rollout/zero_variance_group_fraction"] - 1e-6
    )


def test_all_equal_rewards_use_every_extra_round(tmp_path):
  """A random policy never solves 2-digit addition: every group is uninformative, so dynamic
  sampling takes all its extra rounds and still fills the batch."""
  cfg = small_config(
    tmp_path,
    **{**ENGINE, "rollout.dynamic_sampling": True, "run.steps": 2, "rollout.max_extra_rounds": 2},
  )
  summary = train(cfg, devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(summary["metrics"])]
  assert [r["rollout/dynamic_extra_rounds"] for r in rows] == [2, 2]
  assert all(r["rollout/zero_variance_group_fraction"] == 1.0 for r in rows)


def test_a_sample_budget_is_met_exactly_by_dynamic_sampling(tmp_path):
  """Every group of a random policy is uninformative, so each step wants all its extra
  rounds; the last step takes only what the budget leaves, and the run stops at the
  budget exactly (5 batches: 3 rounds, then 2), not one dynamic round past it."""
  cfg = small_config(
    tmp_path,
    **{**ENGINE, "rollout.dynamic_sampling": True, "rollout.max_extra_rounds": 2, "run.steps": 10},
  )
  budget = 5 * cfg.batch_size
  cfg = small_config(
    tmp_path,
    **{**ENGINE, "rollout.dynamic_sampling": True, "rollout.max_extra_rounds": 2, "run.steps": 10,
       "run.sample_budget": budget},
  )  # fmt: skip
  summary = train(cfg, devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(summary["metrics"])]
  assert [r["rollout/dynamic_extra_rounds"] for r in rows] == [2, 1]
  assert (
    sum(r["rollout/completions_sampled"] for r in rows) == budget == summary["completions_sampled"]
  )
