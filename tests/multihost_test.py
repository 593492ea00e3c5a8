"""Two processes x 4 fake CPU devices under jax.distributed (gloo) train, checkpoint and
resume exactly like one process with 8 devices."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import OnesTask, small_config, subprocess_env

from jaxrl_llm.train import train
from jaxrl_llm.train.checkpoint import config_dict

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "fixtures" / "multihost_run.py"
TIMING = ("perf/", "timing/")  # the groups of metrics that vary by run
DEADLINE_S = 70  # per launch; the test ends, pass or fail, well within 3 minutes


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _config(workdir, steps=3, **overrides):
  return small_config(
    workdir,
    **overrides,
    **{
      "mesh.data": 4,
      "mesh.fsdp": 2,  # parameters sharded across the two processes too
      "algo.num_minibatches": 2,
      "algo.kl_coef": 0.05,
      "rollout.dynamic_sampling": True,
      "run.steps": steps,
      "run.eval_every": 3,
      "checkpoint.every": 1,
    },
  )


def _launch(cfg, tmp_path, faults=("", ""), expect=(0, 0), deadline_s=DEADLINE_S) -> list[str]:
  """Runs `cfg` as 2 processes, process i with `faults[i]` (see the fixture), each expected
  to exit with `expect[i]` (None: any failure) within `deadline_s`; returns their logs."""
  config = tmp_path / "config.json"
  config.write_text(json.dumps(config_dict(cfg)))
  env = subprocess_env(
    JAX_NUM_CPU_DEVICES="4", JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", JAX_PLATFORMS="cpu"
  )
  coordinator = f"localhost:{_free_port()}"
  logs = [open(tmp_path / f"process{i}.log", "w") for i in range(2)]
  procs = [
    subprocess.Popen(
      [sys.executable, str(SCRIPT), str(config), coordinator, "2", str(i), faults[i]],
      cwd=REPO,
      env=env,
      stdout=logs[i],
      stderr=subprocess.STDOUT,
      start_new_session=True,  # its own process group, killed as a whole below
    )
    for i in range(2)
  ]
  try:
    deadline = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
      if expect == (0, 0) and any(p.poll() not in (None, 0) for p in procs):
        break  # one failed: the other would wait for it forever
      time.sleep(0.5)
  finally:
    for p in procs:
      if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL)
      p.wait()
    for f in logs:
      f.close()
  logs = [(tmp_path / f"process{i}.log").read_text() for i in range(2)]
  for i, (p, log) in enumerate(zip(procs, logs, strict=True)):
    code = p.returncode
    ok = code not in (0, -signal.SIGKILL) if expect[i] is None else code == expect[i]
    assert ok, f"process {i} exited {p.returncode}:\n{log[-4000:]}"
    assert f"process {i} of 2: 4 local devices, 8 in all" in log
  return logs


def _rows(workdir):
  rows = [json.loads(line) for line in (Path(workdir) / "metrics.jsonl").open()]
  return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in rows]


@pytest.mark.slow
def test_two_processes_equal_one_process_with_8_devices(tmp_path):
  # 2 iterations, then the same run continued to 3: the second launch resumes from the
  # checkpoint both processes wrote.
  _launch(_config(tmp_path / "multi", steps=2), tmp_path)
  multi_cfg = _config(tmp_path / "multi")
  logs = _launch(multi_cfg, tmp_path)
  assert all("resuming from step 2" in log for log in logs)
  single = train(_config(tmp_path / "single"), task=OnesTask(multi_cfg))
  learner = single["learner"]
  restored = ocp.CheckpointManager(Path(multi_cfg.run.workdir) / "checkpoints").restore(
    3, args=ocp.args.Composite(state=ocp.args.StandardRestore(learner.state_target()))
  )
  jax.tree.map(
    lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
    jax.device_get(restored.state.policy),
    jax.device_get(learner.state.policy),
  )
  assert int(restored.state.step) == 3
  multi_rows, single_rows = _rows(multi_cfg.run.workdir), _rows(single["workdir"])
  assert [r["step"] for r in multi_rows] == [1, 2, 3]  # process 0 alone writes
  for m, s in zip(multi_rows, single_rows, strict=True):
    assert m.keys() == s.keys()
    for key in m:
      if m[key] is None or s[key] is None:  # NaN in the JSON: no such sample this step
        assert m[key] == s[key], key
      else:
        np.testing.assert_allclose(m[key], s[key], rtol=1e-4, atol=1e-5, err_msg=key)
  summary = json.loads((Path(multi_cfg.run.workdir) / "summary.json").read_text())
  assert summary["heldout_accuracy_after"] == single["heldout_accuracy_after"]


@pytest.mark.slow
def test_async_sampler_mesh_spanning_two_processes(tmp_path):
  """Async mode across 2 processes x 4 devices: the sampler takes 2 devices of each
  process (a 4-device mesh over both) and decodes with its heads split over all 4
  (rollout.tensor=4: tensor-parallel across the processes), the trainer takes the other 4;
  the run equals the same async run in one process with 8 devices."""
  settings = {
    "mesh.fsdp": 2,
    "rollout.mode": "async",
    "rollout.sampler_devices": 4,
    "rollout.tensor": 4,
    "rollout.off_policy_steps": 1,
    "algo.correction": "token_tis",
    "run.steps": 2,
  }
  multi_cfg = small_config(tmp_path / "multi", **settings)
  _launch(multi_cfg, tmp_path)
  single = train(small_config(tmp_path / "single", **settings), task=OnesTask(multi_cfg))
  multi_rows, single_rows = _rows(multi_cfg.run.workdir), _rows(single["workdir"])
  assert [r["rollout/staleness_max"] for r in multi_rows] == [0, 1]
  for m, s in zip(multi_rows, single_rows, strict=True):
    for key in m:
      if m[key] is not None and s[key] is not None:
        np.testing.assert_allclose(m[key], s[key], rtol=1e-4, atol=1e-5, err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["after-step:2", "after-save:2"])
def test_a_dead_peer_ends_the_survivor_naming_it_and_both_resume(tmp_path, fault, uninterrupted):
  """kill -9 of process 1 between two steps, or while its checkpoint is being written:
  process 0 exits with PeerWatch.EXIT_CODE within its launch's deadline (it would otherwise
  wait in a collective or the save's barrier), naming the lost process and the checkpoint to
  resume from; restarting both resumes to the parameters and metrics of an uninterrupted
  run, bitwise (the checkpoints' fingerprints of every leaf)."""
  from jaxrl_llm.train.distributed import PeerWatch

  cfg = _config(tmp_path / "faulty", steps=4, **{"distributed.peer_timeout_s": 10.0})
  expect = (PeerWatch.EXIT_CODE, -signal.SIGKILL)
  logs = _launch(cfg, tmp_path, ("", fault), expect, deadline_s=DEADLINE_S + 30)
  assert "process 1 of 2 stopped answering for over 10 s" in logs[0], logs[0][-3000:]
  newest = int(re.search(r"the newest finished checkpoint is step (\d+)", logs[0])[1])
  assert 1 <= newest <= 2
  _resumes_as_uninterrupted(cfg, newest, tmp_path, uninterrupted)


@pytest.mark.slow
def test_a_dead_coordinator_ends_the_survivor_and_both_resume(tmp_path, uninterrupted):
  """kill -9 of process 0, which hosts the coordination service, inside step 2's save: JAX
  itself ends process 1 at once (the service is gone), and both resume bitwise."""
  cfg = _config(tmp_path / "faulty", steps=4, **{"distributed.peer_timeout_s": 10.0})
  faults = ("during-save:2", "during-save:2")  # only process 0 renames a finished save
  logs = _launch(cfg, tmp_path, faults, (-signal.SIGKILL, None), deadline_s=DEADLINE_S + 30)
  assert "JAX distributed service detected fatal errors" in logs[1], logs[1][-3000:]
  _resumes_as_uninterrupted(cfg, 1, tmp_path, uninterrupted)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """The dead-peer tests' run (2 processes, 4 steps), left alone."""
  tmp_path = tmp_path_factory.mktemp("uninterrupted")
  cfg = _config(tmp_path / "reference", steps=4, **{"distributed.peer_timeout_s": 10.0})
  _launch(cfg, tmp_path)
  return cfg


def _resumes_as_uninterrupted(cfg, newest: int, tmp_path, reference) -> None:
  """Both processes restarted resume from step `newest` and end as `reference` did."""
  from jaxrl_llm.train.checkpoint import Checkpointer

  logs = _launch(cfg, tmp_path)
  assert all(f"resuming from step {newest}" in log for log in logs)
  read = lambda c: Checkpointer(c, read_only=True).read_meta(4)["fingerprint"]  # noqa: E731
  assert read(cfg) == read(reference)
  assert _rows(cfg.run.workdir) == _rows(reference.run.workdir)
