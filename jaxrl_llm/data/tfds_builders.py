"""TFDS builders for the tasks, written as array_record files and read without TensorFlow.

  builder = arithmetic_builder(digits=2, ops="+", data_dir="~/tensorflow_datasets")
  builder.download_and_prepare()               # writes array_record shards
  source = builder.as_data_source(split="train")  # random access, no TF needed
  examples = read_split(builder, "train")

The builders register with TFDS under `jaxrl_arithmetic`, `jaxrl_countdown` and
`jaxrl_gsm8k_local`, so users who have TensorFlow can also
`tfds.load("jaxrl_arithmetic/d2_+", data_dir=...)`. GSM8K itself, for users with
network, is TFDS's own `gsm8k` builder.
"""

import dataclasses
import zlib

import numpy as np
import tensorflow_datasets as tfds

from jaxrl_llm.data.arithmetic import ArithmeticTask
from jaxrl_llm.data.countdown import CountdownTask
from jaxrl_llm.data.gsm8k import load_gsm8k_file

_TEXT = tfds.features.Text()


@dataclasses.dataclass
class SyntheticConfig(tfds.core.BuilderConfig):
  """Task parameters, split sizes and the generation seed."""

  task: dict = dataclasses.field(default_factory=dict)
  train_examples: int = 4096
  test_examples: int = 512
  seed: int = 0


class _Synthetic(tfds.core.GeneratorBasedBuilder):
  VERSION = tfds.core.Version("1.0.0")
  TASK = None

  def _split_generators(self, dl_manager):
    del dl_manager
    task = self.TASK(**self.builder_config.task)
    c = self.builder_config
    return {
      "train": self._generate_examples(task.examples("train", c.train_examples, c.seed)),
      "test": self._generate_examples(task.examples("test", c.test_examples, c.seed + 1)),
    }

  def _generate_examples(self, examples):
    for i, example in enumerate(examples):
      yield i, self._encode(example)

  def _encode(self, example):
    return example


class JaxrlArithmetic(_Synthetic):
  """n-digit arithmetic problems (see `data.arithmetic.ArithmeticTask`)."""

  TASK = ArithmeticTask
  VERSION = tfds.core.Version("1.1.0")
  RELEASE_NOTES = {"1.1.0": "Each example has its question (`47 + 15`) for chat instructions."}
  BUILDER_CONFIGS = [SyntheticConfig(name="d2_+", task={"digits": 2, "ops": "+"})]

  def _info(self):
    features = tfds.features.FeaturesDict({"prompt": _TEXT, "question": _TEXT, "answer": _TEXT})
    return tfds.core.DatasetInfo(builder=self, features=features)


class JaxrlCountdown(_Synthetic):
  """Countdown problems with a reference solution (see `data.countdown.CountdownTask`)."""

  TASK = CountdownTask
  BUILDER_CONFIGS = [SyntheticConfig(name="n4_50", task={"count": 4, "max_number": 50})]

  def _info(self):
    features = tfds.features.FeaturesDict(
      {
        "prompt": _TEXT,
        "solution": _TEXT,
        "target": np.int64,
        "numbers": tfds.features.Sequence(np.int64),
      }
    )
    return tfds.core.DatasetInfo(builder=self, features=features)


@dataclasses.dataclass
class Gsm8kLocalConfig(tfds.core.BuilderConfig):
  train_path: str = ""
  test_path: str = ""


class JaxrlGsm8kLocal(tfds.core.GeneratorBasedBuilder):
  """GSM8K-format local files (see `data.gsm8k.load_gsm8k_file`) as a TFDS dataset."""

  VERSION = tfds.core.Version("1.0.0")
  BUILDER_CONFIGS = [Gsm8kLocalConfig(name="local")]

  def _info(self):
    features = tfds.features.FeaturesDict(
      {"prompt": _TEXT, "question": _TEXT, "solution": _TEXT, "answer": _TEXT}
    )
    return tfds.core.DatasetInfo(builder=self, features=features)

  def _split_generators(self, dl_manager):
    del dl_manager
    c = self.builder_config
    if not c.train_path:
      raise ValueError("jaxrl_gsm8k_local needs train_path (and optionally test_path).")
    splits = {"train": c.train_path} | ({"test": c.test_path} if c.test_path else {})
    return {name: self._generate_examples(path) for name, path in splits.items()}

  def _generate_examples(self, path):
    yield from enumerate(load_gsm8k_file(path))


def _builder(cls, config, data_dir):
  return cls(config=config, data_dir=data_dir, file_format="array_record")


SYNTHETIC = {"arithmetic": JaxrlArithmetic, "countdown": JaxrlCountdown}


def synthetic_builder(kind, data_dir, *, train_examples=4096, test_examples=512, seed=0, **task):
  """The builder of `kind` ("arithmetic" or "countdown") for these task parameters
  (`digits`, `ops`; or `count`, `max_number`), split sizes and seed."""
  params = "_".join(f"{k}{v}" for k, v in sorted(task.items()))
  config = SyntheticConfig(
    name=f"{params}_n{train_examples}_{test_examples}_s{seed}",
    task=task,
    train_examples=train_examples,
    test_examples=test_examples,
    seed=seed,
  )
  return _builder(SYNTHETIC[kind], config, data_dir)


def arithmetic_builder(data_dir, *, digits=2, ops="+", **kwargs):
  return synthetic_builder("arithmetic", data_dir, digits=digits, ops=ops, **kwargs)


def countdown_builder(data_dir, *, count=4, max_number=50, **kwargs):
  return synthetic_builder("countdown", data_dir, count=count, max_number=max_number, **kwargs)


def gsm8k_local_builder(data_dir, train_path, test_path=""):
  """A builder for local files; its config name is a hash of their paths."""
  key = zlib.crc32(f"{train_path}|{test_path}".encode())
  config = Gsm8kLocalConfig(
    name=f"local_{key:08x}", train_path=str(train_path), test_path=str(test_path)
  )
  return _builder(JaxrlGsm8kLocal, config, data_dir)


def _decode(value):
  if isinstance(value, bytes):
    return value.decode("utf-8")
  if isinstance(value, np.ndarray):
    return [int(v) for v in value]
  if isinstance(value, np.integer):
    return int(value)
  return value


def read_split(builder, split: str) -> list[dict]:
  """Every example of a prepared split, as plain Python dicts in a stable order."""
  source = builder.as_data_source(split=split)
  examples = [{k: _decode(v) for k, v in source[i].items()} for i in range(len(source))]
  return sorted(examples, key=lambda e: e["prompt"])


class TfdsSource:
  """A prepared builder as a task's example source: `examples(split, n, seed)` draws `n`
  of the stored split in a seeded order (preparing the dataset on first use)."""

  def __init__(self, builder, alphabet: str | None = None):
    builder.download_and_prepare()
    self._splits = {split: read_split(builder, split) for split in builder.info.splits}
    if alphabet is None:
      alphabet = "".join(
        sorted(
          {
            c
            for split in self._splits.values()
            for e in split
            for c in e["prompt"] + str(e.get("solution", e.get("answer")))
          }
        )
      )
    self.alphabet = alphabet

  def examples(self, split: str, n: int, seed: int) -> list[dict]:
    pool = self._splits.get(split)
    if pool is None:
      raise ValueError(f"the prepared dataset has no {split!r} split ({sorted(self._splits)}).")
    if n > len(pool):
      raise ValueError(f"{n} {split} examples requested; the prepared split holds {len(pool)}.")
    return [pool[i] for i in np.random.default_rng(seed).permutation(len(pool))[:n]]
