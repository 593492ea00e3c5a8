import json

import jax
import numpy as np
from train_test import OnesTask, small_config

from jaxrl_llm.train import train
from jaxrl_llm.train.dynamic import Round, assemble, informative_groups


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


def test_trainer_with_dynamic_sampling(tmp_path):
  cfg = small_config(tmp_path, **{"rollout.dynamic_sampling": True, "run.steps": 3})
  summary = train(cfg, devices=jax.devices()[:1], task=OnesTask(cfg))
  rows = [json.loads(line) for line in open(summary["metrics"])]
  for row in rows:
    assert 0 <= row["zero_variance_group_fraction"] <= 1
    assert 0 <= row["dynamic_extra_rounds"] <= 2
    assert row["informative_group_fraction"] >= 1 - row["zero_variance_group_fraction"] - 1e-6


def test_all_equal_rewards_use_every_extra_round(tmp_path):
  """A random policy never solves 2-digit addition: every group is uninformative, so dynamic
  sampling takes all its extra rounds and still fills the batch."""
  cfg = small_config(
    tmp_path, **{"rollout.dynamic_sampling": True, "run.steps": 2, "rollout.max_extra_rounds": 2}
  )
  summary = train(cfg, devices=jax.devices()[:1])
  rows = [json.loads(line) for line in open(summary["metrics"])]
  assert [r["dynamic_extra_rounds"] for r in rows] == [2, 2]
  assert all(r["zero_variance_group_fraction"] == 1.0 for r in rows)
