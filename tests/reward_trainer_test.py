"""Training a reward model on preference pairs (`run.job='reward_model'`): it learns the
fixture's preference (tests/fixtures/make_preference_fixture.py), every layout reads, bad
files name their key and line, and a run killed with SIGKILL resumes bitwise."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from helpers import REPO, run_cli, run_killed, small_config

from jaxrl_llm.data import preferences
from jaxrl_llm.models import load_reward_model, load_tokenizer
from jaxrl_llm.train.config import ConfigError
from jaxrl_llm.train.reward_model import train_reward_model

PAIRS = REPO / "tests" / "fixtures" / "preferences"
CHAT_MODEL = str(REPO / "tests" / "fixtures" / "qwen2_tied")  # its tokenizer has ChatML


def rm_config(tmp_path, **overrides):
  """A 2-layer, 64-wide reward model on the plain one-digit additions, 32 pairs a step."""
  keys = {
    "run.job": "reward_model",
    "reward_model.train_path": str(PAIRS / "plain.jsonl"),
    "reward_model.test_fraction": 0.2,
    "reward_model.batch_size": 32,
    "reward_model.max_length": 8,
    "model.hidden_size": 64,
    "model.intermediate_size": 128,
    "model.num_layers": 2,
    "optim.learning_rate": 1e-3,
    "checkpoint.every": 0,
  }
  return small_config(tmp_path, **(keys | overrides))


def _params(directory):
  return jax.tree.leaves(nnx.state(load_reward_model(directory), nnx.Param))


@pytest.mark.slow
def test_a_trained_reward_model_ranks_held_out_pairs(tmp_path):
  cfg = rm_config(tmp_path, **{"run.steps": 300, "run.eval_every": 100})
  summary = train_reward_model(cfg)
  assert summary["test_pairs"] > 100 and summary["train_pairs"] + summary["test_pairs"] == 590
  assert summary["heldout_pair_accuracy_before"] < 0.75
  assert summary["heldout_pair_accuracy_after"] >= 0.9
  rows = [json.loads(line) for line in open(summary["metrics"])]
  assert [r["step"] for r in rows] == list(range(1, 301))
  assert [r["step"] for r in rows if "eval/heldout_pair_accuracy" in r] == [100, 200, 300]
  assert rows[-1]["train/loss"] < rows[0]["train/loss"]
  # the exported Hugging Face directory scores as the trained model did
  model = load_reward_model(summary["reward_model"])
  tok = load_tokenizer(summary["reward_model"])
  ids = [tok.encode(t) for t in ("3+4=7", "3+4=9")]
  scores = model(np.asarray(ids))
  assert scores[0] > scores[1]
  assert float(model.head_bias[...]) == 0.0


@pytest.mark.parametrize("layout", ["chat.jsonl", "implicit.jsonl"])
def test_chat_layouts_render_the_prompt_as_rl_prompts_are(layout):
  tok = load_tokenizer(CHAT_MODEL)
  prompt_key = "prompt" if layout == "chat.jsonl" else ""
  pair = preferences.load_pairs(PAIRS / layout, prompt_key=prompt_key)[0]
  chosen, rejected = preferences.pair_texts(pair, tok)
  opened = tok.apply_chat_template([{"role": "user", "content": "0+0="}])
  assert (chosen, rejected) == (opened + "0", opened + "1")


def test_parquet_and_jsonl_give_the_same_pairs():
  jsonl = preferences.load_pairs(PAIRS / "plain.jsonl", margin_key="margin")
  parquet = preferences.load_pairs(PAIRS / "plain.parquet", margin_key="margin")
  assert [p[:4] for p in jsonl] == [p[:4] for p in parquet]
  assert jsonl[0].margin == pytest.approx(0.1)


def test_chat_pairs_train_from_a_causal_lm_with_a_fresh_head(tmp_path):
  """`model.path` a causal LM: its backbone, a new head; the implicit-prompt layout."""
  cfg = rm_config(
    tmp_path,
    **{
      "model.path": CHAT_MODEL,
      "reward_model.train_path": str(PAIRS / "implicit.jsonl"),
      "reward_model.prompt_key": "",
      "reward_model.max_length": 24,
      "run.steps": 2,
    },
  )
  summary = train_reward_model(cfg)
  assert summary["steps_run"] == 2
  exported = Path(summary["reward_model"])
  config = json.loads((exported / "config.json").read_text())
  assert config["architectures"] == ["Qwen2ForSequenceClassification"]
  assert (exported / "tokenizer.json").exists()


def test_a_hugging_face_reward_model_keeps_its_own_head(tmp_path):
  """`model.path` a reward model: loaded whole, head included (0 steps export it as is)."""
  rm_dir = REPO / "tests" / "fixtures" / "qwen2_reward"
  summary = train_reward_model(rm_config(tmp_path, **{"model.path": str(rm_dir), "run.steps": 0}))
  for a, b in zip(_params(rm_dir), _params(summary["reward_model"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
  ("content", "keys", "message"),
  [
    ('{"prompt": "a", "chosen": "b"}\n', {}, r"p.jsonl:1: the record has no 'rejected' column"),
    ("", {}, r"p.jsonl holds no records"),
    ('{"prompt": "a", "chosen": 3, "rejected": "c"}\n', {}, r"p.jsonl:1: 'chosen' must be text"),
    (
      '{"prompt": "a", "chosen": [{"role": "assistant", "content": "b"}], "rejected": "c"}\n',
      {},
      r"p.jsonl:1: mixes plain text and chat",
    ),
    (
      '{"prompt": "a", "chosen": "b", "rejected": "c", "m": "x"}\n',
      {"margin_key": "m"},
      r"p.jsonl:1: 'm' must be a number",
    ),
    (
      '{"q": "a", "chosen": "b", "rejected": "c"}\n',
      {},
      r"p.jsonl:1: the record has no 'prompt' column",
    ),
  ],
)
def test_malformed_pair_files_name_file_line_and_key(tmp_path, content, keys, message):
  path = tmp_path / "p.jsonl"
  path.write_text(content)
  overrides = {f"reward_model.{k}": v for k, v in keys.items()}
  cfg = rm_config(tmp_path, **{"reward_model.train_path": str(path), **overrides})
  with pytest.raises(ConfigError, match=r"config.reward_model.train_path: .*" + message):
    train_reward_model(cfg)


def test_config_errors_name_the_key(tmp_path):
  with pytest.raises(ConfigError, match=r"run.job='reward_model' needs .*train_path"):
    rm_config(tmp_path, **{"reward_model.train_path": ""})
  with pytest.raises(ConfigError, match=r"config.run.job='rm'; use 'rl' or 'reward_model'"):
    rm_config(tmp_path, **{"run.job": "rm"})
  cfg = rm_config(tmp_path, **{"reward_model.train_path": str(PAIRS / "chat.jsonl")})
  with pytest.raises(ConfigError, match=r"chat messages.*set config.model.path"):
    train_reward_model(cfg)
  cfg = rm_config(tmp_path, **{"reward_model.batch_size": 12})
  with pytest.raises(ConfigError, match=r"batch_size=12 must be divisible by data x fsdp = 8"):
    train_reward_model(cfg)


@pytest.mark.slow
def test_resume_after_kill_9_is_bitwise(tmp_path):
  """Killed right after step 3 (step 2 checkpointed), rerun: the same metrics rows and
  the same exported weights as a run never interrupted."""
  keys = {"run.steps": 6, "checkpoint.every": 2, "checkpoint.async_save": False}
  whole = train_reward_model(rm_config(tmp_path / "whole", **keys))
  cfg = rm_config(tmp_path / "killed", **keys)
  run_killed(cfg, "after-step", 3, tmp_path)
  resumed = train_reward_model(cfg)
  rows = [[json.loads(line) for line in open(s["metrics"])] for s in (whole, resumed)]
  assert rows[0] == rows[1] and len(rows[0]) == 6
  assert resumed["heldout_pair_accuracy_before"] == whole["heldout_pair_accuracy_before"]
  for a, b in zip(_params(whole["reward_model"]), _params(resumed["reward_model"]), strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_command_line_trains_and_prints_the_accuracies(tmp_path):
  out = run_cli(
    "--config.run.job=reward_model",
    f"--config.reward_model.train_path={PAIRS / 'plain.parquet'}",
    "--config.reward_model.batch_size=8",
    "--config.reward_model.max_length=8",
    "--config.run.steps=2",
    "--config.run.progress=False",
    "--config.warmstart.steps=0",
    f"--config.run.workdir={tmp_path / 'run'}",
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert "run: reward model, Bradley-Terry loss" in out.stdout
  assert "heldout_pair_accuracy before=" in out.stdout
  assert (tmp_path / "run" / "reward_model" / "model.safetensors").exists()
