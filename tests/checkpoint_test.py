"""Checkpoints: exact resume after kill -9, a kill mid-save, corrupt checkpoints, another
mesh shape, config changes, SIGTERM, and a fresh start."""

import logging
import re
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest
from helpers import (
  REPO,
  N,
  assert_bitwise_equal,
  metric_rows,
  params,
  run_killed,
  small_config,
  subprocess_env,
)

from jaxrl_llm.train import ConfigError, train


def ppo_config(workdir, **overrides):
  """PPO with adaptive KL and entropy controllers and 2 minibatches: every part of the
  state moves."""
  settings = {
    "algo.estimator": "gae",
    "algo.kl_placement": "reward",
    "algo.kl_coef": 0.05,
    "algo.kl_mode": "adaptive",
    "algo.kl_target": 0.01,
    "algo.kl_horizon": 100,
    "algo.num_minibatches": 2,
    "algo.entropy_target": 5.0,  # above the policy's entropy: the bonus keeps growing
    "algo.entropy_step": 1e-3,
    "run.steps": 2 * N,
    "checkpoint.every": N,
  }
  cfg = small_config(workdir, **(settings | overrides))
  return cfg


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """An uninterrupted 2N-step run."""
  workdir = tmp_path_factory.mktemp("reference")
  summary = train(ppo_config(workdir))
  return workdir, summary


@pytest.mark.slow
def test_kill_9_then_resume_equals_uninterrupted_run(reference, tmp_path):
  ref_dir, ref = reference
  cfg = ppo_config(tmp_path)
  run_killed(cfg, "after-step", N + 1, tmp_path)  # dies after step N+1, last checkpoint N
  assert len(metric_rows(tmp_path)) == N + 1
  resumed = train(cfg)
  assert resumed["resumed_from"] == N
  state = params(resumed)
  assert_bitwise_equal(state, params(ref))
  assert float(state.kl.coef) != cfg.algo.kl_coef  # the adaptive controllers moved and came back
  assert float(state.entropy.coef) == pytest.approx(2 * N * cfg.algo.entropy_step)
  assert metric_rows(tmp_path) == metric_rows(ref_dir)  # rows N+1..2N recomputed, equal
  assert resumed["heldout_accuracy_before"] == ref["heldout_accuracy_before"]
  assert resumed["heldout_accuracy_after"] == ref["heldout_accuracy_after"]


@pytest.mark.slow
def test_kill_during_save_leaves_previous_checkpoint(reference, tmp_path):
  _, ref = reference
  cfg = ppo_config(tmp_path)
  run_killed(cfg, "during-save", 2 * N, tmp_path)
  checkpoints = tmp_path / "run" / "checkpoints"
  leftovers = [p.name for p in checkpoints.iterdir() if not p.name.isdigit()]
  assert leftovers, "the kill should have left an unfinished save behind"
  assert str(2 * N) not in {p.name for p in checkpoints.iterdir()}
  resumed = train(cfg)
  assert resumed["resumed_from"] == N
  assert_bitwise_equal(params(resumed), params(ref))
  assert [p.name for p in checkpoints.iterdir() if not p.name.isdigit()] == []


def _truncate_arrays(step_dir):
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.stat().st_size > 64]
  assert files
  for p in files:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garble_metadata(step_dir):
  (step_dir / "meta" / "metadata").write_text("{not json")


def _flip_array_bytes(step_dir):
  files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and "/d/" in str(p)]
  assert files
  for p in files:
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    p.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate_arrays, _garble_metadata, _flip_array_bytes])
def test_corrupt_latest_checkpoint_falls_back_to_previous(reference, tmp_path, damage, caplog):
  ref_dir, ref = reference
  shutil.copytree(ref_dir / "run", tmp_path / "run")
  checkpoints = tmp_path / "run" / "checkpoints"
  damage(checkpoints / str(2 * N))
  with caplog.at_level(logging.WARNING):
    resumed = train(ppo_config(tmp_path))
  assert f"checkpoint step {2 * N}" in caplog.text and "unusable" in caplog.text
  assert resumed["resumed_from"] == N
  assert_bitwise_equal(params(resumed), params(ref))  # steps N+1..2N done again, the same
  aside = list((tmp_path / "run" / "corrupt_checkpoints").iterdir())
  assert [p.name.split("-")[0] for p in aside] == [str(2 * N)]  # kept, not deleted


