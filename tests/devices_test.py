"""The README's main command, shortened, on 2 and 8 fake CPU devices (1 device:
train_test.test_cli_runs), and the warm start fed faster than the devices compute."""

import json
import subprocess
import sys

import pytest
from helpers import run_cli, subprocess_env


@pytest.mark.slow
@pytest.mark.parametrize("devices", [2, 8])
def test_main_command_runs_on_several_devices(tmp_path, devices):
  """A short warm start, then 3 GRPO steps, on a data-parallel mesh of every device."""
  workdir = tmp_path / "run"
  env = subprocess_env()
  env["XLA_FLAGS"] += f" --xla_force_host_platform_device_count={devices}"
  out = run_cli(
    "--config.run.steps=3",
    "--config.warmstart.steps=40",
    "--config.run.eval_examples=64",
    "--config.run.eval_batch_size=64",
    f"--config.run.workdir={workdir}",
    "--config.run.progress=False",
    "--config.model.num_layers=1",
    env=env,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().splitlines()[-1].startswith("heldout_accuracy before=")
  summary = json.loads((workdir / "summary.json").read_text())
  assert summary["mesh"] == {"data": devices, "fsdp": 1, "tensor": 1}
  assert summary["warmstart_loss"] < 2.0  # below the 2.7 nats of a uniform guess over 15 ids
  assert len((workdir / "metrics.jsonl").read_text().splitlines()) == 3


@pytest.mark.slow
def test_warm_start_fed_faster_than_the_devices_compute():
  """1000 warm-start steps on 8 devices from a host that prepares each batch in no time. A host
  free to run ahead queues more than the 32 computations per device that XLA's CPU client
  takes, and then hangs in a gradient all-reduce until the process aborts; the warm start
  keeps one step in flight."""
  out = subprocess.run(
    [sys.executable, "tests/fixtures/warm_start_devices.py", "1000"],
    capture_output=True,
    text=True,
    timeout=600,
  )
  assert out.returncode == 0, out.stderr[-3000:]
  assert out.stdout.strip().splitlines()[-1].startswith("steps=1000 last_loss=")
