"""A newcomer's first command, and the ways it fails: each error names the key or the file,
and the fix (the list in docs/troubleshooting.md)."""

import json
import shutil

import jax
import pytest
from helpers import run_cli, small_config

from jaxrl_llm.train import ConfigError, train

GSM8K = "tests/fixtures/gsm8k_sample.jsonl"
FIXTURE = "tests/fixtures/qwen2_tied"


def _run(tmp_path, **overrides):
  return train(small_config(tmp_path, **overrides), devices=jax.devices()[:1])


def _model_copy(tmp_path, edit):
  model = tmp_path / "model"
  shutil.copytree(FIXTURE, model)
  edit(model)
  return str(model)


def _drop_safetensors(model):
  (model / "model.safetensors").unlink()
  (model / "pytorch_model.bin").write_bytes(b"pickle")


def _gpt2(model):
  config = json.loads((model / "config.json").read_text())
  config |= {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
  (model / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
  "make_path,message",
  [
    (lambda tmp: str(tmp / "no_such_model"), r"config.model.path=.*is not a directory; give"),
    (
      lambda tmp: _model_copy(tmp, lambda m: (m / "tokenizer.json").unlink()),
      r"config.model.path=.*tokenizer.json is missing.*save_pretrained",
    ),
    (
      lambda tmp: _model_copy(tmp, _drop_safetensors),
      r"config.model.path=.*has neither model.safetensors.*convert them to safetensors",
    ),
    (
      lambda tmp: _model_copy(tmp, _gpt2),
      r"config.model.path=.*config.json: architecture \['GPT2LMHeadModel'\] is not supported",
    ),
  ],
)
def test_bad_model_directory(tmp_path, make_path, message):
  with pytest.raises(ConfigError, match=message):
    _run(tmp_path, **{"model.path": make_path(tmp_path), "task.prompt_length": 16})


def test_prompt_longer_than_prompt_length(tmp_path):
  with pytest.raises(
    ConfigError,
    match=r"prompts of config.task.train_examples are longer than config.task.prompt_length=3 "
    r"tokens; the longest has 6 .*Raise config.task.prompt_length to 6, or set "
    r"config.task.filter_overlong_prompts=True",
  ):
    _run(tmp_path, **{"task.prompt_length": 3})


def test_overlong_prompts_can_be_filtered(tmp_path):
  """Three of the eight GSM8K fixture questions render to more than 95 characters."""
  overrides = {
    "task.name": "gsm8k",
    "task.path": GSM8K,
    "task.test_path": GSM8K,
    "task.prompt_length": 95,
    "task.train_examples": 8,
    "run.eval_examples": 8,
    "run.eval_batch_size": 8,
    "rollout.prompts_per_step": 2,
  }
  summary = _run(tmp_path, **overrides, **{"task.filter_overlong_prompts": True})
  assert summary["filtered_overlong_prompts"] == {"train": 3, "test": 3}
  with pytest.raises(ConfigError, match=r"3 of the 8 prompts of config.task.train_examples"):
    _run(tmp_path, **overrides)


@pytest.mark.parametrize(
  "overrides,message",
  [
    (
      {"run.eval_examples": 512},
      r"config.run.eval_examples=512: 512 test records requested but the file gives 8. "
      r"Lower config.run.eval_examples",
    ),
    (
      {"task.train_examples": 100},
      r"config.task.train_examples=100: .*Lower config.task.train_examples",
    ),
    (
      {"task.path": "tests/fixtures/missing.jsonl"},
      r"config.task.path.*missing.jsonl does not exist; give a GSM8K-format",
    ),
  ],
)
def test_local_file_too_small_or_missing(tmp_path, overrides, message):
  base = {
    "task.name": "gsm8k",
    "task.path": GSM8K,
    "task.test_path": GSM8K,
    "task.train_examples": 8,
    "run.eval_examples": 8,
    "rollout.prompts_per_step": 2,
    "task.prompt_length": 128,
  }
  with pytest.raises(ConfigError, match=message):
    _run(tmp_path, **(base | overrides))


def test_the_command_line_prints_the_key_and_exits(tmp_path):
  out = run_cli("--config.task.prompt_length=3", f"--config.run.workdir={tmp_path / 'run'}")
  assert out.returncode == 1
  assert (
    out.stderr.strip()
    .splitlines()[-1]
    .startswith(
      "config error: 4096 of the 4096 prompts of config.task.train_examples are longer than "
      "config.task.prompt_length=3 tokens"
    )
  )
