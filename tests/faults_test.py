"""Faults end a run cleanly and lose nothing: a reward function that raises or hangs fails
its step with an error naming it (or, with `rewards.on_error='zero'`, scores 0 and is
counted), and the checkpoint before that step stays the newest."""

import errno
import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, assert_bitwise_equal, params, small_config

from jaxrl_llm.rewards import RewardError, exact_match
from jaxrl_llm.train import train
from jaxrl_llm.train.checkpoint import Checkpointer, CheckpointWriteError, config_dict
from jaxrl_llm.train.task import Task

STUCK = REPO / "tests" / "fixtures" / "stuck_reward_run.py"
CHECKPOINTED = {"run.steps": 4, "checkpoint.every": 1}


ROWS = 32  # a step's completions: 8 prompts x 4 samples (held-out batches are 16)


def _poisoned(first_batch: int, every: bool = False):
  """Exact match that raises on any call holding row 5 of the `first_batch`th step's batch
  (of every step's from then on, with `every`); the rows are told apart by identity, so
  scoring that row alone raises too."""
  batches, poison = [0], set()

  def flaky(completions, examples):
    if len(examples) == ROWS:
      batches[0] += 1
      if batches[0] == first_batch or (every and batches[0] > first_batch):
        poison.add(id(examples[5]))
    if any(id(e) in poison for e in examples):
      raise ValueError("cannot parse")
    return exact_match(completions, examples)

  return flaky


def test_a_reward_that_raises_stops_the_step_naming_it_and_the_completion(tmp_path):
  cfg = small_config(tmp_path, **CHECKPOINTED)
  task = Task(cfg, reward_fns={"flaky": (_poisoned(3), 1.0)})
  with pytest.raises(RewardError, match=r"'flaky' .* raised ValueError.* on completion 5 "):
    train(cfg, task=task)
  ckpt = Checkpointer(cfg, read_only=True)
  assert ckpt.steps() == [0, 1, 2]  # step 3 failed: nothing of it was saved
  assert ckpt.read_meta(2)["step"] == 2
  resumed = train(cfg)  # the fault fixed (the task's own reward): on from step 2
  assert resumed["resumed_from"] == 2 and resumed["steps_run"] == 4


def test_on_error_zero_scores_the_failing_completions_0_and_counts_them(tmp_path):
  cfg = small_config(tmp_path, **{"run.steps": 2, "rewards.on_error": "zero"})
  summary = train(cfg, task=Task(cfg, reward_fns={"flaky": (_poisoned(1, every=True), 1.0)}))
  rows = [json.loads(line) for line in open(summary["metrics"])]
  assert [r["rollout/reward_failures"] for r in rows] == [1, 1]


def test_a_reward_that_hangs_fails_the_step_by_its_deadline(tmp_path):
  """The reward stops returning on the third step: the run exits non-zero, naming it and
  the deadline, with step 2's checkpoint the newest. Without the deadline the subprocess
  would hang until this test's own timeout."""
  cfg = small_config(tmp_path, **CHECKPOINTED, **{"rewards.timeout_s": 2.0})
  config = tmp_path / "config.json"
  config.write_text(json.dumps(config_dict(cfg)))
  proc = subprocess.run(
    [sys.executable, str(STUCK), str(config), "3"],
    cwd=REPO,
    capture_output=True,
    text=True,
    timeout=300,
  )
  assert proc.returncode != 0
  assert "reward function 'stuck'" in proc.stderr, proc.stderr[-2000:]
  assert "did not return within config.rewards.timeout_s=2.0 s" in proc.stderr
  assert Checkpointer(cfg, read_only=True).steps() == [0, 1, 2]


def test_a_bad_on_error_names_the_key(tmp_path):
  from jaxrl_llm.train.config import ConfigError

  with pytest.raises(ConfigError, match=r"config.rewards.on_error='skip'; use 'raise'"):
    small_config(tmp_path, **{"rewards.on_error": "skip"})


def test_a_failed_checkpoint_write_stops_the_run_and_the_previous_one_resumes(
  tmp_path, monkeypatch
):
  """The disk fills while step 3's checkpoint is written (its metadata file raises ENOSPC in
  the background): the run stops naming the directory and the bytes it needed, step 2 stays
  the newest and restorable, and a re-run resumes from it to an uninterrupted run's params."""
  from orbax.checkpoint._src.handlers import json_checkpoint_handler

  handler = json_checkpoint_handler.JsonCheckpointHandler
  write = handler._save_fn

  async def full_disk(self, item, directory):
    if item.get("step") == 3:
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(directory))
    return await write(self, item, directory)

  cfg = small_config(tmp_path / "faulty", **CHECKPOINTED)
  monkeypatch.setattr(handler, "_save_fn", full_disk)
  message = (
    r"checkpoint step 3 could not be written to .*faulty/run/checkpoints: No space left on "
    r"device \(errno 28\)\. It needs about .* MiB \(\d+ bytes\).*step 2, is intact"
  )
  with pytest.raises(CheckpointWriteError, match=message):
    train(cfg)
  monkeypatch.undo()
  assert Checkpointer(cfg, read_only=True).steps() == [0, 1, 2]
  resumed = train(cfg)
  assert resumed["resumed_from"] == 2
  reference = train(small_config(tmp_path / "reference", **CHECKPOINTED))
  assert_bitwise_equal(params(resumed), params(reference))
