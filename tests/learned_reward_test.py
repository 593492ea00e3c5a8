"""A learned reward model as a reward function: on the trainer's mesh, normalised by running
moments that a checkpoint carries, and chosen in config for an RL run."""

import json

import jax
import numpy as np
import pytest
from helpers import ENGINE, REPO, small_config

from jaxrl_llm.models import load_reward_model, load_tokenizer
from jaxrl_llm.models.sharding import make_mesh
from jaxrl_llm.train import train
from jaxrl_llm.train.checkpoint import Checkpointer
from jaxrl_llm.train.config import ConfigError
from jaxrl_llm.train.learned_reward import reward_model_fn

REWARD = REPO / "tests" / "fixtures" / "qwen2_reward"
COMPLETIONS = ["7", "8", "12", "0", "99", "3+4", "", "seven", "7.0", "1"]
EXAMPLES = [{"prompt": "3+4="}] * len(COMPLETIONS)


def test_scores_on_an_8_device_mesh_equal_one_device():
  model, tok = load_reward_model(REWARD), load_tokenizer(REWARD)
  one = reward_model_fn(model, tok, max_length=16, batch_size=8)(COMPLETIONS, EXAMPLES)
  mesh = make_mesh(devices=jax.devices())
  on_mesh = reward_model_fn(model, tok, max_length=16, batch_size=8, mesh=mesh)
  got = on_mesh(COMPLETIONS, EXAMPLES)
  np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-6)
  assert np.ptp(one) > 1e-3  # the texts score differently, so rows cannot be swapped unseen


def test_normalised_scores_use_every_score_so_far():
  model, tok = load_reward_model(REWARD), load_tokenizer(REWARD)
  raw = reward_model_fn(model, tok, max_length=16, batch_size=4)
  norm = reward_model_fn(model, tok, max_length=16, batch_size=4, normalize=True)
  seen = []
  for part in (slice(0, 6), slice(6, 10)):  # 6 rows: two chunks of 4, the last padded
    want = raw(COMPLETIONS[part], EXAMPLES[part])
    seen.extend(want.tolist())
    got = norm(COMPLETIONS[part], EXAMPLES[part])
    mean, std = np.mean(seen), np.std(seen, ddof=1)
    np.testing.assert_allclose(got, (want - mean) / std, rtol=1e-4, atol=1e-5)
  assert norm.state()["count"] == 10.0
  fresh = reward_model_fn(model, tok, max_length=16, batch_size=4, normalize=True)
  fresh.restore(norm.state())
  np.testing.assert_array_equal(fresh(COMPLETIONS, EXAMPLES), norm(COMPLETIONS, EXAMPLES))


def test_ppo_against_a_reward_model_from_config(tmp_path):
  """GAE/PPO for 2 steps, the reward the normalised r alone (the task's exact match kept as
  a logged score): each step's mean reward is that of standardised scores, and the
  checkpoint holds the running moments of all 2 x 32 scores."""
  cfg = small_config(
    tmp_path,
    **{
      "algo.estimator": "gae",
      "run.steps": 2,
      "checkpoint.every": 1,
      "checkpoint.async_save": False,
      "rewards.model_path": str(REWARD),
      "rewards.model_batch_size": 16,
      "rewards.model_max_length": 16,
      "rewards.model_normalize": True,
      "rewards.task_weight": 0.0,
    },
  )
  summary = train(cfg)
  rows = [json.loads(line) for line in open(summary["metrics"])]
  assert len(rows) == 2
  for row in rows:
    rewards = {"rollout/reward/reward_model", "rollout/reward/exact_match", "rollout/accuracy"}
    assert rewards <= set(row)
    np.testing.assert_allclose(
      row["rollout/reward_mean"], row["rollout/reward/reward_model"], atol=1e-6
    )
  # The first batch is standardised by its own moments.
  assert abs(rows[0]["rollout/reward_mean"]) < 1e-5
  np.testing.assert_allclose(rows[0]["rollout/reward_std"], np.sqrt(31 / 32), rtol=1e-4)
  ckpt = Checkpointer(cfg)  # the run's last checkpoint, read back
  state = ckpt.read_meta(2)["reward_states"]["reward_model"]
  ckpt.close()
  assert state["count"] == 64.0


def test_a_reward_model_with_an_environment_is_refused(tmp_path):
  with pytest.raises(ConfigError, match="rewards.model_path is set with config.env.name"):
    keys = {"env.name": "calculator", "rewards.model_path": str(REWARD), **ENGINE}
    small_config(tmp_path, **keys)


def test_a_directory_that_is_not_a_reward_model_names_the_key(tmp_path):
  cfg = small_config(tmp_path, **{"rewards.model_path": str(REPO / "tests/fixtures/qwen2_tied")})
  with pytest.raises(ConfigError, match=r"config.rewards.model_path=.*not a reward model"):
    train(cfg)
