"""Reward models in Hugging Face's sequence-classifier layout: scores equal to transformers'
(tests/fixtures/make_reward_fixture.py), a bitwise round trip, and clear errors."""

import json
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl_llm.models import (
  CheckpointError,
  RewardModel,
  load_model,
  load_reward_model,
  save_reward_model,
)

FIXTURES = Path(__file__).parent / "fixtures"
REWARD = FIXTURES / "qwen2_reward"


def test_scores_match_transformers():
  ref = dict(np.load(REWARD / "reference.npz"))
  model = load_reward_model(REWARD)
  assert isinstance(model, RewardModel) and model.head_D[...].dtype == jnp.float32
  scores = model(jnp.asarray(ref["tokens"]), mask_BxL=jnp.asarray(ref["mask"]))
  np.testing.assert_allclose(scores, ref["scores"], atol=1e-5)
  assert np.ptp(ref["scores"]) > 1e-2  # rows differ, so a swapped row would be caught


def test_save_load_round_trip_is_bitwise(tmp_path):
  model = load_reward_model(REWARD)
  model.head_D[...] = model.head_D[...] * 1.5  # a trained head, not the fixture's
  save_reward_model(model, tmp_path, pad_token_id=0)
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["architectures"] == ["Qwen2ForSequenceClassification"]
  assert config["id2label"] == {"0": "LABEL_0"} and config["pad_token_id"] == 0
  back = load_reward_model(tmp_path)
  saved, loaded = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (model, back))
  for a, b in zip(saved, loaded, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bf16_params_keep_a_float32_head():
  model = load_reward_model(REWARD, dtype=jnp.bfloat16)
  assert model.decoder.embed_VxD[...].dtype == jnp.bfloat16
  assert model.head_D[...].dtype == jnp.float32


def test_a_nonzero_bias_is_refused_on_export(tmp_path):
  model = load_reward_model(REWARD)
  model.head_bias[...] = jnp.float32(0.5)
  with pytest.raises(ValueError, match="head_bias is 0.5.*no bias"):
    save_reward_model(model, tmp_path, pad_token_id=0)
  assert not (tmp_path / "config.json").exists()  # nothing half-written


def test_the_loaders_refuse_each_others_directories(tmp_path):
  with pytest.raises(CheckpointError, match="reward model.*load_reward_model"):
    load_model(REWARD)
  with pytest.raises(CheckpointError, match="not a reward model.*from_policy"):
    load_reward_model(FIXTURES / "qwen2_tied")


def test_more_than_one_label_is_refused(tmp_path):
  shutil.copytree(REWARD, tmp_path / "rm")
  config = json.loads((tmp_path / "rm" / "config.json").read_text())
  config["id2label"] = {"0": "bad", "1": "good"}
  config.pop("num_labels", None)
  (tmp_path / "rm" / "config.json").write_text(json.dumps(config))
  with pytest.raises(CheckpointError, match=r"config\.json.*one label.*has 2"):
    load_reward_model(tmp_path / "rm")
