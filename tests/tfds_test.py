"""The TFDS builders write array_record files that read back, without TensorFlow, as the
generators' examples."""

import importlib.util

import pytest

from jaxrl_llm.data import ArithmeticTask
from jaxrl_llm.data.countdown import CountdownTask
from jaxrl_llm.data.gsm8k import load_gsm8k_file
from jaxrl_llm.data.tfds_builders import (
  arithmetic_builder,
  countdown_builder,
  gsm8k_local_builder,
  read_split,
)

GSM8K = "tests/fixtures/gsm8k_sample.jsonl"


def _sorted(examples, keys):
  return sorted(({k: e[k] for k in keys} for e in examples), key=lambda e: e["prompt"])


def test_no_tensorflow_needed():
  assert importlib.util.find_spec("tensorflow") is None


def test_arithmetic_builder_round_trip(tmp_path):
  builder = arithmetic_builder(tmp_path, digits=2, train_examples=64, test_examples=16, seed=3)
  builder.download_and_prepare()
  assert list(tmp_path.rglob("*.array_record*"))
  task = ArithmeticTask(digits=2)
  keys = ["prompt", "question", "answer"]
  assert read_split(builder, "train") == _sorted(task.examples("train", 64, 3), keys)
  assert read_split(builder, "test") == _sorted(task.examples("test", 16, 4), keys)


def test_countdown_builder_round_trip(tmp_path):
  builder = countdown_builder(tmp_path, train_examples=32, test_examples=8, seed=1)
  builder.download_and_prepare()
  keys = ["prompt", "numbers", "target", "solution"]
  assert read_split(builder, "train") == _sorted(CountdownTask().examples("train", 32, 1), keys)


def test_gsm8k_local_builder(tmp_path):
  builder = gsm8k_local_builder(tmp_path, GSM8K)
  builder.download_and_prepare()
  keys = ["prompt", "question", "solution", "answer"]
  assert read_split(builder, "train") == _sorted(load_gsm8k_file(GSM8K), keys)


def test_trainer_reads_through_tfds(tmp_path):
  import json

  import jax
  from helpers import small_config

  from jaxrl_llm.data.tfds_builders import TfdsSource
  from jaxrl_llm.train import train
  from jaxrl_llm.train.task import Task

  cfg = small_config(tmp_path, **{"task.data_dir": str(tmp_path / "tfds"), "run.steps": 2})
  summary = train(cfg, devices=jax.devices()[:1])
  assert list((tmp_path / "tfds").rglob("*.array_record*"))
  # The examples the trainer drew are the generator's, read back from the array_record files.
  task = Task(cfg)
  assert isinstance(task.spec, TfdsSource)
  keys = ["prompt", "answer"]
  drawn = task.draw("train", cfg.task.train_examples, cfg.run.seed, "task.train_examples")
  generated = ArithmeticTask(digits=2, ops="+").examples("train", cfg.task.train_examples, 0)
  assert _sorted(drawn, keys) == _sorted(generated, keys)
  rows = [json.loads(line) for line in open(summary["metrics"])]
  assert [r["step"] for r in rows] == [1, 2]
  for r in rows:  # exact match is the only reward: the mean reward is the accuracy
    assert r["rollout/reward_mean"] == pytest.approx(r["rollout/accuracy"], abs=1e-7)