@pytest.mark.slow  # a second mesh's programs compiled from scratch
def test_restore_onto_another_mesh_shape(tmp_path):
  cfg8 = small_config(tmp_path, **{"mesh.data": 4, "mesh.fsdp": 2, "checkpoint.every": 1})
  saved8 = params(train(cfg8))
  cfg1 = small_config(tmp_path, **{"checkpoint.every": 1})
  one = train(cfg1, devices=jax.devices()[:1])
  assert one["resumed_from"] == 1 and one["learner"].mesh.size == 1
  assert_bitwise_equal(params(one), saved8)

  other = tmp_path / "other"
  cfg1 = small_config(other, **{"checkpoint.every": 1})
  saved1 = params(train(cfg1, devices=jax.devices()[:1]))
  cfg8 = small_config(other, **{"mesh.data": 4, "mesh.fsdp": 2, "checkpoint.every": 1})
  eight = train(cfg8)
  assert eight["resumed_from"] == 1
  assert_bitwise_equal(params(eight), saved1)
  embed = eight["learner"].state.policy["decoder"]["embed_VxD"][...]
  assert embed.sharding.mesh.shape == {"data": 4, "fsdp": 2, "tensor": 1}
  assert len(embed.addressable_shards) == 8


def test_resume_with_incompatible_config_names_the_difference(tmp_path):
  train(small_config(tmp_path, **{"checkpoint.every": 1}))
  changed = small_config(tmp_path, **{"checkpoint.every": 1, "model.hidden_size": 16})
  with pytest.raises(ConfigError, match=r"model.hidden_size: 32 -> 16") as err:
    train(changed)
  assert "checkpoint.fresh=True" in str(err.value)
  # Settings that do not change the math may differ: more steps continue the run.
  longer = train(small_config(tmp_path, **{"checkpoint.every": 1, "run.steps": 2}))
  assert longer["resumed_from"] == 1


def test_fresh_flag_sets_the_old_run_aside(tmp_path):
  train(small_config(tmp_path, **{"checkpoint.every": 1}))
  again = train(small_config(tmp_path, **{"checkpoint.every": 1, "checkpoint.fresh": True}))
  assert again["resumed_from"] is None
  (previous,) = (tmp_path / "run" / "previous").iterdir()
  assert sorted(p.name for p in previous.iterdir()) == [
    "checkpoints",
    "metrics.jsonl",
    "summary.json",
  ]
  assert [p.name for p in (previous / "checkpoints").iterdir()] == ["0", "1"]


def _signal_a_running_job(tmp_path, signum, every, **extra):
  """Starts the CLI on a long run (`extra`: more config flags), sends `signum` after its
  second step; returns the process (finished), its output and the run directory."""
  workdir = tmp_path / "run"
  flags = {
    "model.hidden_size": 32,
    "model.intermediate_size": 64,
    "model.num_layers": 1,
    "rollout.prompts_per_step": 8,
    "rollout.group_size": 4,
    "warmstart.steps": 0,
    "run.steps": 100000,
    "run.eval_examples": 16,
    "run.eval_batch_size": 16,
    "run.progress": False,
    "run.loggers": "jsonl",
    "run.workdir": str(workdir),
    "checkpoint.every": every,
    **extra,
  }
  command = [sys.executable, "-m", "jaxrl_llm.train", "--config", "experiments/configs/default.py"]
  command += [f"--config.{k}={v}" for k, v in flags.items()]
  proc = subprocess.Popen(
    command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env()
  )
  try:
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
      assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()
      time.sleep(0.2)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  return proc, out.decode(), err.decode(), workdir


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_after_the_step_and_exits_0(tmp_path, signum):
  """The save reports how long after the signal it finished; past the grace period (0 s
  here, for SIGTERM) it says the real machine would have lost it, naming the key."""
  grace = 0 if signum == signal.SIGTERM else 1e9
  proc, out, err, workdir = _signal_a_running_job(
    tmp_path, signum, every=100000, **{"checkpoint.preemption_grace_s": grace}
  )
  assert proc.returncode == 0, err[-3000:]
  steps = len((workdir / "metrics.jsonl").read_text().splitlines())
  assert f"preempted: saved step {steps};" in out
  name = signal.Signals(signum).name
  assert f"received {name}" in err
  assert re.search(rf"{name}: saved step {steps} to \S+, [\d.]+ s after the signal", err), err
  past = "past config.checkpoint.preemption_grace_s=0: a preemptible machine is stopped"
  assert (past in err) == (signum == signal.SIGTERM), err[-3000:]
  assert str(steps) in [p.name for p in (workdir / "checkpoints").iterdir()]


def test_without_checkpoints_sigterm_stops_the_run_as_usual(tmp_path):
  proc, _, err, workdir = _signal_a_running_job(tmp_path, signal.SIGTERM, every=0)
  assert proc.returncode == -signal.SIGTERM, err[-3000:]  # nothing to save: not deferred
  assert not (workdir / "checkpoints").exists()
